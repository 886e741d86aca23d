"""A fleet billed side by side on the production store: the pipeline's state and the DuckLake
catalog in a real PostgreSQL server (started here), four pools' hours billed by four processes
at once while finance reads, and the ledger equal to the embedded store's to the nano-dollar."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import pytest

from assets.definitions import build_definitions
from pipeline import finance
from pipeline.reconcile import alerts
from pipeline.storage import warehouse
from schemas.config import PoolsFile, load_pools
from tests.helpers.dagster_processes import free_port
from tests.helpers.fleets import SIMULATED_HOURS, small_pools
from tests.helpers.hours import SIMULATED_HOUR
from tests.helpers.postgres_server import PostgresServer, crash, postgres_or_skip, restart
from tests.helpers.webhooks import RecordingSink

pytestmark = pytest.mark.timeout(1800)
POOLS = ("chat-8b", "chat-8b-eu", "chat-8b-us", "chat-8b-ap")
HOUR = SIMULATED_HOUR
FINANCE_PASSWORD = "finance-reads-only"
# What each billing process runs: the pool-hour job of one pool, in-process, as a run pod would.
BILL_ONE_POOL = """
import json, sys, warnings
from pathlib import Path
import dagster as dg
from assets.definitions import build_definitions
from assets.partitions import partition_key
from assets.runner import QUIET_RUN_CONFIG, pool_hour_outcome
from pipeline.datadir import DataDir
from schemas.config import load_pools
from schemas.units import parse_hour_key
warnings.filterwarnings("ignore")
STEP_EVENTS = ("STEP_START", "STEP_SUCCESS", "STEP_FAILURE")
data, hour, pool = Path(sys.argv[1]), parse_hour_key(sys.argv[2]), sys.argv[3]
job = build_definitions(load_pools(DataDir(data).pools_file), data).resolve_job_def("pool_hour_job")
if sys.argv[4:] == ["--at-go"]:
    # Loaded and ready: billing starts when the test says go, as another billing does.
    print("ready", flush=True)
    sys.stdin.readline()
with dg.DagsterInstance.ephemeral() as instance:
    result = job.execute_in_process(
        partition_key=partition_key(hour, pool), instance=instance,
        run_config=QUIET_RUN_CONFIG, raise_on_error=False)
    steps = [e.timestamp for e in instance.all_logs(result.run_id)
             if e.dagster_event and e.dagster_event.event_type_value in STEP_EVENTS]
print(pool_hour_outcome(result))
# When the run's first step started and its last ended (seconds since the epoch).
print(json.dumps([min(steps), max(steps)]))
sys.exit(0 if result.success else 1)
"""
LEDGER_QUERIES = {
    "invoices": "SELECT * FROM invoices ORDER BY ALL",
    "ledger_lines": "SELECT * FROM ledger_lines ORDER BY ALL",
    "request_costs": "SELECT * FROM request_costs ORDER BY ALL",
    "reconciliation": "SELECT * EXCLUDE (checked_at) FROM reconciliation ORDER BY ALL",
}


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with postgres_or_skip() as server:
        yield server


def dsn(server: PostgresServer) -> str:
    return server.dsn()


def four_pools() -> PoolsFile:
    """The default chat pool's four replicas as four pools of one replica each."""
    chat = load_pools().pool("chat-8b")
    base = small_pools()
    return base.model_copy(
        update={
            "pools": [
                chat.model_copy(update={"name": name, "replicas": [replica]})
                for name, replica in zip(POOLS, chat.replicas, strict=True)
            ]
        }
    )


@pytest.fixture(scope="module")
def fleet_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeline.simulator import simulate

    out = tmp_path_factory.mktemp("fleet") / "data"
    simulate(out, four_pools(), hours=SIMULATED_HOURS, seed=13)
    return out


