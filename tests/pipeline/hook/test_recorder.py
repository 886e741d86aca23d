"""StepRecorder: rotation, shipping, drops, blocking, close, crash recovery and bad input."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.hook.recorder import PARTIAL_SUFFIX, RecorderError, StepRecorder
from pipeline.ingestion.decoder import read_segments

REPO = Path(__file__).resolve().parents[3]


def test_rotation_by_size_ships_contiguous_segments(tmp_path, write_segment):
    paths = write_segment(count=40, rotate_bytes=2000)
    decoded = read_segments(paths)
    assert decoded.damage.num_rows == 0
    assert decoded.steps.column("seq").to_pylist() == list(range(40))
    segments = decoded.segments.to_pylist()
    # Header ~800 bytes, steps ~180: the seventh step of a segment crosses 2000 bytes.
    assert [(s["first_seq"], s["last_seq"]) for s in segments] == [
        (0, 6),
        (7, 13),
        (14, 20),
        (21, 27),
        (28, 34),
        (35, 39),
    ]
    assert all(s["bytes"] >= 2000 for s in segments[:-1])
    assert segments[-1]["bytes"] < 2000
    assert [s["path"] for s in segments] == [str(p) for p in paths]
    assert len({s["segment_id"] for s in segments}) == len(paths)
    assert not list(tmp_path.rglob(f"*{PARTIAL_SUFFIX}"))


def test_rotation_by_time_ships_an_idle_segment(tmp_path, header, record_steps):
    outbox = tmp_path / "outbox"
    with StepRecorder(outbox, header, rotate_seconds=0.05) as recorder:
        record_steps(recorder, 0, 2)
        # However long a loaded machine takes to run the writer: pytest's timeout bounds it.
        while not list(outbox.glob("*.seg")):
            time.sleep(0.01)
        # Shipped while the recorder is still open and no further step has arrived.
        assert len(list(outbox.glob("*.seg"))) == 1
        record_steps(recorder, 2, 1)
    decoded = read_segments(outbox.glob("*.seg"))
    assert decoded.segments.column("steps").to_pylist() == [2, 1]
    assert decoded.steps.column("seq").to_pylist() == [0, 1, 2]


def test_segment_anchor_comes_from_the_clocks_given(tmp_path, write_segment, clocks):
    (path,) = write_segment(count=1)
    decoded = read_segments([path])
    segment = decoded.segments.to_pylist()[0]
    assert (segment["mono_anchor_ns"], segment["wall_anchor_ns"]) == (
        clocks["mono_clock"](),
        clocks["wall_clock"](),
    )
    step = decoded.steps.to_pylist()[0]
    assert step["start_utc_ns"] == clocks["wall_clock"]()
    assert step["end_utc_ns"] == clocks["wall_clock"]() + 700


def test_full_buffer_drops_whole_steps_and_logs_them(tmp_path, header, record_steps):
    entered, release = threading.Event(), threading.Event()

    def stalled_clock() -> int:
        # The writer reads the clock when it opens a segment: hold it there.
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            release.wait(10)
        return 1_000

    outbox = tmp_path / "outbox"
    recorder = StepRecorder(outbox, header, buffer_steps=2, mono_clock=stalled_clock)
    record_steps(recorder, 0, 1)
    assert entered.wait(10)
    accepted = [
        recorder.record_step(i, i, ["r"], [1], [0], [1.0], [1], [0], [0], [0]) for i in range(1, 10)
    ]
    assert accepted == [True, True] + [False] * 7
    recorder.drop_step()
    assert recorder.dropped_steps == 8
    release.set()
    recorder.close()
    decoded = read_segments(outbox.glob("*.seg"))
    assert decoded.steps.column("seq").to_pylist() == [0, 1, 2]
    assert decoded.drops.to_pylist() == [
        {"pool": header.pool, "replica": header.replica, "first_seq": 3, "last_seq": 10, "steps": 8}
    ]
    assert decoded.segments.column("dropped_steps").to_pylist() == [8]


def test_drops_before_a_step_are_placed_before_it(tmp_path, header, record_steps):
    outbox = tmp_path / "outbox"
    with StepRecorder(outbox, header) as recorder:
        recorder.drop_step()
        recorder.drop_step()
        record_steps(recorder, 2, 1)
    decoded = read_segments(outbox.glob("*.seg"))
    assert decoded.steps.column("seq").to_pylist() == [2]
    assert [(r["first_seq"], r["last_seq"]) for r in decoded.drops.to_pylist()] == [(0, 1)]
    assert decoded.segments.column("first_seq").to_pylist() == [0]


def test_block_mode_loses_nothing(tmp_path, header):
    outbox = tmp_path / "outbox"
    with StepRecorder(outbox, header, buffer_steps=1, overflow="block") as recorder:
        for i in range(300):
            assert recorder.record_step(i, i + 1, [f"r{i}"], [1], [i], [0.5], [4], [0], [0], [0])
    assert recorder.dropped_steps == 0
    assert read_segments(outbox.glob("*.seg")).steps.column("seq").to_pylist() == list(range(300))


def test_close_flushes_everything_queued(tmp_path, header, record_steps):
    outbox = tmp_path / "outbox"
    recorder = StepRecorder(outbox, header, rotate_seconds=3600)
    record_steps(recorder, 0, 1000)
    recorder.close()
    recorder.close()
    assert recorder.dropped_steps == 0
    assert sorted(outbox.glob("*.seg")) == sorted(recorder.shipped_segments)
    assert read_segments(outbox.glob("*.seg")).steps.num_rows == 1000
    assert not list(outbox.glob(f"*{PARTIAL_SUFFIX}"))
    assert not list(outbox.glob(f".*{PARTIAL_SUFFIX}"))
    with pytest.raises(RecorderError, match="after close"):
        record_steps(recorder, 1000, 1)


def test_invalid_steps_are_rejected_loudly_and_leave_a_drop(tmp_path, header, record_steps, caplog):
    outbox = tmp_path / "outbox"
    with caplog.at_level(logging.ERROR), StepRecorder(outbox, header) as recorder:
        record_steps(recorder, 0, 1)
        recorder.record_step(
            10, 20, ["a", "b"], [1, -2], [0, 0], [1.0, 1.0], [1, 1], [0, 0], [0, 0], [0, 0]
        )
        recorder.record_step(10, 20, ["a"], [1, 2], [0], [1.0], [1], [0], [0], [0])
        recorder.record_step(10, 20, ["a"], [1], [0], [1.0], [1], [0], [2], [0])
        recorder.record_step(
            10,
            20,
            [],
            [],
            [],
            [],
            [],
            [],
            [],
            [],
            holder_ids=["h"],
            holder_blocks=[1.0],
            holder_states=["preempted"],
        )
        recorder.record_step(30, 20, [], [], [], [], [], [], [], [])
        # A request id that is not a string, as a faulty engine could pass despite the types.
        not_string_ids: list[Any] = [7]
        recorder.record_step(10, 20, not_string_ids, [1], [0], [1.0], [1], [0], [0], [0])
        record_steps(recorder, 7, 1)
    assert recorder.rejected_steps == 6
    decoded = read_segments(outbox.glob("*.seg"))
    assert decoded.steps.column("seq").to_pylist() == [0, 7]
    assert [(r["first_seq"], r["last_seq"]) for r in decoded.drops.to_pylist()] == [
        (seq, seq) for seq in range(1, 7)
    ]
    messages = [record.getMessage() for record in caplog.records]
    reasons = {
        1: "new_tokens: values must lie in [0, 2147483647], got [-2, 1]",
        2: "new_tokens: expected 1 values",
        3: "spec_drafted exceeds new_tokens",
        # A legacy state is decoded from old segments but never written.
        4: "unknown states ['preempted']; expected one of ('waiting',)",
        5: "end_ns 20 precedes start_ns 30",
        6: "request_ids: strings required",
    }
    for step, reason in reasons.items():
        assert any(f"step {step} not recorded" in m and reason in m for m in messages), step


def test_writer_failure_ships_what_was_written_and_close_raises(tmp_path, header, record_steps):
    calls = []

    def failing_clock() -> int:
        calls.append(1)
        if len(calls) == 3:
            raise OSError("clock device gone")
        return 1_000

    outbox = tmp_path / "outbox"
    recorder = StepRecorder(outbox, header, mono_clock=failing_clock)
    record_steps(recorder, 0, 5)
    with pytest.raises(RecorderError, match="clock device gone"):
        recorder.close()
    decoded = read_segments(outbox.glob("*.seg"))
    seqs = decoded.steps.column("seq").to_pylist()
    assert seqs == list(range(len(seqs)))
    assert 1 <= len(seqs) <= 2
    assert decoded.damage.num_rows == 0
    assert not list(outbox.glob(f".*{PARTIAL_SUFFIX}"))


def test_options_are_checked(tmp_path, header):
    for options, message in (
        ({"buffer_steps": 0}, "buffer_steps"),
        ({"rotate_seconds": 0}, "rotate_seconds be positive"),
        ({"rotate_bytes": 2 << 30}, "rotate_bytes must lie in"),
        ({"overflow": "wait"}, "overflow"),
    ):
        with pytest.raises(ValueError, match=message):
            StepRecorder(tmp_path, header, **options)


CRASHING_PRODUCER = """
import os, sys, time
from pathlib import Path
from schemas.records import SegmentHeader
from pipeline.hook.recorder import PARTIAL_SUFFIX, StepRecorder
from tests.helpers.steplog_samples import complete_frames
outbox = Path(sys.argv[1])
header = SegmentHeader.from_json(sys.argv[2])
recorder = StepRecorder(outbox, header)
for i in range(5):
    recorder.record_step(i, i + 1, [f"r{i}"], [1], [i], [0.5], [4], [0], [0], [0])
