"""Damaged, duplicated and reordered segments: intact frames recovered, damage reported exactly."""

from __future__ import annotations

import json
import random
import shutil
import zlib
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, assume, given, settings

from pipeline.hook.format import frame
from pipeline.hook.recorder import StepRecorder
from pipeline.ingestion import decoder
from pipeline.ingestion.decoder import read_segments
from schemas.records import (
    DROP_STRUCT,
    FRAME_CHECKED_BYTES,
    FRAME_MARKER,
    FRAME_PREFIX,
    PREAMBLE,
    SLOT_DTYPE,
    STEP_STRUCT,
    FrameKind,
)
from tests.helpers.segment_bytes import CountingChecksums
from tests.helpers.steplog_samples import HEADER, MONO_ANCHOR, frame_spans


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
        complete = [
            seq
            for (start, end), seq in zip(spans, frame_seqs, strict=False)
            if end <= cut and seq is not None
        ]
        assert decoded.steps.column("seq").to_pylist() == (complete if cut >= header_end else []), (
            cut
        )
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
            last_complete = max(
                (
                    seq
                    for (s, e), seq in zip(spans, (None, 0, 1, 2, 3), strict=False)
                    if e <= cut and seq is not None
                ),
                default=-1,
            )
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
            assert [row["kind"] for row in damage] == [
                "unknown_version" if 8 <= position < 12 else "bad_header"
            ]
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
    assert decoded.steps.num_rows == 0
    assert decoded.segments.num_rows == 0
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
    assert (row["kind"], row["detail"], row["byte_offset"], row["byte_length"]) == (
        kind,
        detail,
        0,
        len(content),
    )


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
    assert row["kind"] == "duplicate_segment"
    assert row["path"] == str(torn)
    assert "which was kept" in row["detail"]
    assert str(small_segment) in row["detail"]


def test_reordered_and_duplicated_segments_decode_identically(tmp_path, write_segment):
    paths = write_segment(count=12, rotate_bytes=1500)
    assert len(paths) == 3
    expected = read_segments(paths)
    assert expected.steps.column("seq").to_pylist() == list(range(12))
    assert expected.segments.column("first_seq").to_pylist() == sorted(
        expected.segments.column("first_seq").to_pylist()
    )
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
    return (
        path.read_bytes(),
        decoded.steps.to_pylist(),
        decoded.slots.to_pylist(),
        decoded.holders.to_pylist(),
    )


