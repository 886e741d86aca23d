"""Real segments written by the StepRecorder, and the frame-level surgery the fuzzers apply."""

from __future__ import annotations

import tempfile
from functools import cache, partial
from pathlib import Path

import pytest

from pipeline.hook.format import frame_crc
from pipeline.hook.recorder import StepRecorder
from pipeline.ingestion import decoder
from schemas.records import FRAME_CHECKED_BYTES, FRAME_PREFIX
from tests.helpers.steplog_samples import HEADER, fixed_clocks, record_numbered_steps

# Ids a hostile client could choose: quotes, SQL, control characters, non-ASCII.
HOSTILE_IDS = (
    "req-'\"",
    "'); DROP TABLE ledger_lines; --",
    "a\nb\r\0\x1b[31m",
    "日本語-é-\u2028-🙂",
)


def _hostile_request_ids(step: int) -> list[str]:
    return [f"req-{step}", f"{HOSTILE_IDS[step % len(HOSTILE_IDS)]}-{step}"]


# Numbered steps whose second request id is hostile.
record_steps = partial(
    record_numbered_steps,
    request_ids=_hostile_request_ids,
    blocked=lambda step: step % 3 == 0,
)


@cache
def recorded_segments(steps: int = 24, rotate_bytes: int = 2500) -> tuple[bytes, ...]:
    """The bytes of the segments a recorder ships for `steps` steps (with one counted drop)."""
    with tempfile.TemporaryDirectory(prefix="hardening-segments-") as tmp:
        with StepRecorder(
            Path(tmp), HEADER, overflow="block", rotate_bytes=rotate_bytes, **fixed_clocks()
        ) as recorder:
            record_steps(recorder, 0, steps // 2)
            recorder.drop_step()
            record_steps(recorder, steps // 2 + 1, steps - steps // 2 - 1)
        return tuple(path.read_bytes() for path in recorder.shipped_segments)


def with_length(data: bytes, frame_start: int, length: int) -> bytes:
    """The segment with one frame's declared payload length replaced (checksum left as is)."""
    patched = bytearray(data)
    patched[frame_start + 8 : frame_start + 12] = length.to_bytes(4, "little")
    return bytes(patched)


def resealed(data: bytes, frame_start: int, payload: bytes) -> bytes:
    """The segment with one frame's payload replaced and its length and checksum made valid
    again, so the decoder must judge the contents rather than reject a checksum."""
    end = frame_start + FRAME_PREFIX.size + FRAME_PREFIX.unpack_from(data, frame_start)[4]
    checked = bytearray(data[frame_start : frame_start + FRAME_CHECKED_BYTES])
    checked[8:12] = len(payload).to_bytes(4, "little")
    crc = frame_crc(bytes(checked), payload).to_bytes(4, "little")
    return data[:frame_start] + bytes(checked) + crc + payload + data[end:]


class CountingChecksums:
    """Sums the bytes the decoder checksums (what its per-file budget bounds), file by file."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.checksummed = 0
        decode_file = decoder._decode_file

        def counted(path: Path) -> decoder._File:
            decoded = decode_file(path)
            self.checksummed += decoded.checksummed
            return decoded

        monkeypatch.setattr(decoder, "_decode_file", counted)
