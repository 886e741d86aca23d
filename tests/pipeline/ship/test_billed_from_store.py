"""Engines' outboxes -> `stepledger ship` -> a real S3 server -> the pool-hour billed from the
store: the ledger equals that of the same outboxes billed from local disk, to the nano-dollar,
also when the server is killed and restarted while segments are being shipped, and when the
shipper is killed with SIGKILL mid-run and started again."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from pipeline.datadir import DataDir
from pipeline.ingestion.ingest import segment_files
from pipeline.ship.s3server import S3Server
from pipeline.ship.store import STORE_VARIABLE, open_store
from pipeline.storage.warehouse import STATE_FILE, connect_read_only
from tests.helpers.children import child, stop
from tests.helpers.dagster_processes import STEPLEDGER
from tests.helpers.fleets import bill, simulate_small, small_pools

pytestmark = pytest.mark.timeout(900)

LEDGER_QUERIES = {
    "invoices": "SELECT * FROM invoices",
    "ledger_lines": "SELECT * FROM ledger_lines",
    "request_costs": "SELECT * FROM request_costs",
    "reconciliation": "SELECT * EXCLUDE (checked_at) FROM reconciliation",
}


def ledger(data: Path) -> dict[str, list[tuple[Any, ...]]]:
    with connect_read_only(data / STATE_FILE) as con:
        return {
            name: sorted(con.execute(query).fetchall(), key=repr)
            for name, query in LEDGER_QUERIES.items()
        }


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return simulate_small(tmp_path_factory.mktemp("fleet") / "run")


@pytest.fixture(scope="module")
def local_ledger(
    fleet: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[tuple[Any, ...]]]:
    data = tmp_path_factory.mktemp("local") / "run"
    shutil.copytree(fleet, data)
    with dg.DagsterInstance.ephemeral() as instance:
        assert all(r.success for r in bill(data, small_pools(), instance))
    billed = ledger(data)
    assert billed["ledger_lines"]
    assert billed["request_costs"]
    return billed


def gpu_node(fleet: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The fleet's data directory without its outboxes, and the outboxes moved to a node."""
    data = tmp_path / "pipeline"
    shutil.copytree(fleet, data)
    node_outbox = tmp_path / "node" / "outbox"
    node_outbox.parent.mkdir()
    shutil.move(DataDir(data).outbox, node_outbox)
    return data, node_outbox


def ship_command(outbox: Path, *flags: str) -> list[str]:
    return [
        *(STEPLEDGER, "ship"),
        *("--outbox", str(outbox), "--pool", "chat-8b", "--interval", "0.2", *flags),
    ]


@pytest.fixture
def store_env(s3_server: S3Server, request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """The environment of the shipper and the pipeline: the store under a prefix of this test."""
    uri = s3_server.uri(request.node.name.replace("[", "-").rstrip("]"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(STORE_VARIABLE, uri)
        yield {**os.environ, "PYTHONPATH": str(Path.cwd())}


def bill_from_store(data: Path, node_outbox: Path) -> dict[str, list[tuple[Any, ...]]]:
    # Everything left the node, and every segment is on the store once.
    assert segment_files(node_outbox) == []
    with dg.DagsterInstance.ephemeral() as instance:
        assert all(r.success for r in bill(data, small_pools(), instance))
    return ledger(data)


def wait_for_objects(store_uri: str, at_least: int, shipper: subprocess.Popen[bytes]) -> int:
    store = open_store(store_uri)
    while len(found := store.segments()) < at_least:
        assert shipper.poll() is None, "the shipper exited"
    return len(found)


def test_shipped_segments_bill_as_the_local_outbox(fleet, local_ledger, store_env, tmp_path):
    data, node_outbox = gpu_node(fleet, tmp_path)
    segments = len(segment_files(node_outbox))
    done = subprocess.run(
        ship_command(node_outbox, "--once"), env=store_env, capture_output=True, check=True
    )
    assert done.stdout.decode().count("shipped s3://") == segments
    assert len(open_store(os.environ[STORE_VARIABLE]).segments()) == segments
    assert not DataDir(data).outbox.exists()
    assert bill_from_store(data, node_outbox) == local_ledger
    # Shipping again finds nothing to do, and billing again changes nothing.
    subprocess.run(ship_command(node_outbox, "--once"), env=store_env, check=True)
    assert len(open_store(os.environ[STORE_VARIABLE]).segments()) == segments


def test_the_store_killed_and_restarted_mid_run_loses_nothing(
    fleet, local_ledger, store_env, s3_server, tmp_path
):
    data, node_outbox = gpu_node(fleet, tmp_path)
    segments = len(segment_files(node_outbox))
    log = tmp_path / "ship.log"
    with (
        log.open("wb") as sink,
        child(ship_command(node_outbox), env=store_env, stderr=sink) as shipper,
    ):
        wait_for_objects(os.environ[STORE_VARIABLE], 1, shipper)
        s3_server.kill()
        while "retrying in" not in log.read_text():
            assert shipper.poll() is None
        s3_server.start()
        while segment_files(node_outbox):
            assert shipper.poll() is None
        assert stop(shipper) == 0
    assert len(open_store(os.environ[STORE_VARIABLE]).segments()) == segments
    assert bill_from_store(data, node_outbox) == local_ledger


def test_the_shipper_killed_mid_run_and_restarted_loses_nothing(
    fleet, local_ledger, store_env, tmp_path
):
    data, node_outbox = gpu_node(fleet, tmp_path)
    segments = len(segment_files(node_outbox))
    with child(ship_command(node_outbox), env=store_env, stderr=subprocess.DEVNULL) as shipper:
        wait_for_objects(os.environ[STORE_VARIABLE], 1, shipper)
        shipper.send_signal(signal.SIGKILL)
        shipper.wait()
    assert segment_files(node_outbox), "the shipper finished before it was killed"
    subprocess.run(ship_command(node_outbox, "--once"), env=store_env, check=True)
    assert len(open_store(os.environ[STORE_VARIABLE]).segments()) == segments
    assert bill_from_store(data, node_outbox) == local_ledger
