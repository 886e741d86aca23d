"""`stepledger stack up` starts PostgreSQL, an S3 server, the Dagster daemon and the webserver on
loopback, the store's keys reaching clients through the environment only; `stack down` leaves
nothing running."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import duckdb
import pyarrow.fs as pafs
import pytest
from dagster_graphql import DagsterGraphQLClient

from assets.partitions import partition_key
from pipeline import finance, stack
from pipeline.datadir import DataDir
from pipeline.ingestion.ingest import segment_files
from pipeline.reconcile.alerts import ENV_FILE
from pipeline.ship.s3server import s3_filesystem
from pipeline.ship.shipper import ship_pending
from pipeline.ship.store import STORE_VARIABLE, SegmentObject, open_store, parse_key
from pipeline.storage import warehouse
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
    proc_stat,
    wait_for_daemons,
)
from tests.helpers.fleets import bill, simulate_small, small_pools
from tests.helpers.hours import SIMULATED_HOUR

pytestmark = pytest.mark.timeout(1800)
# Bounds for a webserver and daemon that hang, not wait: a loaded two-core machine has taken
# minutes to start them.
STARTUP_SECONDS = 600
REPOSITORY = Path(__file__).resolve().parents[2]
POOL = "chat-8b"
LEDGER_TABLES = ("invoices", "ledger_lines", "request_costs")


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


def finance_invoices(data: Path, env: dict[str, str]) -> int:
    """The invoices finance reads from the store of `data`, with the reader's keys only."""
    with pytest.MonkeyPatch.context() as patch:
        for name in (READER_ACCESS_KEY, READER_SECRET_KEY, "AWS_ENDPOINT_URL", "AWS_REGION"):
            patch.setenv(name, env[name])
        con = finance.connect(data)
        try:
            return int(con.execute("SELECT count(*) FROM invoices").fetchall()[0][0])
        finally:
            con.close()


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


@contextmanager
def stack_instance(env: dict[str, str]) -> Iterator[dg.DagsterInstance]:
    """The stack's Dagster instance, as its services open it."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        with dg.DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
            yield instance


def wait_until(what: str, found: Callable[[], object], deadline: float) -> object:
    """`found()` once it is truthy: the state of the stack polled until then."""
    while time.monotonic() < deadline:
        if value := found():
            return value
        time.sleep(0.2)
    raise AssertionError(f"not before the deadline: {what}")


def step_log_materialized(instance: dg.DagsterInstance, run_id: str) -> bool:
    """Whether the run has published its step_log: it ingested, the rest of its hour is ahead."""
    return any(
        event.dagster_event.asset_key == dg.AssetKey("step_log")
        for event in instance.all_logs(run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION)
        if event.dagster_event is not None
    )


def group_alive(pgid: int) -> bool:
    """Whether a process of the group `pgid` runs (one exited but not yet reaped does not)."""
    for entry in Path("/proc").glob("[0-9]*"):
        stat = proc_stat(int(entry.name))
        if stat is not None and int(stat[2]) == pgid and stat[0] != "Z":
            return True
    return False


def status_of(instance: dg.DagsterInstance, run_id: str) -> dg.DagsterRunStatus | None:
    run = instance.get_run_by_id(run_id)
    return None if run is None else run.status


def retry_of(instance: dg.DagsterInstance, run_id: str) -> dg.DagsterRun | None:
    """The run that retries `run_id`, once it has succeeded."""
    runs = instance.get_runs(
        dg.RunsFilter(
            tags={"dagster/parent_run_id": run_id}, statuses=[dg.DagsterRunStatus.SUCCESS]
        )
    )
    return runs[0] if runs else None


def kill_the_daemon_mid_hour_and_restart(
    directory: Path, port: int, processes: dict[str, int], alert_file: Path
) -> tuple[str, str]:
    """A pool-hour run launched by the stack's daemon from its queue; once the run has
    ingested, the daemon's process group (the daemon, its code server, the run) killed with
    SIGKILL, as a lost machine loses them; then `stack up` again. Returns the killed run's id
    and its retry's, once the retry has succeeded and the page for the killed run is out."""
    env = stack.environment_of(directory)
    deadline = time.monotonic() + STARTUP_SECONDS
    key = partition_key(SIMULATED_HOUR, POOL)
    run_id = DagsterGraphQLClient("127.0.0.1", port_number=port).submit_job_execution(
        "pool_hour_job",
        repository_location_name=stack.CODE_LOCATION,
        repository_name="__repository__",
        tags={
            "dagster/partition": str(key),
            **{f"dagster/partition/{d}": k for d, k in key.keys_by_dimension.items()},
        },
    )
    with stack_instance(env) as instance:
        wait_until("the run ingested", lambda: step_log_materialized(instance, run_id), deadline)
        os.killpg(processes["daemon"], signal.SIGKILL)
        wait_until(
            "the daemon's group gone", lambda: not group_alive(processes["daemon"]), deadline
        )
        assert status_of(instance, run_id) == dg.DagsterRunStatus.STARTED
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(ENV_FILE, str(alert_file))
            restarted = stack.up(directory, Path(env["STEPLEDGER_DATA"]))
        assert dict(restarted["processes"])["daemon"] != processes["daemon"]  # type: ignore[call-overload]
        assert status_of(instance, run_id) == dg.DagsterRunStatus.FAILURE
        retry = wait_until("the run retried", lambda: retry_of(instance, run_id), deadline)
        wait_until(
            "the page for the killed run",
            lambda: alert_file.is_file() and run_id in alert_file.read_text(),
            deadline,
        )
    assert isinstance(retry, dg.DagsterRun)
    return run_id, retry.run_id


