"""Fuzzing the segment decoder with damaged real segments: it never crashes, never hangs,
and never allocates more than the input justifies, whatever the bytes say.

The steplog tests already cover every single-byte flip and every truncation of one small
segment with exact damage reports; these add splices, garbage, huge declared lengths and
frames whose checksums are valid but whose contents are hostile.
"""

from __future__ import annotations

import json
import tempfile
import tracemalloc
from functools import cache
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings

from pipeline.ingestion.decoder import read_segments
from schemas.records import FRAME_MARKER, FRAME_PREFIX, MAX_FRAME_PAYLOAD, FrameKind
from schemas.tables import DAMAGE, DROPS, HOLDERS, SEGMENTS, SLOTS, STEPS
from tests.helpers.segment_bytes import CountingChecksums, recorded_segments, resealed, with_length
from tests.helpers.steplog_samples import frame_spans

pytestmark = pytest.mark.timeout(120)
FUZZ = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
# Bytes a decode may allocate (as tracked by tracemalloc) per input byte, plus a constant.
MEMORY_PER_INPUT_BYTE = 16
MEMORY_CONSTANT = 2 << 20
DAMAGE_KINDS = {"torn_tail", "corrupt_frame", "unknown_version", "bad_header", "duplicate_segment"}


def decode(tmp_path: Path, *contents: bytes):
    paths = []
    for index, content in enumerate(contents):
        path = tmp_path / f"fuzzed-{index}.seg"
        path.write_bytes(content)
        paths.append(path)
    return read_segments(paths)


@cache
def original_rows() -> dict[str, list[dict[str, Any]]]:
    """Every row the intact segments decode to, without the segment id (splices move frames
    under another segment's header)."""
    decoded = read_segments_from_bytes(recorded_segments())
    return {
        name: [_without_segment(row) for row in getattr(decoded, name).to_pylist()]
        for name in ("steps", "slots", "holders")
    }


def read_segments_from_bytes(contents: tuple[bytes, ...]):
    with tempfile.TemporaryDirectory(prefix="hardening-originals-") as tmp:
        return decode(Path(tmp), *contents)


def _without_segment(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k != "segment_id"}


def assert_well_formed(decoded) -> None:
    for name, schema in (
        ("steps", STEPS),
        ("slots", SLOTS),
        ("holders", HOLDERS),
        ("segments", SEGMENTS),
        ("damage", DAMAGE),
        ("drops", DROPS),
    ):
        table = getattr(decoded, name)
        assert isinstance(table, pa.Table), name
        assert table.schema.equals(schema), name
        table.validate(full=True)
    assert set(decoded.damage.column("kind").to_pylist()) <= DAMAGE_KINDS


@st.composite
def damaged_files(draw) -> list[bytes]:
    """One or two files made from the recorded segments by a few random edits."""
    segments = recorded_segments()
    first = bytearray(draw(st.sampled_from(segments)))
    for _ in range(draw(st.integers(1, 4))):
        action = draw(
            st.sampled_from(["flip", "insert", "delete", "truncate", "splice", "garbage", "length"])
        )
        at = draw(st.integers(0, max(len(first) - 1, 0)))
        if action == "flip" and first:
            first[at] ^= draw(st.integers(1, 255))
        elif action == "insert":
            first[at:at] = draw(st.binary(min_size=1, max_size=64))
        elif action == "delete":
            del first[at : at + draw(st.integers(1, 300))]
        elif action == "truncate":
            del first[at:]
        elif action == "splice":
            other = draw(st.sampled_from(segments))
            first[at:] = other[draw(st.integers(0, len(other))) :]
        elif action == "garbage":
            first[at : at + draw(st.integers(0, 64))] = draw(st.binary(min_size=1, max_size=256))
        elif action == "length":
            spans = frame_spans(segments[0])
            start = draw(st.sampled_from([s for s, _ in spans]))
            length = draw(
                st.sampled_from(
                    [2**32 - 1, 2**31, MAX_FRAME_PAYLOAD, MAX_FRAME_PAYLOAD + 1, 10**6, 0, 1]
                )
            )
            first = bytearray(with_length(segments[0], start, length))
    files = [bytes(first)]
    if draw(st.booleans()):
        files.append(draw(st.sampled_from([*segments, draw(st.binary(max_size=2048))])))
    return files