def bill(
    data: Path, pool: str, env: dict[str, str], *, at_go: bool = False
) -> subprocess.Popen[str]:
    """A process billing `pool`'s hour; `at_go`: once it has loaded, it says "ready" and waits
    for a line on its standard input before it starts."""
    return subprocess.Popen(
        [
            *(sys.executable, "-c", BILL_ONE_POOL, str(data), HOUR.strftime("%Y-%m-%dT%H"), pool),
            *(["--at-go"] if at_go else []),
        ],
        env=env,
        stdin=subprocess.PIPE if at_go else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def bill_at_once(
    data: Path, pool: str, env: dict[str, str], count: int
) -> list[subprocess.Popen[str]]:
    """`count` processes billing `pool`'s hour, started together once all have loaded."""
    runs = [bill(data, pool, env, at_go=True) for _ in range(count)]
    for run in runs:
        assert run.stdout is not None
        ready = run.stdout.readline()
        assert ready == "ready\n", ready + (run.stderr.read() if run.stderr else "")
    for run in runs:
        assert run.stdin is not None
        run.stdin.write("go\n")
        run.stdin.flush()
    return runs


def finished(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = process.communicate()
    return process.returncode, out, err


def ledger(data: Path, pool: str | None = None) -> dict[str, list[tuple[object, ...]]]:
    """The ledger finance reads, or one pool's part of it."""
    con = finance.connect(data)
    try:
        return {
            name: con.execute(
                sql if pool is None else sql.replace(" ORDER BY", " WHERE pool = ? ORDER BY"),
                [] if pool is None else [pool],
            ).fetchall()
            for name, sql in LEDGER_QUERIES.items()
        }
    finally:
        con.close()


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != warehouse.POSTGRES_ENV}
    return {**env, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), **extra}


