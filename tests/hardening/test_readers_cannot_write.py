"""A reader can never write: every statement a finance reader could use to change the ledger,
the pipeline's state or any other file fails with DuckDB's own error, and every file of the
data directory is the same, byte for byte, afterwards.

The readers are `pipeline.finance.connect` (which `stepledger costs`, the report and the FOCUS
export use too) and `stepledger sql`, on a warehouse billed through the Dagster definitions,
with a page owed in the alert outbox."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from pathlib import Path

import dagster as dg
import duckdb
import pytest
from click.testing import CliRunner

from assets.cli import main
from pipeline import finance
from pipeline.reconcile import alerts
from pipeline.storage.read_only_files import PROTOCOL
from pipeline.storage.warehouse import STATE_FILE, connect
from tests.helpers.fleets import bill, simulate_small, small_pools
from tests.helpers.hours import SIMULATED_HOUR

LOCKED = "the configuration has been locked"
LOCAL_FILES_OFF = "File system LocalFileSystem has been disabled by configuration"
READ_ONLY_LEDGER = 'on database "ledger" which is attached in read-only mode'
READ_ONLY_FILES = "ReadOnlyFileRefused: .*read-only here"


@pytest.fixture(scope="module")
def billed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = simulate_small(tmp_path_factory.mktemp("readers") / "run")
    with dg.DagsterInstance.ephemeral() as instance:
        assert all(r.success for r in bill(data, small_pools(), instance))
    owed = alerts.Alert(
        raised_at=datetime(2026, 12, 1, tzinfo=UTC),
        severity="ERROR",
        kind="money",
        hour=SIMULATED_HOUR,
        pool="chat-8b",
        replica=None,
        finding="unbalanced",
        detail="owed to on-call",
        dedup_key="stepledger-owed",
    )
    with connect(data / STATE_FILE) as con:
        assert alerts.enqueue(con, [owed]) == 1
    return data


def files_of(data: Path) -> dict[str, str]:
    """Every file under `data` by relative path, with the SHA-256 of its bytes."""
    return {
        str(path.relative_to(data)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(data.rglob("*"))
        if path.is_file()
    }


def a_data_file(data: Path) -> Path:
    return sorted((data / "warehouse" / "data").rglob("*.parquet"))[0]


# (statements that succeed first, the statement that must fail, DuckDB's error class, message)
ESCAPES = {
    "reattach the catalog writable after detaching the ledger": (
        ["USE memory", "DETACH ledger"],
        "ATTACH 'ducklake:sqlite:{data}/warehouse/catalog.sqlite' AS w "
        "(DATA_PATH '{data}/warehouse/data')",
        duckdb.PermissionException,
        LOCAL_FILES_OFF,
    ),
    "attach the pipeline's state file": (
        [],
        "ATTACH '{data}/pipeline.duckdb' AS st",
        duckdb.PermissionException,
        LOCAL_FILES_OFF,
    ),
    "attach a new database file to create tables in": (
        ["USE memory"],
        "ATTACH '{data}/scratch.duckdb' AS scratch",
        duckdb.PermissionException,
        LOCAL_FILES_OFF,
    ),
    "attach a database file among the data files": (
        [],
        f"ATTACH '{PROTOCOL}://{{data}}/warehouse/data/scratch.duckdb' AS scratch",
        duckdb.PermissionException,
        LOCAL_FILES_OFF,
    ),
    "copy over the pools file": (
        [],
        "COPY (SELECT 'price: 0' AS line) TO '{data}/pools.yaml'",
        duckdb.PermissionException,
        LOCAL_FILES_OFF,
    ),
    "copy over the catalog in place": (
        [],
        "COPY (SELECT 1 AS one) TO '{data}/warehouse/catalog.sqlite' (USE_TMP_FILE false)",
        duckdb.PermissionException,
        LOCAL_FILES_OFF,
    ),
    "copy over a published data file": (
        [],
        f"COPY (SELECT 1 AS one) TO '{PROTOCOL}://{{data_file}}' (FORMAT parquet)",
        duckdb.Error,
        READ_ONLY_FILES,
    ),
    "write files from the memory database": (
        ["USE memory", "CREATE TABLE mine AS SELECT 1 AS one"],
        "COPY mine TO '{data}/mine.csv'",
        duckdb.PermissionException,
        LOCAL_FILES_OFF,
    ),
    "export the database": (
        [],
        "EXPORT DATABASE '{data}/export'",
        duckdb.PermissionException,
        LOCAL_FILES_OFF,
    ),
    "export the database among the data files": (
        [],
        f"EXPORT DATABASE '{PROTOCOL}://{{data}}/warehouse/data/export'",
        duckdb.Error,
        READ_ONLY_FILES,
    ),
    "update a published invoice": (
        [],
        "UPDATE invoices SET amount_nano = amount_nano // 2",
        duckdb.InvalidInputException,
        READ_ONLY_LEDGER,
    ),
    "delete ledger lines": (
        [],
        "DELETE FROM ledger_lines",
        duckdb.InvalidInputException,
        READ_ONLY_LEDGER,
    ),
    "insert ledger lines": (
        [],
        "INSERT INTO ledger_lines SELECT * FROM ledger_lines",
        duckdb.InvalidInputException,
        READ_ONLY_LEDGER,
    ),
    "create a table in the ledger": (
        [],
        "CREATE TABLE ledger.main.stolen AS SELECT * FROM request_costs",
        duckdb.InvalidInputException,
        READ_ONLY_LEDGER,
    ),
    "drop a ledger table": (
        [],
        "DROP TABLE invoices",
        duckdb.InvalidInputException,
        READ_ONLY_LEDGER,
    ),
    "rewrite the catalog through its own attachment": (
        [],
        "UPDATE __ducklake_metadata_ledger.ducklake_data_file SET path = 'elsewhere.parquet'",
        duckdb.InvalidInputException,
        'on database "__ducklake_metadata_ledger" which is attached in read-only mode',
    ),
    "expire the ledger's snapshots": (
        [],
        "CALL ducklake_expire_snapshots('ledger', older_than => now())",
        duckdb.InvalidInputException,
        "Failed to delete snapshots",
    ),
    # DuckLake's CHECKPOINT runs all its maintenance: flushing inlined rows to new data files,
    # merging files, expiring snapshots, deleting old files.
    "rewrite the data files in maintenance": (
        [],
        "CHECKPOINT ledger",
        duckdb.Error,
        READ_ONLY_FILES,
    ),
    "create a persistent secret": (
        [],
        "CREATE PERSISTENT SECRET kept (TYPE ducklake, METADATA_PATH '{data}/other.sqlite')",
        duckdb.InvalidInputException,
        "Persistent secrets are disabled",
    ),
    "install an extension": (
        [],
        "INSTALL httpfs",
        duckdb.PermissionException,
        LOCAL_FILES_OFF,
    ),
    "load an extension": (
        [],
        "LOAD httpfs",
        duckdb.PermissionException,
        "Loading external extensions is disabled",
    ),
    "load a file as an extension": (
        [],
        "LOAD '{data_file}'",
        duckdb.PermissionException,
        "Loading external extensions is disabled",
    ),
    "turn external access back on": (
        [],
        "SET enable_external_access = true",
        duckdb.InvalidInputException,
        LOCKED,
    ),
    "unlock the configuration": (
        [],
        "RESET lock_configuration",
        duckdb.InvalidInputException,
        LOCKED,
    ),
    "enable the local file system": (
        [],
        "SET disabled_filesystems = ''",
        duckdb.InvalidInputException,
        LOCKED,
    ),
    "allow the data directory": (
        [],
        "SET allowed_directories = ['{data}']",
        duckdb.InvalidInputException,
        LOCKED,
    ),
    "profile into a file": (
        [],
        "PRAGMA profiling_output = '{data}/pools.yaml'",
        duckdb.InvalidInputException,
        LOCKED,
    ),
    "log queries into a file": (
        [],
        "SET log_query_path = '{data}/pools.yaml'",
        duckdb.InvalidInputException,
        LOCKED,
    ),
    "spill into the data directory": (
        [],
        "SET temp_directory = '{data}'",
        duckdb.InvalidInputException,
        LOCKED,
    ),
    "log into a file": (
        [],
        "CALL enable_logging(storage = 'file', storage_path = '{data}/log')",
        duckdb.Error,
        "Can not enable file logging with the LocalFileSystem disabled",
    ),
}


def filled(statement: str, data: Path) -> str:
    return statement.format(data=data, data_file=a_data_file(data))


@pytest.mark.parametrize(("before", "statement", "kind", "message"), ESCAPES.values(), ids=ESCAPES)
def test_a_finance_connection_cannot_write(billed: Path, before, statement, kind, message) -> None:
    files = files_of(billed)
    with finance.connect(billed) as con:
        for setup in before:
            con.execute(filled(setup, billed))
        with pytest.raises(kind, match=message) as raised:
            con.execute(filled(statement, billed))
    assert type(raised.value) is kind
    assert files_of(billed) == files
    with finance.connect(billed) as con:
        assert con.execute("SELECT count(*) FROM ledger_lines").fetchall()[0][0] > 0


# The escapes as a finance user typed them into `stepledger sql`.
SESSIONS = {
    "change a published invoice": (
        "USE memory; DETACH ledger; "
        "ATTACH 'ducklake:sqlite:{data}/warehouse/catalog.sqlite' AS w "
        "(DATA_PATH '{data}/warehouse/data'); UPDATE w.invoices SET amount_nano = 0;",
        "Permission Error: " + LOCAL_FILES_OFF,
    ),
    "delete owed pages": (
        "ATTACH '{data}/pipeline.duckdb' AS st; DELETE FROM st.alert_outbox;",
        "Permission Error: " + LOCAL_FILES_OFF,
    ),
    "rewrite the price list": (
        "COPY (SELECT 'price: 0' AS line) TO '{data}/pools.yaml' (HEADER false);",
        "Permission Error: " + LOCAL_FILES_OFF,
    ),
}


@pytest.mark.parametrize(("session", "message"), SESSIONS.values(), ids=SESSIONS)
def test_stepledger_sql_cannot_write(billed: Path, session: str, message: str) -> None:
    files = files_of(billed)
    result = CliRunner().invoke(
        main, ["sql", "--data", str(billed)], input=filled(session, billed).replace("; ", ";\n")
    )
    assert result.exit_code == 1
    assert message in result.output
    assert files_of(billed) == files


def test_what_a_reader_may_still_do_touches_nothing_on_disk(billed: Path) -> None:
    """Its own scratch tables in memory, the zone times are shown in, the lake read in place;
    and, detached from the ledger, nothing at all."""
    files = files_of(billed)
    with finance.connect(billed) as con:
        con.execute("SET TimeZone = 'UTC'")
        steps = con.execute("SELECT count(*) FROM lake('steps')").fetchall()[0][0]
        assert steps > 0
        con.execute("CREATE TEMP TABLE mine AS SELECT * FROM invoices")
        con.execute("USE memory")
        con.execute("DETACH ledger")
        with pytest.raises(duckdb.PermissionException, match=LOCAL_FILES_OFF):
            con.execute(f"ATTACH 'ducklake:sqlite:{billed}/warehouse/catalog.sqlite' AS ledger")
    assert files_of(billed) == files