@FUZZ
@given(files=damaged_files())
def test_damaged_segments_decode_to_true_rows_only(tmp_path, files):
    decoded = decode(tmp_path, *files)
    assert_well_formed(decoded)
    truth = original_rows()
    for name in ("steps", "slots", "holders"):
        rows = [_without_segment(row) for row in getattr(decoded, name).to_pylist()]
        assert all(row in truth[name] for row in rows), name


@FUZZ
@given(
    garbage=st.binary(max_size=4096),
    prefix=st.sampled_from([b"", b"STEPLOG\x00\x01\x00\x00\x00\x00\x00\x00\x00"]),
)
def test_random_garbage_is_reported_never_decoded(tmp_path, garbage, prefix):
    decoded = decode(tmp_path, prefix + garbage)
    assert_well_formed(decoded)
    assert decoded.steps.num_rows == 0
    assert decoded.damage.num_rows >= 1


@st.composite
def resealed_frames(draw) -> bytes:
    """A segment with one frame's payload rewritten and its checksum made valid again."""
    data = draw(st.sampled_from(recorded_segments()))
    spans = frame_spans(data)
    start, end = draw(st.sampled_from(spans))
    payload = bytearray(data[start + FRAME_PREFIX.size : end])
    for _ in range(draw(st.integers(1, 6))):
        action = draw(st.sampled_from(["overwrite", "extreme", "resize"]))
        at = draw(st.integers(0, max(len(payload) - 1, 0)))
        if action == "overwrite":
            payload[at : at + 8] = draw(st.binary(min_size=1, max_size=8))
        elif action == "extreme":
            width = draw(st.sampled_from([1, 4, 8]))
            payload[at : at + width] = (
                draw(st.sampled_from([b"\xff", b"\x00", b"\x7f", b"\x80"])) * width
            )
        elif draw(st.booleans()):
            payload[at:at] = draw(st.binary(min_size=1, max_size=32))
        else:
            del payload[at : at + draw(st.integers(1, 32))]
    return resealed(data, start, bytes(payload))


@FUZZ
@given(data=resealed_frames())
def test_frames_with_valid_checksums_and_hostile_contents(tmp_path, data):
    decoded = decode(tmp_path, data)
    assert_well_formed(decoded)
    steps = decoded.steps.to_pylist()
    slots = decoded.slots.to_pylist()
    assert sum(step["num_slots"] for step in steps) == len(slots)
    assert sum(step["num_holders"] for step in steps) == decoded.holders.num_rows


@pytest.mark.parametrize("length", [2**32 - 1, 2**31, MAX_FRAME_PAYLOAD, MAX_FRAME_PAYLOAD - 16])
@pytest.mark.parametrize("frame", [0, 1, -1], ids=["header", "first-step", "last-frame"])
def test_a_huge_declared_length_allocates_nothing(tmp_path, length, frame):
    data = recorded_segments()[0]
    start = frame_spans(data)[frame][0]
    hostile = with_length(data, start, length)
    path = tmp_path / "huge.seg"
    path.write_bytes(hostile)
    arrow_before = pa.total_allocated_bytes()
    tracemalloc.start()
    try:
        decoded = read_segments([path])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert_well_formed(decoded)
    bound = MEMORY_PER_INPUT_BYTE * len(hostile) + MEMORY_CONSTANT
    # tracemalloc sees Python and numpy allocations; Arrow's own pool is counted separately.
    assert peak < bound
    assert pa.total_allocated_bytes() - arrow_before < bound
    damage = decoded.damage.to_pylist()
    assert damage
    assert damage[0]["byte_offset"] == start
    # Every frame before the damaged one still decodes.
    intact_steps = sum(
        1 for s, e in frame_spans(data)[1:] if e <= start and data[s + 4] == FrameKind.STEP
    )
    assert decoded.steps.num_rows >= intact_steps


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(files=damaged_files())
def test_memory_is_bounded_by_the_input(tmp_path, files):
    paths = []
    for index, content in enumerate(files):
        paths.append(tmp_path / f"m{index}.seg")
        paths[-1].write_bytes(content)
    tracemalloc.start()
    try:
        read_segments(paths)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_PER_INPUT_BYTE * sum(map(len, files)) + MEMORY_CONSTANT


