from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import dagster as dg
import polars as pl
import pytest
from dagster_duckdb import DuckDBResource
from hypothesis import given, settings
from hypothesis import strategies as st

from assets.deadman import build_deadman_sensor, last_reconciled_hours
from assets.definitions import build_definitions
from assets.resources import StepledgerData
from pipeline.storage.warehouse import connect
from tests.helpers.alert_file import page_to_file
from tests.helpers.fleets import small_pools

BEFORE_FIRST = datetime(2026, 10, 31, 23, tzinfo=UTC)


def at(hour: int, minute: int = 0, day: int = 30) -> datetime:
    return datetime(2026, 11, day, hour, minute, tzinfo=UTC)


def reconciled(rows: list[tuple[str, datetime]]) -> pl.DataFrame:
    return pl.DataFrame(
        {"pool": [p for p, _ in rows], "hour": [h.replace(tzinfo=None) for _, h in rows]},
        schema={"pool": pl.String, "hour": pl.Datetime("us")},
    )


def test_last_reconciled_hour_is_the_end_of_the_first_gapless_run():
    rows = [("a", at(h)) for h in (3, 4, 5, 7, 8)] + [("b", at(h)) for h in (1, 2)] + [("b", at(2))]
    assert last_reconciled_hours(reconciled(rows), ["a", "b", "c"], BEFORE_FIRST) == {
        "a": at(5),
        "b": at(2),
        "c": BEFORE_FIRST,
    }


def write_reconciled(warehouse: Path, pool: str, hours: list[datetime]) -> None:
    with connect(warehouse) as con:
        for hour in hours:
            con.execute(
                "INSERT INTO reconciliation (hour, pool, replica, check_name, passed, expected, observed, detail, "
                "severity, blocking, finding) VALUES (?, ?, NULL, 'money', true, '', '', '', 'ERROR', true, '')",
                [hour.replace(tzinfo=None), pool],
            )


@pytest.fixture
def alert_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STEPLEDGER_FIRST_HOUR", "2026-11-30T00")
    return page_to_file(tmp_path / "alerts.jsonl", monkeypatch)


FIRST_PARTITION = datetime(2026, 11, 30, tzinfo=UTC)  # as STEPLEDGER_FIRST_HOUR sets it
# The deployment of most tests: before the first partition.
DEPLOYED = datetime(2026, 11, 29, 12, tzinfo=UTC)


def tick_with_cursor(data: Path, now: datetime, cursor: str | None) -> tuple[str, str | None]:
    """The sensor's message and its cursor after the tick."""
    sensor = build_deadman_sensor(small_pools(), FIRST_PARTITION, clock=lambda: now)
    resources = {
        "data": StepledgerData(data_dir=str(data)),
        "warehouse": DuckDBResource(database=str(data / "warehouse.duckdb")),
    }
    with dg.build_sensor_context(resources=resources, cursor=cursor) as context:
        result = sensor(context)
        assert isinstance(result, dg.SkipReason)
        assert result.skip_message is not None
        return result.skip_message, context.cursor


def tick(data: Path, now: datetime, deployed: datetime = DEPLOYED) -> str:
    return tick_with_cursor(data, now, deployed.isoformat())[0]


def paged(alert_file: Path) -> list[dict[str, Any]]:
    return (
        [json.loads(line) for line in alert_file.read_text().splitlines()]
        if alert_file.exists()
        else []
    )


def test_a_late_hour_pages_within_five_minutes_of_its_grace_running_out(
    tmp_path: Path, alert_file: Path
):
    # Hours 00-02 reconciled. Hour 03 ended at 04:00 and its grace (deadman_minutes 120) runs
    # out at 06:00:00. The daemon ticks the deployed sensor at its interval: a tick a second
    # before pages nothing, the next one pages hour 03, at most 5 minutes after 06:00
    # (docs/production.md: the sensor runs every 5 minutes).
    write_reconciled(tmp_path / "warehouse.duckdb", "chat-8b", [at(h) for h in (0, 1, 2)])
    sensor = build_definitions(small_pools(), tmp_path).resolve_sensor_def("deadman")
    before = at(6, 0) - timedelta(seconds=1)
    assert tick(tmp_path, before) == "every pool on time: chat-8b reconciled to 2026-11-30T02"
    assert paged(alert_file) == []
    interval = sensor.minimum_interval_seconds
    assert interval is not None
    after = before + timedelta(seconds=interval)
    assert after - at(6, 0) <= timedelta(minutes=5)
    assert tick(tmp_path, after) == (
        "1 pool(s) overdue, 1 newly paged: chat-8b reconciled to 2026-11-30T02"
    )
    assert [a["hour"] for a in paged(alert_file)] == ["2026-11-30T03"]


