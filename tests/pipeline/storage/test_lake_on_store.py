"""The lake on a real S3 server: an hour billed on local disk, its lake copied to the store,
reads back the same from the store, verified by the same hashes, and writes the same bytes."""

from __future__ import annotations

import shutil
from pathlib import Path

import dagster as dg
import pyarrow.fs as pafs
import pytest

from pipeline.datadir import DataDir
from pipeline.ship.s3server import S3Server
from pipeline.storage.lake import (
    Lake,
    LakeFileChanged,
    last_seq_before,
    ledger_files,
    load_hour,
    load_inputs,
    load_ledger,
    save_inputs,
    save_ledger,
    steps_of_other_hours,
    written_hashes,
)
from schemas.errors import ConfigError
from tests.helpers.fleets import bill, small_pools
from tests.helpers.hours import SIMULATED_HOUR

POOL = "chat-8b"


@pytest.fixture(scope="module")
def local_lake(simulated: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small fleet's hour billed on local disk; its lake."""
    data = tmp_path_factory.mktemp("billed") / "run"
    shutil.copytree(simulated, data)
    with dg.DagsterInstance.ephemeral() as instance:
        results = bill(data, small_pools(), instance)
    assert all(r.success for r in results)
    return DataDir(data).lake


@pytest.fixture(scope="module")
def store_lake(local_lake: Path, s3_server: S3Server) -> Lake:
    lake = Lake.at(s3_server.uri("lake-copy"))
    pafs.copy_files(str(local_lake), str(lake.root), destination_filesystem=lake.filesystem)
    return lake


def test_the_hour_reads_back_the_same_from_the_store(local_lake, store_lake):
    inputs = load_inputs(local_lake, POOL, SIMULATED_HOUR)
    assert inputs.lake_hashes
    from_store = load_inputs(store_lake, POOL, SIMULATED_HOUR)
    assert from_store.context.equals(inputs.context)
    assert (from_store.batches, from_store.engine, from_store.lake_hashes) == (
        inputs.batches,
        inputs.engine,
        inputs.lake_hashes,
    )
    hashes = inputs.lake_hashes
    local = load_hour(local_lake, POOL, SIMULATED_HOUR, inputs.batches, hashes=hashes)
    stored = load_hour(store_lake, POOL, SIMULATED_HOUR, inputs.batches, hashes=hashes)
    assert local.steps.height > 0
    for table in ("steps", "slots", "holders"):
        assert getattr(stored, table).equals(getattr(local, table)), table
    assert last_seq_before(store_lake, POOL, SIMULATED_HOUR) == last_seq_before(
        local_lake, POOL, SIMULATED_HOUR
    )
    assert steps_of_other_hours(store_lake, POOL, []).equals(
        steps_of_other_hours(local_lake, POOL, [])
    )


def test_the_ledger_writes_the_same_bytes_on_the_store(local_lake, store_lake):
    ledger = load_ledger(local_lake, POOL, SIMULATED_HOUR)
    fresh = Lake.at(f"s3://stepledger/{store_lake.root.name}-written")
    save_ledger(fresh, ledger)
    save_inputs(fresh, load_inputs(local_lake, POOL, SIMULATED_HOUR))
    assert written_hashes(fresh, ledger_files(fresh, POOL, SIMULATED_HOUR)) == written_hashes(
        local_lake, ledger_files(local_lake, POOL, SIMULATED_HOUR)
    )
    hashes = written_hashes(local_lake, ledger_files(local_lake, POOL, SIMULATED_HOUR))
    reloaded = load_ledger(fresh, POOL, SIMULATED_HOUR, hashes)
    assert reloaded.ledger_lines.equals(ledger.ledger_lines)
    assert reloaded.request_costs.equals(ledger.request_costs)
    assert reloaded.invoice == ledger.invoice


def test_an_object_changed_on_the_store_fails_the_hour(local_lake, store_lake, s3_server):
    lake = Lake.at(s3_server.uri("lake-changed"))
    pafs.copy_files(str(local_lake), str(lake.root), destination_filesystem=lake.filesystem)
    inputs = load_inputs(local_lake, POOL, SIMULATED_HOUR)
    (changed,) = [f for f in ledger_files(lake, POOL, SIMULATED_HOUR) if f.stem == "invoices"]
    hashes = written_hashes(local_lake, ledger_files(local_lake, POOL, SIMULATED_HOUR))
    with lake.filesystem.open_output_stream(str(changed)) as stream:
        stream.write(b"not the invoice")
    with pytest.raises(LakeFileChanged, match=rf"^{changed}: sha256 [0-9a-f]{{64}}, but it was"):
        load_ledger(lake, POOL, SIMULATED_HOUR, hashes)
    step_file = next(iter(inputs.lake_hashes))
    with lake.filesystem.open_output_stream(str(lake.root / step_file)) as stream:
        stream.write(b"PAR1")
    with pytest.raises(LakeFileChanged, match=step_file):
        load_hour(lake, POOL, SIMULATED_HOUR, inputs.batches, hashes=inputs.lake_hashes)


def test_a_lake_uri_with_credentials_is_refused():
    with pytest.raises(ConfigError, match="environment or the instance role") as refused:
        Lake.at("s3://AKIAEXAMPLE:hunter2@bucket/lake")
    assert "hunter2" not in str(refused.value)
    assert "AKIAEXAMPLE" not in str(refused.value)


def test_a_local_lake_is_the_directory_given(tmp_path):
    lake = Lake.at(tmp_path / "lake")
    assert lake.local
    assert lake.root == tmp_path / "lake"
    assert Lake.at(str(tmp_path / "lake")) == lake
    shutil.rmtree(tmp_path)
    assert lake.files(tmp_path / "lake") == []
