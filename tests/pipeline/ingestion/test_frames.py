"""The compiled frame scan's CRC-32 is zlib's, byte for byte, at every alignment."""

from __future__ import annotations

import zlib

import hypothesis.strategies as st
import numpy as np
from hypothesis import given

from pipeline.ingestion.frames import crc32


@given(
    data=st.binary(max_size=200),
    cut=st.tuples(st.integers(0, 200), st.integers(0, 200)),
    seed=st.integers(0, 2**32 - 1),
)
def test_crc32_equals_zlibs(data, cut, seed):
    start, end = sorted(min(c, len(data)) for c in cut)
    array = np.frombuffer(data, np.uint8)
    assert crc32(array, start, end, seed) == zlib.crc32(data[start:end], seed)


def test_crc32_of_a_known_text():
    # The CRC-32 check value of the ASCII digits 1 to 9 (ITU-T V.42, zlib).
    assert crc32(np.frombuffer(b"123456789", np.uint8), 0, 9, 0) == 0xCBF43926
