"""`stepledger stack up` starts PostgreSQL, an S3 server, the Dagster daemon and the webserver on
loopback, the store's keys reaching clients through the environment only; `stack down` leaves
nothing running."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from pipeline import finance, stack
from pipeline.datadir import DataDir
from pipeline.ingestion.ingest import segment_files
from pipeline.ship.s3server import s3_filesystem
from pipeline.ship.shipper import ship_pending
from pipeline.ship.store import STORE_VARIABLE, SegmentObject, open_store, parse_key
from pipeline.storage.data_files import (
    READER_ACCESS_KEY,
    READER_SECRET_KEY,
    WAREHOUSE_DATA_VARIABLE,
)
from pipeline.storage.warehouse import POSTGRES_ENV
from schemas.config import load_pools
from schemas.errors import ExternalError
from tests.helpers.dagster_processes import (
    STEPLEDGER,
    free_port,
    listening_addresses,
    wait_for_daemons,
)

pytestmark = pytest.mark.timeout(1800)
# Bounds for a webserver and daemon that hang, not wait: a loaded two-core machine has taken
# minutes to start them.
STARTUP_SECONDS = 600
REPOSITORY = Path(__file__).resolve().parents[2]


def postgres_or_skip() -> None:
    try:
        stack.server_binaries()
    except ExternalError as err:
        pytest.skip(f"no PostgreSQL server here: {err}")


def secrets(env: dict[str, str]) -> list[bytes]:
    """The stack's PostgreSQL password and the store's secret keys, the writer's and the
    reader's."""
    return [
        env[name].encode()
        for name in ("DAGSTER_PG_PASSWORD", "AWS_SECRET_ACCESS_KEY", READER_SECRET_KEY)
    ]


def secrets_written(directory: Path, env: dict[str, str]) -> list[str]:
    """Files under `directory` that hold a secret of the stack, beside the two meant to (the
    owner's record of the stack, the S3 server's identity file)."""
    meant = {directory / stack.STACK_FILE, directory / "s3" / "credentials.json"}
    return [
        str(path)
        for path in directory.rglob("*")
        if path.is_file()
        and path not in meant
        and any(s in path.read_bytes() for s in secrets(env))
    ]


def ship_one_segment(env: dict[str, str], tmp_path: Path, write_segment) -> list[str]:
    """A segment shipped to the store `env` names, by a client given only those variables; the
    keys listed there."""
    outbox = tmp_path / "node-outbox"
    write_segment(3, outbox / "r0")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        store = open_store(env[STORE_VARIABLE])
        assert ship_pending(store, outbox).failed == []
        return [segment.key for segment in store.segments()]