def test_nothing_pages_while_hours_are_reconciled_on_time(tmp_path: Path, alert_file: Path):
    write_reconciled(tmp_path / "warehouse.duckdb", "chat-8b", [at(h) for h in range(0, 5)])
    # Hour 04 ended at 05:00; hour 05 is due at 07:00 (deadman_minutes 120): not yet late.
    assert tick(tmp_path, at(7, 0)) == "every pool on time: chat-8b reconciled to 2026-11-30T04"
    assert paged(alert_file) == []


def test_a_late_pool_pages_once_however_often_the_sensor_ticks(tmp_path: Path, alert_file: Path):
    write_reconciled(tmp_path / "warehouse.duckdb", "chat-8b", [at(h) for h in (0, 1, 2, 4)])
    first = tick(tmp_path, at(7, 1))
    assert first == "1 pool(s) overdue, 1 newly paged: chat-8b reconciled to 2026-11-30T02"
    assert (
        tick(tmp_path, at(7, 6))
        == "1 pool(s) overdue, 0 newly paged: chat-8b reconciled to 2026-11-30T02"
    )
    (alert,) = paged(alert_file)
    assert (alert["kind"], alert["pool"], alert["hour"], alert["finding"], alert["severity"]) == (
        "deadman",
        "chat-8b",
        "2026-11-30T03",
        "not_reconciled",
        "ERROR",
    )
    assert alert["detail"] == (
        "pool chat-8b: 2 hour(s) not reconciled within 120 min of their end (2026-11-30T03 to 2026-11-30T04): "
        "the scheduler, its daemon or the hourly run is not running"
    )


def test_without_a_warehouse_every_hour_since_the_first_partition_is_overdue(
    tmp_path: Path, alert_file: Path
):
    assert tick(tmp_path, at(2, 0)) == "every pool on time: chat-8b reconciled to 2026-11-29T23"
    assert (
        tick(tmp_path, at(3, 0))
        == "1 pool(s) overdue, 1 newly paged: chat-8b reconciled to 2026-11-29T23"
    )
    assert [a["hour"] for a in paged(alert_file)] == ["2026-11-30T00"]


def test_a_run_holding_the_pipeline_state_does_not_stop_the_check(tmp_path: Path, alert_file: Path):
    warehouse = tmp_path / "warehouse.duckdb"
    write_reconciled(warehouse, "chat-8b", [at(h) for h in range(0, 11)])
    with connect(warehouse):
        message = tick(tmp_path, at(12, 0))
    assert message == "every pool on time: chat-8b reconciled to 2026-11-30T10"
    assert paged(alert_file) == []


def test_hours_before_the_deployment_never_page(tmp_path: Path, alert_file: Path):
    # Deployed at 05:20 on a warehouse that never reconciled anything since the first
    # partition (00:00): the first tick stores the deployment and pages nothing.
    message, cursor = tick_with_cursor(tmp_path, at(5, 20), None)
    assert (message, cursor) == (
        "every pool on time: chat-8b reconciled to 2026-11-30T05",
        at(5, 20).isoformat(),
    )
    # Hour 06 is the first owed: due at 09:00 (deadman_minutes 120), paged then, alone.
    assert tick(tmp_path, at(8, 59), deployed=at(5, 20)) == (
        "every pool on time: chat-8b reconciled to 2026-11-30T05"
    )
    assert tick(tmp_path, at(9, 0), deployed=at(5, 20)) == (
        "1 pool(s) overdue, 1 newly paged: chat-8b reconciled to 2026-11-30T05"
    )
    assert [a["hour"] for a in paged(alert_file)] == ["2026-11-30T06"]


def test_a_gap_before_the_deployment_does_not_page(tmp_path: Path, alert_file: Path):
    # Hours 00-01 and 03-08 reconciled (03 on: after the deployment at 02:30); 02 predates it.
    write_reconciled(
        tmp_path / "warehouse.duckdb", "chat-8b", [at(h) for h in (0, 1, 3, 4, 5, 6, 7, 8)]
    )
    assert tick(tmp_path, at(10, 0), deployed=at(2, 30)) == (
        "every pool on time: chat-8b reconciled to 2026-11-30T08"
    )
    assert paged(alert_file) == []


@settings(max_examples=60, deadline=None)
@given(st.sets(st.integers(min_value=0, max_value=47), min_size=1, max_size=20))
def test_every_hour_up_to_the_last_reconciled_one_is_reconciled_and_the_next_is_not(
    offsets: set[int],
):
    first = min(offsets)
    last = last_reconciled_hours(
        reconciled([("a", at(0) + timedelta(hours=o)) for o in offsets]), ["a"], BEFORE_FIRST
    )["a"]
    last_offset = round((last - at(0)) / timedelta(hours=1))
    assert set(range(first, last_offset + 1)) <= offsets
    assert last_offset + 1 not in offsets
