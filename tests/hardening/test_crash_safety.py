"""Crash safety: a pipeline killed with SIGKILL anywhere while it materializes an hour, then
run again, publishes exactly the ledger of a run that was never interrupted; an engine
killed mid-write leaves segments that decode up to their last complete frame."""

from __future__ import annotations

import itertools
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg
import polars as pl
import pytest

from pipeline.storage.warehouse import STATE_FILE, connect
from schemas.units import hour_key
from tests.helpers.children import child
from tests.helpers.fleets import bill, rerecord, simulate_small, small_pools
from tests.helpers.hours import SIMULATED_HOUR
from tests.helpers.steplog_samples import complete_frames

pytestmark = pytest.mark.timeout(400)

HERE = Path(__file__).resolve().parent
# Columns that name where or when something happened rather than what it is: a copy of the
# data in another directory, run at another time, differs there and nowhere else.
CIRCUMSTANTIAL = {
    "path",
    "source_file",
    "raised_at",
    "ingested_at",
    "loaded_at",
    "checked_at",
    "applied_at",
    "batch_id",
}
KILL_SEED = 20261130
# Three kills keep the suite fast; set STEPLEDGER_CRASH_KILLS higher for a longer hunt.
KILLS = int(os.environ.get("STEPLEDGER_CRASH_KILLS", "3"))


def snapshot(data: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every warehouse table's rows (less circumstantial columns) and every lake row, sorted."""
    tables: dict[str, list[tuple[Any, ...]]] = {}
    with connect(data / STATE_FILE) as con:
        # `reruns` is history: a killed run that billed the hour once makes the re-run a rerun.
        for (table,) in con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE table_name != 'reruns' ORDER BY 1"
        ).fetchall():
            columns = [
                r[0]
                for r in con.execute(f'DESCRIBE "{table}"').fetchall()
                if r[0] not in CIRCUMSTANTIAL
            ]
            listed = ", ".join(f'"{c}"' for c in columns)
            tables[table] = con.execute(f'SELECT {listed} FROM "{table}" ORDER BY ALL').fetchall()
    lake = data / "lake"
    for path in sorted(lake.rglob("*.parquet")):
        # steps/<partition>/<batch>.parquet, or ledger/<partition>/<table>.parquet
        table = path.relative_to(lake).parts[0]
        key = f"lake/{table}" if table != "ledger" else f"lake/ledger/{path.stem}"
        partition = str(path.parent.relative_to(lake / table))
        tables.setdefault(key, []).extend((partition, *row) for row in pl.read_parquet(path).rows())
    return {name: sorted(rows, key=repr) for name, rows in tables.items()}


@contextmanager
def started(data: Path, *flags: str) -> Iterator[subprocess.Popen[str]]:
    """The hour materializing in a process of its own, once it is ready to begin."""
    with child(
        [
            sys.executable,
            "-m",
            "tests.hardening.materialize_hour",
            str(data),
            "chat-8b",
            hour_key(SIMULATED_HOUR),
            *flags,
        ],
        stdout=subprocess.PIPE,
        cwd=HERE.parents[1],
        stderr=subprocess.DEVNULL,
        text=True,
    ) as process:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ready"
        yield process


@pytest.fixture(scope="module")
def simulated(tmp_path_factory) -> Path:
    """The small fleet with each replica's log in several segments, as a busy engine ships it."""
    data = simulate_small(tmp_path_factory.mktemp("crash") / "simulated")
    rerecord(data, rotate_bytes=2 << 20)
    return data


@pytest.fixture(scope="module")
def uninterrupted(
    simulated, tmp_path_factory
) -> tuple[dict[str, list[tuple[Any, ...]]], list[str]]:
    """The hour materialized by one subprocess that runs to the end, and its stages."""
    data = tmp_path_factory.mktemp("uninterrupted") / "run"
    shutil.copytree(simulated, data)
    with started(data) as process:
        assert process.stdout is not None
        lines = process.stdout.read().split()
        assert process.wait() == 0
    assert lines[-1] == "done"
    return snapshot(data), [
        word for previous, word in itertools.pairwise(lines) if previous == "stage"
    ]


def test_sigkill_anywhere_then_rerun_gives_the_uninterrupted_ledger(
    simulated, uninterrupted, tmp_path
):
    expected, stages = uninterrupted
    assert expected["invoices"]
    assert expected["request_costs"]
    rng = random.Random(KILL_SEED)
    # Each kill lands at a random moment shortly after a stage of the hour began, the stages
    # taken in a random order so that a few kills already hit different ones.
    order = rng.sample(stages, len(stages))
    kills = [(order[i % len(order)], rng.uniform(0.0, 0.25)) for i in range(KILLS)]
    with dg.DagsterInstance.ephemeral() as instance:
        for index, (stage, delay) in enumerate(kills):
            data = tmp_path / f"kill-{index}"
            shutil.copytree(simulated, data)
            with started(data) as process:
                assert process.stdout is not None
                while (line := process.stdout.readline().strip()) != f"stage {stage}":
                    assert line, f"the run ended before stage {stage}"
                time.sleep(delay)
                process.send_signal(signal.SIGKILL)
                assert process.wait() == -signal.SIGKILL, (
                    f"the run ended before the kill in {stage}"
                )
            (result,) = bill(data, small_pools(), instance)
            assert result.success, (stage, delay)
            assert snapshot(data) == expected, f"killed {delay:.2f} s into {stage}"


