"""The `verify_published` sensor, on a fixed clock: a published data file changed while no run
and no reader touched its hour pages once, through the alert outbox, naming the pool-hour and
the file; an untouched warehouse pages nothing. With the pipeline's state in the embedded file
and in PostgreSQL (the production profile)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from dagster_duckdb import DuckDBResource

from assets.verification import build_verify_published_sensor
from pipeline.datadir import DataDir
from pipeline.storage import warehouse
from tests.helpers.alert_file import page_to_file
from tests.helpers.postgres_server import postgres_or_skip
from tests.helpers.published import double_every_amount, ledger_lines_file, publish_by_hand

HOURS = [datetime(2026, 11, 30, h, tzinfo=UTC) for h in (3, 4)]
POOL = "chat-8b"
NOW = datetime(2026, 12, 1, 9, 30, tzinfo=UTC)


@pytest.fixture(params=["embedded", "postgres"])
def profile(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str | None]:
    """The PostgreSQL store (STEPLEDGER_POSTGRES set to it), or None for the embedded file."""
    monkeypatch.delenv(warehouse.POSTGRES_ENV, raising=False)
    if request.param == "embedded":
        yield None
        return
    with postgres_or_skip() as server:
        store = (
            f"host={server.host} port={server.port} user={server.user} "
            f"password={server.password} dbname={server.database}"
        )
        monkeypatch.setenv(warehouse.POSTGRES_ENV, store)
        yield store


@pytest.fixture
def alert_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return page_to_file(tmp_path / "alerts.jsonl", monkeypatch)


def tick(data: Path) -> str:
    sensor = build_verify_published_sensor(clock=lambda: NOW)
    resources = {"warehouse": DuckDBResource(database=str(DataDir(data).state_file))}
    with dg.build_sensor_context(resources=resources) as context:
        result = sensor(context)
    assert isinstance(result, dg.SkipReason)
    assert result.skip_message is not None
    return result.skip_message


def paged(alert_file: Path) -> list[dict[str, Any]]:
    if not alert_file.exists():
        return []
    return [json.loads(line) for line in alert_file.read_text().splitlines()]


def test_a_changed_published_file_pages_once_naming_the_hour_and_the_file(
    tmp_path: Path, profile: str | None, alert_file: Path
) -> None:
    state_file = DataDir(tmp_path).state_file
    with warehouse.connect(state_file, postgres=profile) as con:
        if profile is not None:
            warehouse.create_reader_role(con, warehouse.warehouse_dir(tmp_path), "reads-only")
        for hour in HOURS:
            publish_by_hand(con, hour, POOL)
        file = ledger_lines_file(con, HOURS[1], POOL)

    assert tick(tmp_path) == "2 published pool-hour(s), 2 data file(s) verified: none changed"
    assert paged(alert_file) == []

    double_every_amount(file)
    for _ in range(2):
        assert tick(tmp_path) == (
            "2 published pool-hour(s), 2 data file(s) verified: changed since publishing: "
            "chat-8b 2026-11-30T04"
        )
    (page,) = paged(alert_file)
    assert (page["kind"], page["finding"], page["pool"], page["hour"], page["severity"]) == (
        "integrity",
        "published_changed",
        POOL,
        "2026-11-30T04",
        "ERROR",
    )
    assert page["detail"].startswith(
        f"{file} (ledger_lines of pool {POOL} hour 2026-11-30T04): sha256 "
    )
    assert page["todo"].startswith("find who changed the named file under `warehouse/data/`")
    assert page["raised_at"] == NOW.isoformat()
    with warehouse.connect(state_file, postgres=profile) as con:
        owed = con.execute(
            "SELECT dedup_key, delivered_at IS NOT NULL FROM alert_outbox"
        ).fetchall()
    assert owed == [(page["dedup_key"], True)]
