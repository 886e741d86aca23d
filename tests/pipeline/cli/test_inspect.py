"""`stepledger inspect`: headers, ranges, gaps, drops, damage, and the exit code."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.cli.inspect import seq_runs
from pipeline.hook.recorder import StepRecorder


def inspect(*args: str):
    return CliRunner().invoke(main, ["inspect", *args])


def test_clean_directory_exits_zero(tmp_path, write_segment):
    write_segment(count=5)
    result = inspect(str(tmp_path / "outbox"))
    assert result.exit_code == 0, result.output
    assert "chat-8b / chat-8b-r0" in result.output
    assert "no damage" in result.output


def test_json_report_names_ranges_drops_gaps_and_damage(tmp_path, header, clocks, record_steps):
    outbox = tmp_path / "outbox"
    with StepRecorder(outbox, header, overflow="block", rotate_bytes=1200, **clocks) as recorder:
        record_steps(recorder, 0, 3)
        recorder.drop_step()
        recorder.drop_step()
        record_steps(recorder, 5, 6)
    paths = sorted(outbox.glob("*.seg"))
    # Segments hold seq 0-1, 2-5 (with the drop of 3-4), 6-7, 8-9, 10; lose the third.
    assert len(paths) == 5
    paths[2].unlink()
    result = inspect(str(outbox), "--json")
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert [s["seq_ranges"] for s in report["segments"]] == [
        [[0, 1]],
        [[2, 2], [5, 5]],
        [[8, 9]],
        [[10, 10]],
    ]
    (replica,) = report["replicas"]
    assert replica["seq_ranges"] == [[0, 2], [5, 5], [8, 10]]
    assert replica["drops"] == [[3, 4]]
    assert replica["dropped_steps"] == 2
    assert replica["gaps"] == [{"first_seq": 6, "last_seq": 7, "steps": 2, "explained_by": []}]
    assert report["ok"] is False
    assert report["damage"] == []


def test_damage_exits_non_zero_and_is_listed(tmp_path, write_segment):
    (path,) = write_segment(count=4)
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    result = inspect(str(path))
    assert result.exit_code == 1
    assert "torn_tail" in result.output
    report = json.loads(inspect(str(path), "--json").output)
    (row,) = report["damage"]
    assert (row["kind"], row["first_seq"], row["last_seq"]) == ("torn_tail", 3, None)
    assert report["segments"][0]["seq_ranges"] == [[0, 2]]


def test_no_segments_is_a_usage_error(tmp_path):
    result = inspect(str(tmp_path))
    assert result.exit_code == 2
    assert "no *.seg files" in result.output


def test_seq_runs():
    assert seq_runs(np.array([], np.int64)) == []
    assert seq_runs(np.array([7, 1, 2, 3, 9, 8, 12])) == [(1, 3), (7, 9), (12, 12)]