def run_production_demo(
    directory: Path, env: dict[str, str], out: Path
) -> tuple[subprocess.CompletedProcess[str], list[SegmentObject], list[str]]:
    """`stepledger demo --profile production` through the stack: its result, the segment
    objects it left on the store and its warehouse's data files there."""
    done = subprocess.run(
        [
            *(STEPLEDGER, "demo", "--profile", "production", "--stack", str(directory)),
            *("--out", str(out), "--hours", "0.01", "--workers", "1", "--json"),
        ],
        env={**os.environ, "PYTHONPATH": str(REPOSITORY)},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        return done, open_store("s3://stepledger/demo").segments(), warehouse_objects(env)


def warehouse_objects(env: dict[str, str]) -> list[str]:
    """The data files of the demo's warehouse on the store."""
    found = s3_filesystem(env).get_file_info(
        pafs.FileSelector("stepledger/demo/warehouse", recursive=True, allow_not_found=True)
    )
    return [info.path for info in found if info.path.endswith(".parquet")]


def check_production_demo(
    out: Path,
    env: dict[str, str],
    done: subprocess.CompletedProcess[str],
    objects: list[SegmentObject],
    warehouse: list[str],
) -> None:
    result = json.loads(done.stdout)
    replicas = {r.id for pool in load_pools().pools for r in pool.replicas}
    # One segment per replica, each on the store once, none left on the GPU node's disk.
    assert sorted(o.replica for o in objects) == sorted(replicas)
    assert result["shipped"] == {
        "store": "s3://stepledger/demo",
        "segments": len(replicas),
        "bytes": sum(o.size for o in objects),
        "failed": [],
    }
    assert segment_files(DataDir(out / "gpu-node").outbox) == []
    # What was billed is what the store holds: pulled into the pipeline's outbox, byte for byte.
    pulled = segment_files(DataDir(out).outbox)
    assert sorted(
        (p.parent.name, p.name, hashlib.sha256(p.read_bytes()).hexdigest()) for p in pulled
    ) == sorted((o.replica, o.name, o.sha256) for o in objects)
    assert [(r["pool"], r["success"]) for r in result["runs"]] == [
        ("chat-8b", True),
        ("reason-dsv3", True),
    ]
    assert result["costs"]
    # The warehouse's data files are on the store, none in its directory.
    assert warehouse
    assert list((out / "warehouse" / "data").rglob("*.parquet")) == []
    leaked = [s for s in secrets(env) if s.decode() in done.stdout + done.stderr]
    assert (leaked, secrets_written(out, env)) == ([], [])


def test_the_stack_serves_on_loopback_bills_the_production_demo_and_down_stops_all(
    tmp_path: Path, write_segment
) -> None:
    """One stack for both (starting one takes most of a minute): its services on loopback, a
    client given only `stack env`, the production demo shipped and billed through it, then
    `stack down`."""
    postgres_or_skip()
    directory, data = tmp_path / "stack", tmp_path / "data"
    data.mkdir()
    port = free_port()
    record = stack.up(directory, data, webserver_port=port)
    processes = dict(record["processes"])  # type: ignore[call-overload]
    try:
        assert set(processes) == {"s3", "daemon", "webserver"}
        wait_for_daemons(port, time.monotonic() + STARTUP_SECONDS)
        # Loopback only: 0100007F is 127.0.0.1 as /proc/net/tcp writes it.
        assert listening_addresses(port) == {"0100007F"}
        env = stack.environment_of(directory)
        assert env[POSTGRES_ENV].startswith("host=127.0.0.1 ")
        assert env[STORE_VARIABLE] == "s3://stepledger/fleet"
        assert env[WAREHOUSE_DATA_VARIABLE] == "s3://stepledger/fleet/warehouse"
        assert env[READER_ACCESS_KEY] != env["AWS_ACCESS_KEY_ID"]
        s3_port = int(env["AWS_ENDPOINT_URL"].removeprefix("http://127.0.0.1:"))
        assert listening_addresses(s3_port) == {"0100007F"}
        (key,) = ship_one_segment(env, tmp_path, write_segment)
        shipped = parse_key(key)
        assert shipped is not None
        assert (shipped.replica, shipped.last_seq) == ("r0", 2)
        assert secrets_written(directory, env) == []
        # Finance reads the stack's store through its read-only role and the store through the
        # reader's keys: an empty ledger.
        with pytest.MonkeyPatch.context() as patch:
            for name in (READER_ACCESS_KEY, READER_SECRET_KEY, "AWS_ENDPOINT_URL", "AWS_REGION"):
                patch.setenv(name, env[name])
            con = finance.connect(data)
            try:
                assert con.execute("SELECT count(*) FROM invoices").fetchall() == [(0,)]
            finally:
                con.close()
        with pytest.raises(stack.StackError, match="a stack runs there"):
            stack.up(directory, data)
        demo = run_production_demo(directory, env, tmp_path / "demo")
    finally:
        stopped = stack.down(directory)
    assert stopped == ["webserver", "daemon", "s3", "postgres"]
    assert listening_addresses(s3_port) == set()
    assert [name for name, pgid in processes.items() if stack.group_running(pgid)] == []
    assert not (Path(str(record["cluster"])) / "postmaster.pid").exists()
    assert not (directory / stack.STACK_FILE).exists()
    check_production_demo(tmp_path / "demo", env, *demo)