edits = st.lists(
    st.tuples(
        st.sampled_from(["flip", "insert", "delete"]),
        st.integers(0, 10_000),
        st.binary(min_size=1, max_size=24),
    ),
    min_size=1,
    max_size=4,
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
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


# --- inputs built to make the decoder wrong or slow ------------------------------------------
INT64_MAX = 2**63 - 1
OVERFLOW_DETAIL = (
    "step start or end time plus the header's clock anchor shift (wall_anchor_ns - mono_anchor_ns = {shift}) "
    "is outside int64 nanoseconds, so the step has no UTC time"
)
HYPOTHESIS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def with_header_fields(data: bytes, **fields) -> bytes:
    """The segment with fields of its header JSON replaced, framed with a valid checksum."""
    start, end = frame_spans(data)[0]
    header = json.loads(data[start + FRAME_PREFIX.size : end])
    return (
        data[:start]
        + frame(FrameKind.HEADER, json.dumps({**header, **fields}).encode())
        + data[end:]
    )


def test_steps_whose_utc_time_overflows_are_reported_and_the_rest_decoded(tmp_path, small_segment):
    # Step k ends at MONO_ANCHOR + 1000 k + 700: step 0 ends exactly at the largest int64 in UTC.
    wall_anchor = INT64_MAX - 700
    data = with_header_fields(small_segment.read_bytes(), wall_anchor_ns=wall_anchor)
    spans = frame_spans(data)
    decoded = decode_bytes(tmp_path, data)
    (step,) = decoded.steps.to_pylist()
    assert (step["seq"], step["start_utc_ns"], step["end_utc_ns"]) == (
        0,
        INT64_MAX - 700,
        INT64_MAX,
    )
    assert decoded.slots.column("seq").to_pylist() == [0, 0]
    assert decoded.holders.column("seq").to_pylist() == [0]
    detail = OVERFLOW_DETAIL.format(shift=wall_anchor - MONO_ANCHOR)
    # Steps 1 and 3 are separated by the drop frame of step 2: two damaged regions.
    assert decoded.damage.to_pylist() == [
        {
            "path": str(tmp_path / "damaged.seg"),
            "kind": "corrupt_frame",
            "byte_offset": start,
            "byte_length": end - start,
            "first_seq": seq,
            "last_seq": seq,
            "detail": detail,
        }
        for (start, end), seq in ((spans[2], 1), (spans[4], 3))
    ]


def test_adjacent_overflowing_steps_are_one_damaged_region(tmp_path, write_segment):
    (path,) = write_segment(40)
    data = with_header_fields(path.read_bytes(), wall_anchor_ns=INT64_MAX)
    spans = frame_spans(data)
    decoded = decode_bytes(tmp_path, data)
    assert decoded.steps.num_rows == decoded.slots.num_rows == decoded.holders.num_rows == 0
    (row,) = decoded.damage.to_pylist()
    steps_start = spans[1][0]
    assert (row["kind"], row["byte_offset"], row["byte_length"]) == (
        "corrupt_frame",
        steps_start,
        len(data) - steps_start,
    )
    assert (row["first_seq"], row["last_seq"]) == (0, 39)
    assert row["detail"] == OVERFLOW_DETAIL.format(shift=INT64_MAX - MONO_ANCHOR)


@HYPOTHESIS
@given(
    mono_anchor=st.integers(-(2**63), INT64_MAX),
    shift=st.one_of(st.integers(-(2**63), INT64_MAX), st.integers(INT64_MAX - 10_000, INT64_MAX)),
)
def test_every_step_is_either_shifted_exactly_or_reported(
    tmp_path, small_segment, mono_anchor, shift
):
    data = small_segment.read_bytes()
    wall_anchor = mono_anchor + shift
    assume(-(2**63) <= wall_anchor <= INT64_MAX)
    decoded = decode_bytes(
        tmp_path, with_header_fields(data, mono_anchor_ns=mono_anchor, wall_anchor_ns=wall_anchor)
    )
    steps = decoded.steps.to_pylist()
    for step in steps:
        assert (step["start_utc_ns"], step["end_utc_ns"]) == (
            step["start_ns"] + shift,
            step["end_ns"] + shift,
        )
    reported = [
        seq
        for row in decoded.damage.to_pylist()
        if row["detail"] == OVERFLOW_DETAIL.format(shift=shift)
        for seq in range(row["first_seq"], row["last_seq"] + 1)
    ]
    assert sorted([step["seq"] for step in steps] + reported) == [0, 1, 3]


@pytest.fixture
def counting_checksums(monkeypatch) -> CountingChecksums:
    return CountingChecksums(monkeypatch)


def consistent_storm(count: int) -> bytes:
    """`count` step frame prefixes, each declaring a frame to the end of the data whose request
    id bytes swallow the rest: every one passes the structural checks, none its checksum."""
    size = FRAME_PREFIX.size + STEP_STRUCT.size
    return b"".join(
        FRAME_PREFIX.pack(
            FRAME_MARKER, FrameKind.STEP, 0, 0, (count - i) * size - FRAME_PREFIX.size, 0
        )
        + STEP_STRUCT.pack(0, 0, 0, 0, 0, 0, 0, (count - i - 1) * size, 0, 0)
        for i in range(count)
    )


def test_every_frame_is_checksummed_once(tmp_path, small_segment, counting_checksums):
    data = small_segment.read_bytes()
    cut = frame_spans(data)[2][0]
    # Markers whose lengths run to the end of the file but whose step counts cannot fit them.
    junk = b"".join(
        FRAME_PREFIX.pack(FRAME_MARKER, FrameKind.STEP, 0, 0, 10**5, 0) for _ in range(64)
    )
    decoded = decode_bytes(tmp_path, data[:cut] + junk + data[cut:])
    assert decoded.steps.column("seq").to_pylist() == [0, 1, 3]
    (row,) = decoded.damage.to_pylist()
    assert (row["kind"], row["byte_offset"], row["byte_length"]) == (
        "corrupt_frame",
        cut,
        len(junk),
    )
    # The prefix's own CRC field is the only part of a frame not checksummed.
    crc_field = FRAME_PREFIX.size - FRAME_CHECKED_BYTES
    assert counting_checksums.checksummed == sum(
        end - start - crc_field for start, end in frame_spans(data)
    )


def test_resynchronisation_gives_up_past_the_checksum_budget(
    tmp_path, small_segment, counting_checksums
):
    data = small_segment.read_bytes()
    storm = consistent_storm(2000)
    hostile = data + storm
    decoded = decode_bytes(tmp_path, hostile)
    assert decoded.steps.column("seq").to_pylist() == [0, 1, 3]
    assert counting_checksums.checksummed <= decoder.CRC_BYTES_PER_FILE_BYTE * len(hostile)
    assert decoded.damage.to_pylist() == [
        {
            "path": str(tmp_path / "damaged.seg"),
            "kind": "corrupt_frame",
            "byte_offset": len(data),
            "byte_length": len(storm),
            "first_seq": 4,
            "last_seq": None,
            "detail": f"resynchronisation gave up at byte {len(data)}: checking further frames would checksum more "
            f"than 2x the file's {len(hostile)} bytes; the remaining {len(storm)} bytes are not read",
        }
    ]


@HYPOTHESIS
@given(
    pieces=st.lists(
        st.one_of(
            st.integers(1, 4).map(lambda index: ("frame", index)),
            st.integers(1, 300).map(lambda count: ("storm", count)),
            st.binary(min_size=1, max_size=64).map(lambda blob: ("bytes", blob)),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_checksumming_is_bounded_by_the_file_size(tmp_path, small_segment, monkeypatch, pieces):
    counting = CountingChecksums(monkeypatch)
    data = small_segment.read_bytes()
    spans = frame_spans(data)
    hostile = data[: spans[1][0]] + b"".join(
        data[slice(*spans[value])]
        if what == "frame"
        else consistent_storm(value)
        if what == "storm"
        else value
        for what, value in pieces
    )
    decoded = decode_bytes(tmp_path, hostile)
    assert counting.checksummed <= decoder.CRC_BYTES_PER_FILE_BYTE * len(hostile)
    assert set(decoded.steps.column("seq").to_pylist()) <= {0, 1, 3}


def test_a_drop_frame_naming_a_backwards_range_is_reported(tmp_path, small_segment):
    data = small_segment.read_bytes()
    start, end = frame_spans(data)[3]
    decoded = decode_bytes(
        tmp_path, data[:start] + frame(FrameKind.DROP, DROP_STRUCT.pack(5, 2)) + data[end:]
    )
    assert decoded.steps.column("seq").to_pylist() == [0, 1, 3]
    assert decoded.drops.num_rows == 0
    (row,) = decoded.damage.to_pylist()
    assert (row["kind"], row["byte_offset"], row["byte_length"]) == (
        "corrupt_frame",
        start,
        end - start,
    )
    assert (row["first_seq"], row["last_seq"]) == (2, 2)
    assert row["detail"] == "drop frame whose first_seq 5 exceeds its last_seq 2"


def test_garbage_after_the_last_frame_hides_no_step_when_the_next_segment_follows(
    tmp_path, write_segment
):
    paths = write_segment(count=12, rotate_bytes=1500)
    second_start = read_segments(paths[1:2]).segments.column("first_seq")[0].as_py()
    with paths[0].open("ab") as handle:
        handle.write(b"\0garbage")
    decoded = read_segments(paths)
    (row,) = decoded.damage.to_pylist()
    # The range starts after the last intact frame and ends before the next segment: empty.
    assert (row["kind"], row["first_seq"], row["last_seq"]) == (
        "corrupt_frame",
        second_start,
        second_start - 1,
    )
    assert decoded.steps.column("seq").to_pylist() == list(range(12))


def test_a_file_without_a_header_is_scoped_by_its_name(tmp_path, write_segment):
    paths = write_segment(count=12, rotate_bytes=1500)
    starts = read_segments(paths).segments.column("first_seq").to_pylist()
    lost = paths[1]
    assert lost.name.startswith(f"{HEADER.replica}.{starts[1]:012d}.")
    lost.write_bytes(b"")
    (row,) = read_segments(paths).damage.to_pylist()
    assert (row["kind"], row["first_seq"], row["last_seq"]) == (
        "torn_tail",
        starts[1],
        starts[2] - 1,
    )
    # A name that does not say where the file starts leaves the range unknown: it may hide
    # any step of the replica.
    stray = lost.rename(lost.with_name("stray.seg"))
    (row,) = read_segments([paths[0], stray, paths[2]]).damage.to_pylist()
    assert (row["first_seq"], row["last_seq"]) == (None, None)


def test_what_is_no_readable_file_is_damage_and_nothing_blocks(tmp_path, write_segment):
    import os

    (path,) = write_segment(count=3)
    odd = tmp_path / "odd"
    odd.mkdir()
    os.mkfifo(odd / "fifo.seg")
    (odd / "dir.seg").mkdir()
    (odd / "dangling.seg").symlink_to(odd / "gone.seg")
    (odd / "loop.seg").symlink_to("loop.seg")
    (odd / "eio.seg").symlink_to("/proc/self/mem")  # refuses every reader at offset 0
    (odd / "copy.seg").symlink_to(path)  # a symlink to a segment is read through
    decoded = read_segments([path, *sorted(odd.iterdir())])
    assert decoded.steps.column("seq").to_pylist() == [0, 1, 2]
    assert sorted(
        (Path(r["path"]).name, r["kind"], r["detail"]) for r in decoded.damage.to_pylist()
    ) == [
        (
            path.name,
            "duplicate_segment",
            f"identical content to {odd / 'copy.seg'}, which was kept",
        ),
        ("dangling.seg", "unreadable", "cannot open: No such file or directory"),
        ("dir.seg", "unreadable", "a directory, not a segment file"),
        ("eio.seg", "unreadable", "cannot read: Input/output error"),
        ("fifo.seg", "unreadable", "a FIFO, not a segment file"),
        ("loop.seg", "unreadable", "cannot open: Too many levels of symbolic links"),
    ]


@pytest.mark.parametrize(("code", "state"), [(1, "preempted"), (2, None)])
def test_a_legacy_holder_state_decodes_and_an_unknown_one_is_damage(
    tmp_path, small_segment, code, state
):
    """Recorders once wrote holders in state 1 ("preempted"); none writes it now, but the
    segments they left must still decode. Code 2 names no state at all."""
    data = small_segment.read_bytes()
    start, end = frame_spans(data)[1]
    payload = bytearray(data[start + FRAME_PREFIX.size : end])
    fixed = STEP_STRUCT.unpack_from(payload)
    slots, request_id_bytes = fixed[5], fixed[7]
    # The first holder record: after the fixed part, the slots and the slots' ids, past the
    # holder's u32 id length.
    payload[STEP_STRUCT.size + SLOT_DTYPE.itemsize * slots + request_id_bytes + 4] = code
    checked = data[start : start + FRAME_CHECKED_BYTES]
    crc = zlib.crc32(payload, zlib.crc32(checked)).to_bytes(4, "little")
    decoded = decode_bytes(tmp_path, data[:start] + checked + crc + bytes(payload) + data[end:])
    if state is None:
        assert decoded.steps.column("seq").to_pylist() == [1, 3]
        assert decoded.damage.column("kind").to_pylist() == ["corrupt_frame"]
        return
    assert decoded.damage.num_rows == 0
    assert decoded.holders.select(["seq", "state"]).to_pylist() == [
        {"seq": 0, "state": "preempted"},
        {"seq": 1, "state": "waiting"},
        {"seq": 3, "state": "waiting"},
    ]