@pytest.fixture(scope="module")
def embedded(fleet_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fleet's hour billed pool after pool on the embedded store: its data directory."""
    billed = tmp_path_factory.mktemp("embedded") / "data"
    shutil.copytree(fleet_data, billed)
    for pool in POOLS:
        code, out, err = finished(bill(billed, pool, environment()))
        assert code == 0, (out + err)[-3000:]
    return billed


@pytest.fixture(scope="module")
def embedded_ledger(embedded: Path) -> dict[str, list[tuple[object, ...]]]:
    return ledger(embedded)


def production_store(server: PostgresServer, name: str, data: Path) -> str:
    """A store of its own on the server for the data directory `data` (a database per test),
    finance's role created; its connection string."""
    subprocess.run(
        [
            "psql",
            f"postgresql://{server.user}:{server.password}@{server.host}:{server.port}/"
            f"{server.database}",
            "-c",
            f"CREATE DATABASE {name}",
        ],
        check=True,
        capture_output=True,
    )
    store = dsn(server).replace(f"dbname={server.database}", f"dbname={name}")
    with warehouse.connect(data / "pipeline.duckdb", postgres=store) as con:
        warehouse.create_reader_role(con, warehouse.warehouse_dir(data), FINANCE_PASSWORD)
    return store


def production_copy(
    server: PostgresServer, fleet_data: Path, tmp_path: Path, name: str
) -> tuple[Path, str, dict[str, str]]:
    """A copy of the fleet's data with a store of its own: the copy, the store's connection
    string and the environment that bills into it."""
    production = tmp_path / "production"
    shutil.copytree(fleet_data, production)
    store = production_store(server, name, production)
    return production, store, environment(**{warehouse.POSTGRES_ENV: store})


def test_four_pools_billed_at_once_on_postgres_equal_the_embedded_ledger(
    postgres: PostgresServer,
    fleet_data: Path,
    embedded_ledger: dict[str, list[tuple[object, ...]]],
    tmp_path: Path,
) -> None:
    production, _, env = production_copy(postgres, fleet_data, tmp_path, "side_by_side")
    seen_invoices: list[int] = []
    stop_reading = threading.Event()

    def read_while_billing() -> None:
        con = finance.connect(production)
        try:
            while not stop_reading.is_set():
                seen_invoices.append(con.execute("SELECT count(*) FROM invoices").fetchall()[0][0])
        finally:
            con.close()

    reader = threading.Thread(target=read_while_billing)
    reader.start()
    try:
        runs = [bill(production, pool, env) for pool in POOLS]
        outcomes = [finished(run) for run in runs]
    finally:
        stop_reading.set()
        reader.join()
    for code, out, err in outcomes:
        assert code == 0, (out + err)[-3000:]

    assert not (production / "pipeline.duckdb").exists()
    assert (production / "warehouse" / warehouse.CATALOG_POINTER).is_file()
    assert [row[1] for row in embedded_ledger["invoices"]] == sorted(POOLS)
    assert ledger(production) == embedded_ledger
    # The reader saw the ledger grow from nothing to the four invoices, a snapshot at a time.
    assert seen_invoices, "finance read nothing while the pools were billed"
    assert seen_invoices == sorted(seen_invoices)
    assert seen_invoices[-1] <= len(POOLS)


def test_without_the_embedded_file_no_step_waits_for_a_pool(postgres: PostgresServer) -> None:
    pools = four_pools()
    embedded = build_definitions(pools, Path("unused"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(warehouse.POSTGRES_ENV, dsn(postgres))
        production = build_definitions(pools, Path("unused"))

    def pools_of(defs: object) -> set[str | None]:
        job = defs.resolve_job_def("pool_hour_job")  # type: ignore[attr-defined]
        return {node.definition.pool for node in job.graph.node_dict.values()}

    assert pools_of(embedded) == {None, "duckdb"}
    assert pools_of(production) == {None}


def test_the_finance_role_reads_the_catalog_and_can_write_nothing(
    postgres: PostgresServer, tmp_path: Path
) -> None:
    count_snapshots = "SELECT count(*) FROM ducklake.ducklake_snapshot"
    with warehouse.connect(tmp_path / "pipeline.duckdb", postgres=dsn(postgres)) as con:
        pointer = warehouse.create_reader_role(
            con, warehouse.warehouse_dir(tmp_path), FINANCE_PASSWORD
        )
        snapshots = con.execute(
            f"SELECT * FROM postgres_query('{warehouse.STATE}', '{count_snapshots}')"
        ).fetchall()
    as_finance = duckdb.connect(config={"allow_unsigned_extensions": True})
    warehouse.load_extensions(as_finance, "postgres_scanner")
    as_finance.execute(
        f"ATTACH 'host={postgres.host} port={postgres.port} dbname={postgres.database} "
        f"user={warehouse.FINANCE_ROLE} password={FINANCE_PASSWORD}' AS pg (TYPE postgres)"
    )

    def refused(sql: str) -> str:
        with pytest.raises(duckdb.Error) as err:
            as_finance.execute(f"CALL postgres_execute('pg', {sql!r})")
        return str(err.value)

    assert (
        as_finance.execute(f"SELECT * FROM postgres_query('pg', '{count_snapshots}')").fetchall()
        == snapshots
    )
    assert "read-only transaction" in refused("DELETE FROM ducklake.ducklake_snapshot")
    assert "read-only transaction" in refused("CREATE TABLE ducklake.stray (a int)")
    assert "permission denied" in refused(
        "SET TRANSACTION READ WRITE; DELETE FROM ducklake.ducklake_snapshot"
    )
    assert "permission denied" in refused("SELECT * FROM public.segments")
    assert "permission denied" in refused("SET SESSION AUTHORIZATION stepledger")
    assert pointer.name == warehouse.CATALOG_POINTER


def rows_of(con: duckdb.DuckDBPyConnection, table: str) -> int:
    return int(con.execute(f"SELECT count(*) FROM {table}").fetchall()[0][0])


def test_a_run_killed_mid_hour_then_run_again_bills_the_same_ledger(
    postgres: PostgresServer,
    fleet_data: Path,
    embedded_ledger: dict[str, list[tuple[object, ...]]],
    tmp_path: Path,
) -> None:
    production, store, env = production_copy(postgres, fleet_data, tmp_path, "killed_mid_hour")
    segment_files = sorted((production / "outbox").glob("*/*.seg"))
    state = duckdb.connect(config={"allow_unsigned_extensions": True})
    warehouse.load_extensions(state, "postgres_scanner")
    # Killed once its first step has committed the segments it ingested, in its next steps.
    first = bill(production, POOLS[0], env)
    try:
        ingested = 0
        while ingested == 0 and first.poll() is None:
            with contextlib.suppress(duckdb.Error):
                state.execute(f"ATTACH IF NOT EXISTS '{store}' AS pg (TYPE postgres, READ_ONLY)")
                state.execute("CALL pg_clear_cache()")
                ingested = rows_of(state, "pg.public.segments")
        first.send_signal(signal.SIGKILL)
    finally:
        first.communicate()
    assert ingested > 0, "the run ended before it could be killed"
    for pool in POOLS:
        code, out, err = finished(bill(production, pool, env))
        assert code == 0, (out + err)[-3000:]

    assert ledger(production) == embedded_ledger
    state.execute("CALL pg_clear_cache()")
    assert rows_of(state, "pg.public.segment_files") == len(segment_files)
    assert rows_of(state, "pg.public.segments") == len(
        {row[0] for row in state.execute("SELECT segment_id FROM pg.public.segments").fetchall()}
    )


def test_ducklake_commits_first_publications_side_by_side_and_retries_replacements(
    postgres: PostgresServer, tmp_path: Path
) -> None:
    """DuckLake's conflict rules on the PostgreSQL catalog, as replace_hour meets them: two
    pool-hours published for the first time (their deletes find no row) both commit; two
    re-published at once conflict (a table inserted into while the other deleted from it),
    and the loser, run again by retry_conflicts, commits."""
    store = production_store(postgres, "conflict_rules", tmp_path)
    writers = []
    for _ in range(2):
        con = duckdb.connect(config={"allow_unsigned_extensions": True})
        warehouse.attach_warehouse(con, tmp_path / "warehouse", read_only=False, postgres=store)
        writers.append(con)
    first, second = writers
    first.execute("CREATE TABLE ledger.lines (pool VARCHAR, amount_nano BIGINT)")

    def publish(con: duckdb.DuckDBPyConnection, pool: str, amount: int) -> None:
        con.execute("DELETE FROM ledger.lines WHERE pool = ?", [pool])
        con.execute("INSERT INTO ledger.lines VALUES (?, ?)", [pool, amount])

    def side_by_side(amounts: dict[str, int]) -> None:
        first.execute("BEGIN")
        second.execute("BEGIN")
        publish(first, "a", amounts["a"])
        publish(second, "b", amounts["b"])
        first.execute("COMMIT")
        second.execute("COMMIT")

    side_by_side({"a": 1, "b": 2})
    with pytest.raises(duckdb.TransactionException, match="Transaction conflict"):
        side_by_side({"a": 10, "b": 20})

    def publish_b() -> None:
        with warehouse.transaction(second):
            publish(second, "b", 20)

    warehouse.retry_conflicts(publish_b, "publish b")
    assert first.execute("FROM ledger.lines ORDER BY pool").fetchall() == [("a", 10), ("b", 20)]


def ingested_segments(state: duckdb.DuckDBPyConnection, store: str) -> int:
    """Segments the store has committed, 0 while it cannot be read."""
    with contextlib.suppress(duckdb.Error):
        state.execute(f"ATTACH IF NOT EXISTS '{store}' AS pg (TYPE postgres, READ_ONLY)")
        state.execute("CALL pg_clear_cache()")
        return rows_of(state, "pg.public.segments")
    return 0


def page_owed_with_the_sink_down(store: str, data: Path, now: datetime) -> str:
    """What the failure pager owes for a run of POOLS[0]'s hour, recorded in the store's outbox
    and tried once on a sink that refuses connections; its dedup key."""
    down = alerts.WebhookSink(f"http://127.0.0.1:{free_port()}/hooks/pages", format="slack")
    (owed,) = alerts.hour_alerts([], POOLS[0], HOUR, "run-killed-with-postgres", None, now)
    with warehouse.connect(data / "pipeline.duckdb", postgres=store) as con:
        assert alerts.enqueue(con, [owed]) == 1
        assert alerts.deliver_due(con, down, now) == []
    return owed.dedup_key


SEGMENTS_OF_POOL = (
    "SELECT segment_id, replica, first_seq, last_seq, steps, dropped_steps, sha256 "
    "FROM {table} WHERE pool = ? ORDER BY ALL"
)


def test_postgres_killed_mid_hour_then_restarted_bills_the_same_ledger_and_pages(
    fleet_data: Path, embedded: Path, tmp_path: Path
) -> None:
    """Every process of the server SIGKILLed while a pool-hour ingests, with a page owed: after
    a restart (PostgreSQL replays its log) the hour billed again equals the embedded ledger,
    each segment is recorded once, and the page is delivered once."""
    pool = POOLS[0]
    with postgres_or_skip() as server:
        production, store, env = production_copy(server, fleet_data, tmp_path, "crashed")
        now = datetime.now(UTC)
        owed_key = page_owed_with_the_sink_down(store, production, now)
        state = duckdb.connect(config={"allow_unsigned_extensions": True})
        warehouse.load_extensions(state, "postgres_scanner")
        run = bill(production, pool, env)
        try:
            ingested = 0
            while ingested == 0 and run.poll() is None:
                ingested = ingested_segments(state, store)
            state.execute("DETACH DATABASE IF EXISTS pg")
            crash(server)
        finally:
            code, out, err = finished(run)
        assert ingested > 0, "the run ended before the server could be killed"
        assert code != 0, "the run billed its hour without the server"

        restart(server)
        code, out, err = finished(bill(production, pool, env))
        assert code == 0, (out + err)[-3000:]
        assert ledger(production, pool) == ledger(embedded, pool)
        assert ingested_segments(state, store) > 0
        with duckdb.connect(str(embedded / "pipeline.duckdb"), read_only=True) as con:
            segments = con.execute(SEGMENTS_OF_POOL.format(table="segments"), [pool]).fetchall()
        assert segments
        assert (
            state.execute(SEGMENTS_OF_POOL.format(table="pg.public.segments"), [pool]).fetchall()
            == segments
        )
        assert rows_of(state, "pg.public.segment_files") == len(
            list((production / "outbox").glob(f"{segments[0][1]}/*.seg"))
        )
        state.close()
        with RecordingSink() as sink:
            up = alerts.WebhookSink(sink.url, format="slack")
            with warehouse.connect(production / "pipeline.duckdb", postgres=store) as con:
                delivered = alerts.deliver_due(con, up, now + alerts.LAST_RETRY)
                assert alerts.deliver_due(con, up, now + 2 * alerts.LAST_RETRY) == []
        assert [a.dedup_key for a in delivered] == [owed_key]
        assert len(sink.bodies) == 1


def duplicated_rows(data: Path, postgres: str | None) -> dict[str, int]:
    """Rows that are in a table of the pipeline's state or of the warehouse more than once,
    by table (DuckLake's own catalog aside)."""
    with warehouse.connect(data / "pipeline.duckdb", postgres=postgres) as con:
        tables = con.execute(
            "SELECT database_name, schema_name, table_name FROM duckdb_tables() "
            "WHERE schema_name NOT IN ('ducklake', 'pg_catalog', 'information_schema') "
            "AND database_name NOT LIKE '__ducklake%'"
        ).fetchall()
        counts = {
            ".".join(name): con.execute(
                f'SELECT count(*) - (SELECT count(*) FROM (SELECT DISTINCT * FROM "{name[0]}"'
                f'."{name[1]}"."{name[2]}")) FROM "{name[0]}"."{name[1]}"."{name[2]}"'
            ).fetchall()[0][0]
            for name in tables
        }
    assert {"ledger.main.invoices", "ledger.main.ledger_lines"} <= set(counts), counts
    return {name: count for name, count in counts.items() if count}


@pytest.mark.parametrize("profile", ["embedded", "postgres"])
def test_two_billings_of_one_pool_hour_at_once_bill_it_once(
    profile: str,
    fleet_data: Path,
    embedded: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """Two processes bill the same pool-hour at the same moment: the second waits for the
    first's pool-hour lock, then re-bills the hour exactly. The ledger is one billing's, to the
    nano-dollar, and no table holds a row twice."""
    pool = POOLS[0]
    if profile == "postgres":
        server: PostgresServer = request.getfixturevalue("postgres")
        data, store, env = production_copy(server, fleet_data, tmp_path, "same_pool_hour")
    else:
        data, store, env = tmp_path / "embedded", None, environment()
        shutil.copytree(fleet_data, data)
    spans = []
    for code, out, err in map(finished, bill_at_once(data, pool, env, 2)):
        assert code == 0, (out + err)[-3000:]
        spans.append(json.loads(out.splitlines()[-1]))

    # One billing's steps all ran before the other's first: the second waited for the lock.
    first, second = sorted(spans)
    assert first[1] <= second[0], spans

    assert ledger(data, pool) == ledger(embedded, pool)
    assert ledger(data)["invoices"] == ledger(embedded, pool)["invoices"]
    assert duplicated_rows(data, store) == {}
