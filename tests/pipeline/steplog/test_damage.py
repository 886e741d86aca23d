"""Damaged, duplicated and reordered segments: intact frames recovered, damage reported exactly."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from pipeline.steplog import StepRecorder, read_segments
from schemas.records import FRAME_PREFIX, PREAMBLE


def frame_spans(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of every frame after the preamble, read from the length fields."""
    spans, pos = [], PREAMBLE.size
    while pos < len(data):
        length = FRAME_PREFIX.unpack_from(data, pos)[4]
        spans.append((pos, pos + FRAME_PREFIX.size + length))
        pos = spans[-1][1]
    return spans


@pytest.fixture
def small_segment(tmp_path, header, clocks, record_steps) -> Path:
    """Header, steps 0-1, a drop of step 2, step 3: five frames."""
    with StepRecorder(tmp_path / "outbox", header, overflow="block", **clocks) as recorder:
        record_steps(recorder, 0, 2)
        recorder.drop_step()
        record_steps(recorder, 3, 1)
    (path,) = recorder.shipped_segments
    return path


def decode_bytes(tmp_path: Path, data: bytes, name: str = "damaged.seg"):
    path = tmp_path / name
    path.write_bytes(data)
    return read_segments([path])


def test_small_segment_layout(small_segment):
    data = small_segment.read_bytes()
    spans = frame_spans(data)
    assert len(spans) == 5
    assert spans[-1][1] == len(data)
    assert read_segments([small_segment]).steps.column("seq").to_pylist() == [0, 1, 3]


def test_truncation_at_every_byte(tmp_path, small_segment):
    data = small_segment.read_bytes()
    spans = frame_spans(data)
    header_end = spans[0][1]
    frame_seqs = [None, 0, 1, None, 3]  # header, step 0, step 1, drop of 2, step 3
    for cut in range(len(data)):
        decoded = decode_bytes(tmp_path, data[:cut])
        complete = [seq for (start, end), seq in zip(spans, frame_seqs) if end <= cut and seq is not None]
        assert decoded.steps.column("seq").to_pylist() == (complete if cut >= header_end else []), cut
        damage = decoded.damage.to_pylist()
        if cut in {end for _, end in spans}:
            assert damage == [], cut
            continue
        (row,) = damage
        assert row["kind"] == "torn_tail", cut
        torn_start = max([start for start, _ in spans if start <= cut], default=0)
        assert (row["byte_offset"], row["byte_length"]) == (torn_start, cut - torn_start), cut
        if cut > header_end:
            # The torn frame follows the last complete one; step 1's frame hides seq 1 onward.
            last_complete = max((seq for (s, e), seq in zip(spans, (None, 0, 1, 2, 3)) if e <= cut and seq is not None), default=-1)
            assert row["first_seq"] == last_complete + 1, cut


def test_every_flipped_byte_is_detected_and_other_frames_survive(tmp_path, small_segment):
    data = small_segment.read_bytes()
    spans = frame_spans(data)
    frame_seqs = [None, 0, 1, 2, 3]
    for position in range(len(data)):
        damaged = bytearray(data)
        damaged[position] ^= 0x5A
        decoded = decode_bytes(tmp_path, bytes(damaged))
        damage = decoded.damage.to_pylist()
        seqs = decoded.steps.column("seq").to_pylist()
        if position < PREAMBLE.size:
            assert [row["kind"] for row in damage] == ["unknown_version" if 8 <= position < 12 else "bad_header"]
            assert seqs == []
            continue
        index = next(i for i, (start, end) in enumerate(spans) if start <= position < end)
        if index == 0:
            assert [row["kind"] for row in damage] == ["bad_header"], position
            assert (damage[0]["first_seq"], damage[0]["last_seq"]) == (0, 3)
            assert seqs == []
            continue
        start, end = spans[index]
        (row,) = damage
        assert row["byte_offset"] == start, position
        if index < len(spans) - 1:
            assert (row["kind"], row["byte_length"]) == ("corrupt_frame", end - start), position
        else:
            assert row["kind"] in ("corrupt_frame", "torn_tail"), position
        assert row["first_seq"] == frame_seqs[index], position
        assert seqs == [seq for seq in (0, 1, 3) if seq != frame_seqs[index]], position


def test_garbage_between_frames_is_skipped(tmp_path, small_segment):
    data = small_segment.read_bytes()
    spans = frame_spans(data)
    cut = spans[2][0]
    decoded = decode_bytes(tmp_path, data[:cut] + b"\x00garbage\xf5SLF" + data[cut:])
    assert decoded.steps.column("seq").to_pylist() == [0, 1, 3]
    assert decoded.damage.to_pylist() == [
        {
            "path": str(tmp_path / "damaged.seg"),
            "kind": "corrupt_frame",
            "byte_offset": cut,
            "byte_length": 12,
            "first_seq": 1,
            "last_seq": 0,
            "detail": "bad frame marker, length or checksum",
        }
    ]


def test_unknown_version_is_reported_not_guessed(tmp_path, small_segment):
    data = bytearray(small_segment.read_bytes())
    data[8:12] = (2).to_bytes(4, "little")
    decoded = decode_bytes(tmp_path, bytes(data))
    assert decoded.steps.num_rows == 0 and decoded.segments.num_rows == 0
    (row,) = decoded.damage.to_pylist()
    assert row["kind"] == "unknown_version"
    assert row["detail"] == "format version 2; this decoder reads version 1"
    assert (row["byte_offset"], row["byte_length"]) == (0, len(data))