# Until the writer has written the header and the five steps, however long that takes.
while sum(complete_frames(p.read_bytes()) for p in outbox.glob(f".*{PARTIAL_SUFFIX}")) < 6:
    time.sleep(0.01)
os._exit(0)
"""


def test_segment_of_a_crashed_process_is_shipped_by_the_next_recorder(tmp_path, header):
    outbox = tmp_path / "outbox"
    subprocess.run(
        [sys.executable, "-c", CRASHING_PRODUCER, str(outbox), header.to_json().decode()],
        check=True,
        cwd=REPO,
    )
    assert not list(outbox.glob("*.seg"))
    (partial,) = outbox.glob(f".*{PARTIAL_SUFFIX}")
    with StepRecorder(outbox, header) as recorder:
        pass
    assert recorder.shipped_segments == []
    (recovered,) = outbox.glob("*.seg")
    assert recovered.name == partial.name[1:].rsplit(".", 2)[0]
    decoded = read_segments([recovered])
    assert decoded.steps.column("seq").to_pylist() == [0, 1, 2, 3, 4]
    assert decoded.damage.num_rows == 0


def test_partial_file_of_a_live_process_is_left_alone(tmp_path, header):
    outbox = tmp_path / "outbox"
    outbox.mkdir()
    live = outbox / f".r.000000000000.abc.seg.{os.getpid()}{PARTIAL_SUFFIX}"
    live.write_bytes(b"in progress")
    with StepRecorder(outbox, header):
        pass
    assert live.exists()
