from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from pipeline.attribution.attribute import attribute_pool_hour, gather_inputs
from pipeline.attribution.weights import weight_source
from pipeline.datadir import DataDir
from pipeline.ingestion.gateway import gateway_files_for_hour, key_salt, load_gateway_files
from pipeline.ingestion.ingest import committed_batches, ingest_outbox
from pipeline.storage.lake import load_inputs, save_inputs
from pipeline.storage.warehouse import connect
from schemas.config import load_pools
from tests.helpers.hours import HOUR
from tests.helpers.warehouse_fleet import NS, write_gateway, write_replica_log

POOLS = load_pools()
POOL = POOLS.pool("chat-8b")
HOSTILE = "it's'); DROP TABLE ledger_lines;--\n\u2028"


@pytest.fixture
def data(tmp_path: Path) -> Path:
    """r0 runs requests a and the hostile one from 04:58:30, one step straddling into 05:00;
    r1 runs c in hour 05; the gateway also knows z, which never ran."""
    outbox = tmp_path / "outbox"
    write_replica_log(
        outbox,
        POOL,
        "chat-8b-r0",
        start=HOUR - timedelta(seconds=90),
        steps=4,
        step_ns=40 * NS,
        gap_ns=20 * NS,
        requests=["a", HOSTILE],
    )
    write_replica_log(
        outbox,
        POOL,
        "chat-8b-r1",
        start=HOUR + timedelta(minutes=1),
        steps=3,
        step_ns=NS,
        gap_ns=NS,
        requests=["c"],
    )
    write_gateway(
        tmp_path / "gateway",
        HOUR - timedelta(hours=1),
        [("a", "acme", "chat", "sk-a"), (HOSTILE, "globex", "chat", "sk-h")],
    )
    write_gateway(
        tmp_path / "gateway",
        HOUR,
        [("c", "acme", "search", "sk-a"), ("z", "initech", "chat", "sk-z")],
    )
    with connect(tmp_path / "warehouse.duckdb") as con:
        ingest_outbox(con, outbox, tmp_path / "lake")
        load_gateway_files(con, gateway_files_for_hour(tmp_path / "gateway", HOUR), key_salt())
    return tmp_path


def test_inputs_hold_the_context_of_the_hours_requests_the_batches_and_the_engine(
    data: Path,
) -> None:
    with connect(data / "warehouse.duckdb") as con:
        inputs = gather_inputs(con, data / "lake", POOL, HOUR)
        assert inputs.batches == frozenset(committed_batches(con))
    assert sorted(inputs.context.select("request_id", "tenant").rows()) == [
        ("a", "acme"),
        ("c", "acme"),
        (HOSTILE, "globex"),
    ]
    assert inputs.engine == ("0.11.0", "570.86")
    assert (inputs.hour, inputs.pool) == (HOUR, "chat-8b")


def test_saved_inputs_read_back_exactly(data: Path) -> None:
    with connect(data / "warehouse.duckdb") as con:
        inputs = gather_inputs(con, data / "lake", POOL, HOUR)
    path = save_inputs(data / "lake", inputs)
    assert (
        path == data / "lake" / "inputs" / "pool=chat-8b" / "hour=2026-11-30T05" / "inputs.parquet"
    )
    loaded = load_inputs(data / "lake", "chat-8b", HOUR)
    assert (loaded.hour, loaded.pool, loaded.batches, loaded.engine) == (
        inputs.hour,
        inputs.pool,
        inputs.batches,
        inputs.engine,
    )
    assert loaded.context.equals(inputs.context)
    assert not list(path.parent.glob("*.partial"))


def test_the_ledger_comes_from_the_lake_alone(data: Path) -> None:
    with connect(data / "warehouse.duckdb") as con:
        inputs = gather_inputs(con, data / "lake", POOL, HOUR)
    (data / "warehouse.duckdb").unlink()
    ledger = attribute_pool_hour(
        data / "lake",
        POOL,
        inputs,
        weight_source(POOL, inputs.engine, DataDir(data).calibration_file),
    ).ledger
    costs = dict(
        zip(ledger.request_costs["request_id"], ledger.request_costs["tenant"], strict=True)
    )
    assert costs == {"a": "acme", HOSTILE: "globex", "c": "acme"}
    assert int(ledger.ledger_lines["amount_nano"].sum()) == ledger.amount_nano


def test_inputs_missing_or_of_another_pool_are_refused(data: Path) -> None:
    with pytest.raises(
        FileNotFoundError,
        match=r"pool=chat-8b/hour=2026-11-30T05/inputs.parquet: no attribution "
        r"inputs for pool 'chat-8b' hour 2026-11-30T05; materialize its request_context first",
    ):
        load_inputs(data / "lake", "chat-8b", HOUR)
    with connect(data / "warehouse.duckdb") as con:
        inputs = gather_inputs(con, data / "lake", POOL, HOUR)
    other = POOLS.pool("reason-dsv3")
    with pytest.raises(
        ValueError, match="attribution inputs of pool 'chat-8b' given for pool 'reason-dsv3'"
    ):
        attribute_pool_hour(
            data / "lake",
            other,
            inputs,
            weight_source(other, inputs.engine, DataDir(data).calibration_file),
        )