def test_killed_between_lake_write_and_warehouse_commit_then_more_segments_arrive(
    simulated, uninterrupted, tmp_path
):
    # The lake files of an ingest batch are written before the warehouse records the batch. A
    # crash in between, followed by a new segment arriving before the retry, gives the retry
    # another batch id: the dead batch's files must not be counted as well.
    expected, _ = uninterrupted
    data = tmp_path / "run"
    shutil.copytree(simulated, data)
    # The first replica's batch is the one written when the process dies.
    late = sorted((data / "outbox" / "chat-8b-r0").glob("*.seg"))[-1]
    held_back = tmp_path / late.name
    late.rename(held_back)
    with started(data, "--die-before-ingest-commit") as process:
        assert process.wait() == -signal.SIGKILL
    held_back.rename(late)
    with dg.DagsterInstance.ephemeral() as instance:
        (result,) = bill(data, small_pools(), instance)
    assert result.success, [e.step_failure_data.error for e in result.get_step_failure_events()]
    got = snapshot(data)
    assert got["lake/steps"] == expected["lake/steps"]
    assert got["ledger_lines"] == expected["ledger_lines"]


ENGINE = """
import sys
from pathlib import Path
from tests.helpers.segment_bytes import HEADER, record_steps
from pipeline.hook.recorder import StepRecorder
recorder = StepRecorder(Path(sys.argv[1]), HEADER, overflow="block", rotate_bytes=3 << 19)
print("recording", flush=True)
step = 0
while True:
    record_steps(recorder, step, 256)
    step += 256
"""


# The kill lands `delay` seconds after the engine opened its first segment file.
@pytest.mark.parametrize("delay", [0.3, 1.5, 4.0])
def test_an_engine_killed_mid_write_leaves_segments_that_decode_to_its_last_complete_frame(
    tmp_path, delay
):
    from pipeline.hook.recorder import PARTIAL_SUFFIX, recover_partial_segments
    from pipeline.ingestion.decoder import read_segments

    outbox = tmp_path / "outbox"
    with child(
        [sys.executable, "-c", ENGINE, str(outbox)],
        stdout=subprocess.PIPE,
        text=True,
        # The repository root: `python -c` imports `tests.helpers` from the working directory.
        cwd=HERE.parents[1],
    ) as engine:
        assert engine.stdout is not None
        assert engine.stdout.readline().strip() == "recording"
        # Counted from the segment file's creation, which a loaded machine may delay by more
        # than the shortest delay.
        while not list(outbox.glob(f".*{PARTIAL_SUFFIX}")):
            time.sleep(0.01)
        time.sleep(delay)
        os.kill(engine.pid, signal.SIGKILL)
        assert engine.wait() == -signal.SIGKILL
    shipped = sorted(outbox.glob("*.seg"))
    (partial,) = outbox.glob(f".*{PARTIAL_SUFFIX}")
    partial_bytes = partial.read_bytes()
    (recovered,) = recover_partial_segments(outbox)
    decoded = read_segments([*shipped, recovered])
    seqs = decoded.steps.column("seq").to_pylist()
    # Nothing out of order, nothing invented: the steps recorded, from the first on, up to the kill.
    assert seqs == list(range(len(seqs)))
    segments = {row["path"]: row for row in decoded.segments.to_pylist()}
    assert all(segments[str(path)]["steps"] > 0 for path in shipped)
    # The recovered segment gives every complete frame it holds (its header is one of them).
    in_recovered = segments[str(recovered)]["steps"] if str(recovered) in segments else 0
    assert in_recovered == max(complete_frames(partial_bytes) - 1, 0)
    damage = decoded.damage.to_pylist()
    assert all(row["path"] == str(recovered) and row["kind"] == "torn_tail" for row in damage), (
        damage
    )
    expected_slots = pl.DataFrame(read_segments_of_steps(tmp_path, len(seqs)).slots).drop(
        "replica", "pool"
    )
    assert pl.DataFrame(decoded.slots).drop("replica", "pool").equals(expected_slots)


def read_segments_of_steps(tmp_path: Path, steps: int):
    """What the same engine script records for exactly `steps` steps, closed cleanly."""
    from pipeline.hook.recorder import StepRecorder
    from pipeline.ingestion.decoder import read_segments
    from tests.helpers.segment_bytes import record_steps
    from tests.helpers.steplog_samples import HEADER

    with StepRecorder(
        tmp_path / "clean", HEADER, overflow="block", rotate_bytes=3 << 19
    ) as recorder:
        record_steps(recorder, 0, steps)
    return read_segments(recorder.shipped_segments)