@pytest.mark.parametrize(
    ("content", "kind", "detail"),
    [
        (b"", "torn_tail", "empty file"),
        (b"STEPL", "torn_tail", "file ends inside the 16-byte preamble"),
        (b"PK\x03\x04 not a segment at all", "bad_header", "not a step segment (bad preamble)"),
        (b"{}", "bad_header", "not a step segment (no STEPLOG magic)"),
    ],
)
def test_files_that_are_not_segments(tmp_path, content, kind, detail):
    (row,) = decode_bytes(tmp_path, content).damage.to_pylist()
    assert (row["kind"], row["detail"], row["byte_offset"], row["byte_length"]) == (kind, detail, 0, len(content))


def test_duplicate_copy_under_another_name_is_kept_once(tmp_path, small_segment):
    copy = tmp_path / "resent" / "copy.seg"
    copy.parent.mkdir()
    shutil.copy(small_segment, copy)
    decoded = read_segments([small_segment, copy])
    assert decoded.steps.column("seq").to_pylist() == [0, 1, 3]
    assert decoded.segments.num_rows == 1
    (row,) = decoded.damage.to_pylist()
    kept, dropped = sorted([small_segment, copy], key=str)
    assert row["kind"] == "duplicate_segment"
    assert row["path"] == str(dropped)
    assert row["detail"] == f"identical content to {kept}, which was kept"
    assert (row["first_seq"], row["last_seq"]) == (0, 3)


def test_duplicate_with_a_torn_tail_yields_to_the_intact_copy(tmp_path, small_segment):
    data = small_segment.read_bytes()
    torn = tmp_path / "a-torn.seg"
    torn.write_bytes(data[:-3])
    decoded = read_segments([torn, small_segment])
    assert decoded.steps.column("seq").to_pylist() == [0, 1, 3]
    (row,) = decoded.damage.to_pylist()
    assert row["kind"] == "duplicate_segment" and row["path"] == str(torn)
    assert "which was kept" in row["detail"] and str(small_segment) in row["detail"]


def test_reordered_and_duplicated_segments_decode_identically(tmp_path, write_segment):
    paths = write_segment(count=12, rotate_bytes=1500)
    assert len(paths) == 3
    expected = read_segments(paths)
    assert expected.steps.column("seq").to_pylist() == list(range(12))
    assert expected.segments.column("first_seq").to_pylist() == sorted(expected.segments.column("first_seq").to_pylist())
    shuffled = list(paths)
    random.Random(3).shuffle(shuffled)
    again = read_segments(shuffled)
    for name in ("steps", "slots", "holders", "segments", "drops"):
        assert getattr(again, name).equals(getattr(expected, name)), name
    shutil.copy(paths[1], tmp_path / "zz-copy.seg")
    with_copy = read_segments([tmp_path / "zz-copy.seg", *shuffled])
    assert with_copy.steps.equals(expected.steps)
    assert with_copy.damage.column("kind").to_pylist() == ["duplicate_segment"]


def test_torn_tail_is_bounded_by_the_next_segment(tmp_path, write_segment):
    paths = write_segment(count=12, rotate_bytes=1500)
    first = read_segments(paths[:1]).steps.column("seq").to_pylist()
    second_start = read_segments(paths[1:2]).segments.column("first_seq")[0].as_py()
    data = paths[0].read_bytes()
    spans = frame_spans(data)
    paths[0].write_bytes(data[: spans[-1][0] + 20])
    decoded = read_segments(paths)
    (row,) = decoded.damage.to_pylist()
    assert row["kind"] == "torn_tail"
    assert (row["first_seq"], row["last_seq"]) == (first[-1], second_start - 1)
    assert decoded.steps.column("seq").to_pylist() == [seq for seq in range(12) if seq != first[-1]]


@pytest.fixture(scope="session")
def clean_segment(tmp_path_factory, header, clocks, record_steps):
    """Six steps' segment bytes and what they decode to."""
    outbox = tmp_path_factory.mktemp("outbox")
    with StepRecorder(outbox, header, overflow="block", **clocks) as recorder:
        record_steps(recorder, 0, 6)
    (path,) = recorder.shipped_segments
    decoded = read_segments([path])
    return path.read_bytes(), decoded.steps.to_pylist(), decoded.slots.to_pylist(), decoded.holders.to_pylist()


edits = st.lists(
    st.tuples(st.sampled_from(["flip", "insert", "delete"]), st.integers(0, 10_000), st.binary(min_size=1, max_size=24)),
    min_size=1,
    max_size=4,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=edits)
def test_any_damage_is_reported_and_only_true_rows_come_back(tmp_path, clean_segment, edits):
    original, steps, slots, holders = clean_segment
    data = bytearray(original)
    for action, position, blob in edits:
        position %= len(data) + 1
        if action == "flip" and position < len(data):
            data[position] ^= blob[0] or 0xFF
        elif action == "insert":
            data[position:position] = blob
        else:
            del data[position : position + len(blob)]
    decoded = decode_bytes(tmp_path, bytes(data))
    assert all(row in steps for row in decoded.steps.to_pylist())
    assert all(row in slots for row in decoded.slots.to_pylist())
    assert all(row in holders for row in decoded.holders.to_pylist())
    if bytes(data) != original:
        assert decoded.damage.num_rows >= 1
