"""Every measured step is billed once, or its hour is held back and paged: a simulated fleet
whose replica's wall clock jumps, or whose replica's segments never arrive, billed through the
pool-hour job against the same fleet without the fault."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, timedelta
from pathlib import Path
from typing import Any, TypedDict

import dagster as dg
import duckdb
import polars as pl
import pyarrow.parquet as pq
import pytest

from assets.cli.run import run_pool_hours
from assets.definitions import build_definitions
from assets.partitions import partition_key
from assets.runner import QUIET_RUN_CONFIG as QUIET
from assets.runner import root_cause
from pipeline.ingestion.decoder import read_segments
from pipeline.reconcile import alerts
from pipeline.simulator.sink import SimulatedSink, serve_sink
from pipeline.storage.lake import inputs_path, ledger_files
from pipeline.storage.warehouse import STATE_FILE, connect, connect_read_only
from schemas.config import PoolsFile
from schemas.units import HOUR_NS, hour_key
from tests.helpers.fleets import bill, costs, record_again, simulate_small, small_pools
from tests.helpers.hours import SIMULATED_HOUR

pytestmark = pytest.mark.timeout(600)

REPLICA = "chat-8b-r0"


def reconciliation(data: Path, columns: str, where: str) -> list[tuple[Any, ...]]:
    with connect_read_only(data / STATE_FILE) as con:
        return con.execute(
            f"SELECT {columns} FROM reconciliation WHERE {where} ORDER BY ALL"
        ).fetchall()


def failed_findings(data: Path) -> list[tuple[Any, ...]]:
    return reconciliation(
        data, "check_name, replica, severity, blocking, finding, detail", "NOT passed"
    )


def billed(data: Path, pools: PoolsFile) -> bool:
    with dg.DagsterInstance.ephemeral() as instance:
        (result,) = bill(data, pools, instance)
    return result.success


@pytest.fixture(scope="module")
def pools() -> PoolsFile:
    return small_pools()


class Unfaulted(TypedDict):
    """What the fleet without a fault bills and finds."""

    money: dict[str, list[tuple[Any, ...]]]
    findings: list[tuple[Any, ...]]
    conservation: list[tuple[Any, ...]]


@pytest.fixture(scope="module")
def unfaulted(pools, tmp_path_factory) -> Unfaulted:
    data = simulate_small(tmp_path_factory.mktemp("unfaulted") / "fleet", pools)
    assert billed(data, pools)
    money = costs(data)
    assert money["published"]
    assert money["held_back"] == []
    return {"money": money, "findings": failed_findings(data), "conservation": conservation(data)}


def conservation(data: Path) -> list[tuple[Any, ...]]:
    return reconciliation(data, "replica, passed, observed", "check_name = 'conservation'")


def test_every_step_of_a_clean_fleet_is_in_an_attributed_hour(pools, unfaulted) -> None:
    assert [(replica, passed) for replica, passed, _ in unfaulted["conservation"]] == [
        ("chat-8b-r0", True),
        ("chat-8b-r1", True),
    ]
    assert all(
        observed.endswith("; 0 steps up to it in hours not attributed")
        for *_, observed in unfaulted["conservation"]
    )


def test_steps_placed_in_an_hour_never_attributed_hold_the_hour_back(
    pools, unfaulted, tmp_path: Path
) -> None:
    """The replica's last segment is written after a reboot with the wall clock set two hours
    back: nothing in the log marks its clock wrong, ingest places its steps two hours early,
    and that hour has no gateway file, so no one attributes it. The hour they ran in would
    publish with them as idle; the conservation check holds it back instead."""
    data = simulate_small(tmp_path / "fleet", pools)
    (segment,) = (data / "outbox" / REPLICA).glob("*.seg")
    record_again(segment, rotate_bytes=segment.stat().st_size // 3)
    last = sorted((data / "outbox" / REPLICA).glob("*.seg"))[-1]
    moved = read_segments([last]).steps["seq"].to_pylist()
    record_again(last, reboot_wall_shift_ns=-2 * HOUR_NS)
    assert not billed(data, pools)
    money = costs(data)
    assert money["published"] == []
    assert money["held_back"] == [("chat-8b", "failed blocking checks: conservation")]
    blocking = [f for f in new_findings(data, unfaulted) if f[3]]
    ((check, replica, severity, _, finding, detail),) = blocking
    assert (check, replica, severity, finding) == (
        "conservation",
        REPLICA,
        "ERROR",
        "unbilled_steps",
    )
    early = hour_key(SIMULATED_HOUR - timedelta(hours=2))
    assert detail.startswith(
        f"{len(moved)} steps of replica {REPLICA} (seq {moved[0]}-{moved[-1]}) lie in hours "
        f"never attributed, neither published nor held back: {early} ({len(moved)} steps); "
    )
    # The other replica's steps are all in the hour.
    assert conservation(data)[1][:2] == ("chat-8b-r1", True)


def new_findings(data: Path, unfaulted: Unfaulted) -> list[tuple[Any, ...]]:
    """The failed results the fault added to those of the fleet without it."""
    return [f for f in failed_findings(data) if f not in unfaulted["findings"]]


@pytest.mark.parametrize("jump_s", [7200.0, -7200.0, 90.0])
def test_a_wall_clock_jump_is_placed_by_the_monotonic_clock_and_reported(
    pools, unfaulted, tmp_path: Path, jump_s: float
) -> None:
    data = simulate_small(tmp_path / "fleet", pools, faults={"clock-jump": jump_s})
    assert billed(data, pools)
    assert costs(data) == unfaulted["money"]
    ((check, replica, severity, blocking, finding, detail),) = new_findings(data, unfaulted)
    assert (check, replica, severity, blocking, finding) == (
        "clock",
        REPLICA,
        "WARN",
        False,
        "clock_jump",
    )
    assert f"the wall clock stepped {jump_s:+.3f} s against the monotonic clock" in detail
    with duckdb.connect(str(data / STATE_FILE), read_only=True) as con:
        ((jump_ns, path),) = con.execute("SELECT jump_ns, path FROM clock_jumps").fetchall()
    assert jump_ns == round(jump_s * 1e9)
    assert detail.startswith(f"{path}: ")


def test_a_clock_step_within_the_tolerance_is_left_to_the_time_check(
    pools, unfaulted, tmp_path: Path
) -> None:
    """A minute is within what the jump detection tolerates: the steps stay where the wall
    clock put them, and the time check reports the skew."""
    data = simulate_small(tmp_path / "fleet", pools, faults={"clock-jump": 60.0})
    assert not billed(data, pools)
    assert costs(data)["held_back"] == [("chat-8b", "failed blocking checks: time")]
    assert [f[:5] for f in new_findings(data, unfaulted)] == [
        ("time", REPLICA, "ERROR", True, "clock_skew")
    ]


def test_a_silent_replica_whose_gpus_are_busy_holds_the_hour_back(
    pools, unfaulted, tmp_path: Path
) -> None:
    data = simulate_small(tmp_path / "fleet", pools, faults={"silent-replica": None})
    assert not list((data / "outbox" / REPLICA).glob("*.seg"))
    assert not billed(data, pools)
    money = costs(data)
    assert money["published"] == []
    assert money["held_back"] == [("chat-8b", "failed blocking checks: silence")]
    silence = [f for f in new_findings(data, unfaulted) if f[0] == "silence"]
    ((_, replica, severity, blocking, finding, detail),) = silence
    assert (replica, severity, blocking, finding) == (REPLICA, "ERROR", True, "silent_replica")
    assert detail.startswith(f"no step log from replica {REPLICA} (host ")
    assert "billing the hour would charge its work as idle" in detail


@pytest.fixture
def webhook(monkeypatch: pytest.MonkeyPatch):
    """Pages go to the sink the simulated fleet describes, served on 127.0.0.1."""

    @contextmanager
    def serve(data: Path) -> Iterator[SimulatedSink]:
        with serve_sink(data) as sink:
            monkeypatch.setenv("STEPLEDGER_ALERT_WEBHOOK_URL", sink.url)
            monkeypatch.setenv("STEPLEDGER_ALERT_FORMAT", "slack")
            monkeypatch.delenv("STEPLEDGER_PAGERDUTY_ROUTING_KEY", raising=False)
            yield sink

    return serve


def outbox(data: Path) -> list[tuple[Any, ...]]:
    with duckdb.connect(str(data / STATE_FILE), read_only=True) as con:
        return con.execute(
            "SELECT alert::JSON->>'kind', attempts, last_error, delivered_at IS NOT NULL "
            "FROM alert_outbox ORDER BY ALL"
        ).fetchall()


def test_a_page_the_sink_refuses_is_owed_until_it_accepts_then_delivered_once(
    pools, tmp_path: Path, webhook
) -> None:
    data = simulate_small(
        tmp_path / "fleet", pools, faults={"silent-replica": None, "sink-down": 1}
    )
    with webhook(data) as sink:
        (run,) = run_pool_hours(data, [SIMULATED_HOUR])
        assert not run.success
        # The sink answered 500: the page is owed, not lost.
        assert sink.refused == 1
        assert sink.accepted == []
        ((kind, attempts, error, delivered),) = outbox(data)
        assert (kind, attempts, delivered) == ("silence", 1, False)
        assert "HTTP 500" in error
        assert "/hook" not in error
        with connect(data / STATE_FILE) as con:
            # The moments from the outbox, not the wall clock: a loaded machine may take longer
            # than the first retry's wait to get here.
            owed = con.execute("SELECT enqueued_at, next_attempt_at FROM alert_outbox").fetchone()
            assert owed is not None
            enqueued, retry_at = (moment.replace(tzinfo=UTC) for moment in owed)
            # Not due yet: the first retry waits a minute after the refused attempt.
            assert (
                alerts.deliver_due(con, alerts.sink_from_env(), retry_at - alerts.FIRST_RETRY) == []
            )
            assert sink.refused == 1
            # Owed past the dead-man delay, it is a finding of its own.
            late = enqueued + timedelta(minutes=pools.settings.deadman_minutes, seconds=1)
            (overdue,) = alerts.undelivered(con, late, pools.settings)
            assert (overdue.check_name, overdue.finding) == ("alert_delivery", "undelivered")
            # The sink is back: the retry is accepted.
            (sent,) = alerts.deliver_due(con, alerts.sink_from_env(), retry_at)
            assert sent.kind == "silence"
            assert alerts.undelivered(con, late, pools.settings) == []
        # Running the hour again finds the same finding: it is not paged a second time.
        (again,) = run_pool_hours(data, [SIMULATED_HOUR])
        assert not again.success
        assert sink.refused == 1
        assert len(sink.accepted) == 1
        assert sink.accepted[0]["text"].startswith("[ERROR] stepledger silence failed for chat-8b/")
    assert outbox(data)[0][1:] == (2, None, True)


def test_a_lake_file_rewritten_after_ingest_fails_the_hour_and_keeps_the_money(
    pools, unfaulted, tmp_path: Path
) -> None:
    data = simulate_small(tmp_path / "fleet", pools)
    assert billed(data, pools)
    (steps_file, *_) = sorted((data / "lake" / "steps").glob(f"pool=chat-8b/*/{REPLICA}.*.parquet"))
    steps = pl.read_parquet(steps_file)
    # A reader with write access doubles every step's duration: more usage, less idle.
    steps.with_columns(pl.col("end_ns") + (pl.col("end_ns") - pl.col("start_ns"))).write_parquet(
        steps_file
    )
    with dg.DagsterInstance.ephemeral() as instance:
        (result,) = bill(data, pools, instance)
    assert not result.success
    (failure,) = result.get_step_failure_events()
    error = failure.step_failure_data.error
    assert error is not None
    assert error.cause is not None
    message = error.cause.message
    assert message.startswith(f"pipeline.storage.lake.LakeFileChanged: {steps_file}: sha256 ")
    assert "the lake file was changed after it was written" in message
    assert costs(data) == unfaulted["money"]
    # `stepledger run` shows the root cause, not Dagster's "Error occurred while executing".
    (run,) = run_pool_hours(data, [SIMULATED_HOUR])
    assert run.error == message.strip()


def rewrite(path: Path, change) -> None:
    """Rewrite a Parquet file as a reader with write access would: rows changed, the file's
    own metadata kept."""
    table = pq.read_table(path)
    changed = change(pl.DataFrame(table)).to_arrow()
    pq.write_table(changed.replace_schema_metadata(table.schema.metadata), path)


def root_causes(result) -> list[str]:
    return [root_cause(f.event_specific_data.error) for f in result.get_step_failure_events()]


def test_rewritten_inputs_or_ledger_files_fail_the_hour_and_keep_the_money(
    pools, unfaulted, tmp_path: Path
) -> None:
    """The attribution's inputs and the hour's ledger are verified too: a rewritten one fails
    the step that would read it, naming the file, when that step alone is run again."""
    data = simulate_small(tmp_path / "fleet", pools)
    job = build_definitions(pools, data).resolve_job_def("pool_hour_job")
    key = partition_key(SIMULATED_HOUR, "chat-8b")

    def run(*assets: str):
        return job.execute_in_process(
            partition_key=key,
            instance=instance,
            run_config=QUIET,
            raise_on_error=False,
            asset_selection=[dg.AssetKey(a) for a in assets] if assets else None,
        )

    with dg.DagsterInstance.ephemeral() as instance:
        assert run().success
        assert costs(data) == unfaulted["money"]
        inputs = inputs_path(data / "lake", "chat-8b", SIMULATED_HOUR)
        # Every request's context moves to one tenant.
        rewrite(inputs, lambda f: f.with_columns(tenant=pl.lit(f["tenant"][0])))
        (cause,) = root_causes(run("attribution", "ledger"))
        assert cause.startswith(f"pipeline.storage.lake.LakeFileChanged: {inputs}: sha256 ")
        assert costs(data) == unfaulted["money"]

        assert run("request_context", "attribution").success
        (lines, *_) = (
            f
            for f in ledger_files(data / "lake", "chat-8b", SIMULATED_HOUR)
            if f.stem == "ledger_lines"
        )
        # A nano-dollar moves from one line to another: every total still balances.
        rewrite(
            lines,
            lambda f: f.with_columns(
                amount_nano=pl.col("amount_nano") + pl.Series([1, -1] + [0] * (f.height - 2))
            ),
        )
        (cause,) = root_causes(run("ledger"))
        assert cause.startswith(f"pipeline.storage.lake.LakeFileChanged: {lines}: sha256 ")
        assert costs(data) == unfaulted["money"]


def test_a_step_file_added_to_the_lake_fails_the_hour(pools, unfaulted, tmp_path: Path) -> None:
    data = simulate_small(tmp_path / "fleet", pools)
    assert billed(data, pools)
    (steps_file, *_) = sorted((data / "lake" / "steps").glob(f"pool=chat-8b/*/{REPLICA}.*.parquet"))
    # Named like the replica's next file of a committed batch: its steps would be billed again.
    replica, first, batch, suffix = steps_file.name.split(".")
    added = steps_file.with_name(f"{replica}.{int(first) + 10**9:012d}.{batch}.{suffix}")
    shutil.copyfile(steps_file, added)
    with dg.DagsterInstance.ephemeral() as instance:
        (result,) = bill(data, pools, instance)
    (cause,) = root_causes(result)
    assert cause.startswith(
        f"pipeline.storage.lake.LakeFileChanged: {added}: no sha256 was recorded"
    )
    assert costs(data) == unfaulted["money"]