def check_the_hour_after_the_kill(
    data: Path, embedded: Path, env: dict[str, str], alert_file: Path, killed_run: str
) -> None:
    """The killed and retried pool-hour equals the embedded store's to the nano-dollar, each
    segment recorded once, and one page out, for the killed run."""

    def ledger(con: duckdb.DuckDBPyConnection) -> dict[str, list[tuple[object, ...]]]:
        return {
            t: con.execute(
                f"SELECT * FROM {warehouse.LEDGER}.{t} WHERE pool = ? ORDER BY ALL", [POOL]
            ).fetchall()
            for t in LEDGER_TABLES
        }

    with warehouse.connect(embedded / "pipeline.duckdb") as con:
        expected = ledger(con)
    # The writer's connection, with the stack's environment (its warehouse's data files are on
    # the S3 server).
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        with warehouse.connect(data / "pipeline.duckdb", postgres=env[POSTGRES_ENV]) as con:
            billed = ledger(con)
            segments = con.execute("SELECT segment_id FROM segments").fetchall()
            files = con.execute("SELECT count(*) FROM segment_files").fetchall()[0][0]
    assert billed["invoices"]
    assert billed == expected
    assert len(segments) == len(set(segments)) > 0
    assert files == len(segment_files(DataDir(data).outbox))
    pages = [json.loads(line) for line in alert_file.read_text().splitlines()]
    assert [killed_run in json.dumps(page) for page in pages] == [True], pages


def test_the_stack_serves_on_loopback_bills_the_production_demo_and_down_stops_all(
    tmp_path: Path, write_segment
) -> None:
    """One stack for all (starting one takes most of a minute): its services on loopback, a
    client given only `stack env`, the production demo shipped and billed through it, a
    pool-hour run of the daemon's killed mid-hour with the daemon and retried after `stack up`,
    then `stack down`."""
    postgres_or_skip()
    directory, data = tmp_path / "stack", simulate_small(tmp_path / "data")
    embedded = tmp_path / "embedded"
    shutil.copytree(data, embedded)
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
        assert finance_invoices(data, env) == 0
        with pytest.raises(stack.StackError, match="a stack runs there"):
            stack.up(directory, data)
        demo = run_production_demo(directory, env, tmp_path / "demo")
        started_kill = time.monotonic()
        killed_run, _ = kill_the_daemon_mid_hour_and_restart(
            directory, port, processes, tmp_path / "pages.jsonl"
        )
        killed_and_retried_s = time.monotonic() - started_kill
        processes.update(json.loads((directory / stack.STACK_FILE).read_text())["processes"])
        with dg.DagsterInstance.ephemeral() as instance:
            assert all(run.success for run in bill(embedded, small_pools(), instance))
        check_the_hour_after_the_kill(data, embedded, env, tmp_path / "pages.jsonl", killed_run)
        checked_s = time.monotonic() - started_kill
        # The demo's store, made on the same server since, has a reader role of its own.
        assert finance_invoices(data, env) > 0
    finally:
        stopped = stack.down(directory)
    print(
        f"daemon killed mid-hour, restarted, run retried: {killed_and_retried_s:.1f} s; "
        f"with the embedded billing and the checks: {checked_s:.1f} s"
    )
    assert stopped == ["webserver", "daemon", "s3", "postgres"]
    assert listening_addresses(s3_port) == set()
    assert [name for name, pgid in processes.items() if stack.group_running(pgid)] == []
    assert not (Path(str(record["cluster"])) / "postmaster.pid").exists()
    assert not (directory / stack.STACK_FILE).exists()
    check_production_demo(tmp_path / "demo", env, *demo)


def test_down_in_the_process_that_started_a_service_collects_it_when_it_ends(
    tmp_path: Path,
) -> None:
    """A service this process started (`up` and `down` in one process, as tests and
    benchmarks do) is a zombie once SIGTERM ends it: `down` collects it rather than waiting out
    the stop grace for it and leaving it to this process."""
    directory = tmp_path / "stack"
    directory.mkdir()
    sleeper = shutil.which("sleep")
    assert sleeper is not None
    pid = os.posix_spawn(sleeper, ["sleep", "600"], dict(os.environ), setsid=True)
    (directory / stack.STACK_FILE).write_text(
        json.dumps({"cluster": str(directory / "postgres"), "processes": {"service": pid}})
    )
    try:
        assert stack.down(directory) == ["service"]
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
