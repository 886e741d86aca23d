from __future__ import annotations

import json
import shutil
from datetime import timedelta
from pathlib import Path

import dagster as dg
import duckdb
import pytest

from assets.definitions import build_definitions
from assets.partitions import partition_key, range_tags
from assets.runner import QUIET_RUN_CONFIG as QUIET
from assets.runner import pool_hour_outcome
from pipeline import finance
from pipeline.ingestion.ingest import segment_files
from pipeline.storage.warehouse import STATE_FILE
from tests.helpers.alert_file import page_to_file
from tests.helpers.fleets import page_on_call, small_pools
from tests.helpers.hours import SIMULATED_HOUR


def run_damaged(
    simulated: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, Path, dg.Definitions, dg.DagsterInstance]:
    """A copy of the simulated run with 16 bytes zeroed in the middle of a segment of replica
    r1 (one frame fails its checksum, one step of the simulated hour is lost), the file pages
    go to, the copy's definitions and an instance to run them on."""
    data = tmp_path / "run"
    shutil.copytree(simulated, data)
    damaged = segment_files(data / "outbox", ["chat-8b-r1"])[0]
    content = bytearray(damaged.read_bytes())
    middle = len(content) // 2
    content[middle : middle + 16] = bytes(16)
    damaged.write_bytes(bytes(content))
    alert_file = page_to_file(tmp_path / "alerts.jsonl", monkeypatch)
    # The tests bill the hour after the simulated minutes too.
    defs = build_definitions(small_pools(), data, run_hours=[SIMULATED_HOUR + timedelta(hours=1)])
    return data, alert_file, defs, dg.DagsterInstance.ephemeral()


def paged_errors(alert_file: Path) -> list[tuple[str, str, str]]:
    """(kind, replica, hour) of each ERROR page written to `alert_file`."""
    paged = [json.loads(line) for line in alert_file.read_text().splitlines()]
    return [(a["kind"], a["replica"], a["hour"]) for a in paged if a["severity"] == "ERROR"]


def test_a_failed_blocking_check_holds_the_hour_back_and_pages_once(
    simulated: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, alert_file, defs, instance = run_damaged(simulated, tmp_path, monkeypatch)
    result = defs.resolve_job_def("pool_hour_job").execute_in_process(
        partition_key=partition_key(SIMULATED_HOUR, "chat-8b"),
        instance=instance,
        run_config=QUIET,
        raise_on_error=False,
    )
    assert not result.success
    failed = {e.check_name for e in result.get_asset_check_evaluations() if not e.passed}
    assert "sequence" in failed
    outcome = pool_hour_outcome(result)
    assert (outcome["success"], outcome["held_back"], outcome["error"]) == (False, True, None)
    with finance.connect(data) as con:
        assert con.execute("SELECT pool, reason FROM held_back_hours").fetchall() == [
            ("chat-8b", "failed blocking checks: sequence")
        ]
        assert con.execute("SELECT count(*) FROM tenant_costs_hourly").fetchone() == (0,)

    for _ in range(2):
        page_on_call(defs, instance, result)
    paged = [json.loads(line) for line in alert_file.read_text().splitlines()]
    sequence = [a for a in paged if a["kind"] == "sequence"]
    assert [(a["pool"], a["replica"], a["hour"]) for a in sequence] == [
        ("chat-8b", "chat-8b-r1", "2026-11-30T00")
    ]
    assert len(paged) == len({a["dedup_key"] for a in paged})
    with duckdb.connect(str(data / STATE_FILE), read_only=True) as con:
        delivered = con.execute(
            "SELECT dedup_key FROM alert_outbox WHERE delivered_at IS NOT NULL ORDER BY enqueued_at"
        ).fetchall()
    assert [key for (key,) in delivered] == [a["dedup_key"] for a in paged]


def test_a_backfill_range_holds_back_and_pages_only_the_hours_that_failed(
    simulated: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, alert_file, defs, instance = run_damaged(simulated, tmp_path, monkeypatch)
    # The damaged hour and the hour after it, as one backfill run.
    next_hour = SIMULATED_HOUR + timedelta(hours=1)
    result = defs.resolve_job_def("pool_hour_job").execute_in_process(
        tags=range_tags(SIMULATED_HOUR, next_hour, "chat-8b"),
        instance=instance,
        run_config=QUIET,
        raise_on_error=False,
    )
    assert not result.success
    held = {
        (e.check_name, e.partition)
        for e in result.get_asset_check_evaluations()
        if e.blocking and not e.passed and e.severity == dg.AssetCheckSeverity.ERROR
    }
    # The hour after the simulated minutes holds no data at all: held too, never billed idle.
    assert held == {
        ("sequence", str(partition_key(SIMULATED_HOUR, "chat-8b"))),
        ("silence", str(partition_key(next_hour, "chat-8b"))),
    }
    with finance.connect(data) as con:
        assert con.execute(
            "SELECT pool, hour, reason FROM held_back_hours ORDER BY hour"
        ).fetchall() == [
            ("chat-8b", SIMULATED_HOUR.replace(tzinfo=None), "failed blocking checks: sequence"),
            ("chat-8b", next_hour.replace(tzinfo=None), "failed blocking checks: silence"),
        ]
        assert con.execute("SELECT hour FROM invoices ORDER BY hour").fetchall() == [
            (SIMULATED_HOUR.replace(tzinfo=None),),
            (next_hour.replace(tzinfo=None),),
        ]

    page_on_call(defs, instance, result)
    assert sorted(paged_errors(alert_file)) == [
        ("sequence", "chat-8b-r1", "2026-11-30T00"),
        ("silence", "chat-8b-r0", "2026-11-30T01"),
        ("silence", "chat-8b-r1", "2026-11-30T01"),
    ]


def test_the_pager_pages_for_a_backfill_launched_from_the_assets(
    simulated: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Partitions selected in the UI run as Dagster's implicit asset job, not pool_hour_job.
    _, alert_file, defs, instance = run_damaged(simulated, tmp_path, monkeypatch)
    repository = defs.get_repository_def()
    pager = defs.resolve_sensor_def("page_on_call")

    def tick(cursor: str | None) -> str | None:
        with dg.build_sensor_context(
            instance=instance, repository_def=repository, cursor=cursor, resources=defs.resources
        ) as context:
            return pager.evaluate_tick(context).cursor

    cursor = tick(None)
    asset_job = repository.get_implicit_global_asset_job_def()
    result = asset_job.execute_in_process(
        tags=range_tags(SIMULATED_HOUR, SIMULATED_HOUR, "chat-8b"),
        instance=instance,
        run_config=QUIET,
        raise_on_error=False,
    )
    assert not result.success
    assert result.dagster_run.job_name == asset_job.name
    tick(cursor)
    assert paged_errors(alert_file) == [("sequence", "chat-8b-r1", "2026-11-30T00")]