def header_with(data: bytes, **fields) -> bytes:
    """The segment with fields of its header frame's JSON replaced, checksum valid again."""
    start, end = frame_spans(data)[0]
    header = json.loads(data[start + FRAME_PREFIX.size : end])
    return resealed(data, start, json.dumps({**header, **fields}).encode())


@pytest.mark.parametrize(
    "fields",
    [
        {"wall_anchor_ns": 10**30},
        {"mono_anchor_ns": -(10**30)},
        {"first_seq": 2**70},
        {"wall_anchor_ns": 2**62, "mono_anchor_ns": -(2**62)},
    ],
    ids=["wall-anchor", "mono-anchor", "first-seq", "anchor-difference"],
)
def test_header_numbers_beyond_int64_are_a_bad_header(tmp_path, fields):
    data = recorded_segments()[0]
    decoded = decode(tmp_path, header_with(data, **fields))
    assert_well_formed(decoded)
    assert decoded.steps.num_rows == 0
    (row,) = decoded.damage.to_pylist()
    steps = sum(1 for s, _ in frame_spans(data)[1:] if data[s + 4] == FrameKind.STEP)
    assert (row["kind"], row["byte_offset"]) == ("bad_header", 16)
    assert row["detail"] == (
        f"segment header: first_seq or a clock anchor exceeds int64; {steps} intact step frames not decoded"
    )


@given(
    anchors=st.tuples(st.integers(-(2**70), 2**70), st.integers(-(2**70), 2**70)),
    first_seq=st.integers(-(2**70), 2**70),
)
@FUZZ
def test_any_header_numbers_decode_or_are_reported(tmp_path, anchors, first_seq):
    data = recorded_segments()[0]
    hostile = header_with(
        data, mono_anchor_ns=anchors[0], wall_anchor_ns=anchors[1], first_seq=first_seq
    )
    decoded = decode(tmp_path, hostile[:-7])
    assert_well_formed(decoded)


def test_a_step_time_that_overflows_int64_in_utc_is_not_decoded(tmp_path):
    data = recorded_segments()[0]
    decoded = decode(tmp_path, header_with(data, wall_anchor_ns=2**63 - 1))
    starts = decoded.steps.column("start_ns").to_pylist()
    utc = decoded.steps.column("start_utc_ns").to_pylist()
    # Every decoded UTC time must be the start time shifted by the anchors, not wrapped around.
    assert all(u - s == 2**63 - 1 - 5_000_000_000 for s, u in zip(starts, utc, strict=True))


def test_resynchronising_after_damage_is_linear_in_the_input(tmp_path, monkeypatch):
    # After a damaged frame the decoder scans for the next marker and verifies each candidate's
    # checksum over its declared length. Markers every 16 bytes, each declaring a frame that
    # reaches the end of the file, make that n**2 / 32 bytes of checksumming: 40 s for 1 MiB,
    # days for a 64 MiB segment.
    data = recorded_segments()[0]
    count = 4096
    storm = b"".join(
        FRAME_PREFIX.pack(
            FRAME_MARKER, FrameKind.STEP, 0, 0, (count - i - 1) * FRAME_PREFIX.size, 0
        )
        for i in range(count)
    )
    hostile = data + storm
    counting = CountingChecksums(monkeypatch)
    decoded = decode(tmp_path, hostile)
    assert decoded.steps.num_rows == read_segments_from_bytes((data,)).steps.num_rows
    assert counting.checksummed <= 4 * len(hostile)
