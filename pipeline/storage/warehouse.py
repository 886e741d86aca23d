"""The warehouse and the pipeline's own state: connections, schemas, exact replacement of an hour.

The ledger (invoices, ledger lines, request costs, reconciliation, alerts, re-runs) lives in a
DuckLake: Parquet data files under `<dir>/warehouse/data/` and a catalog, the SQLite file
`<dir>/warehouse/catalog.sqlite` by default, or tables in PostgreSQL (schema `ducklake`). Every committed transaction is a snapshot, so a finance
session reads one snapshot while the pipeline commits the next, and neither waits for the
other. The pipeline's bookkeeping (segment and gateway files seen, ingest batches, request
context, the alert outbox) stays in its own store, which finance never opens: by default the
embedded DuckDB file `<dir>/pipeline.duckdb` (one writing process at a time); with
`STEPLEDGER_POSTGRES` set (a libpq connection string), a PostgreSQL database that holds the
state tables and the DuckLake catalog, where any number of processes write side by side, each
transaction locking only the rows it writes. The SQL is DuckDB's either way: DuckDB's postgres
extension runs it against PostgreSQL in PostgreSQL transactions.

A writing connection is a connection to the state file with the warehouse attached as
`ledger` and both on the search path, so unqualified table names reach either (a step that
works on the state alone leaves the warehouse out). One transaction writes to one of the two
(DuckDB commits a transaction to one database).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import duckdb
import polars as pl

from pipeline.storage.data_files import (
    DATA_FILES_DIR,
    DataFiles,
    data_files_at,
    reader_data_files,
    writer_data_files,
    writer_secret_sql,
)
from pipeline.storage.read_only_files import PublishedFile, ReadOnlyFiles
from schemas.errors import StateError
from schemas.units import from_warehouse, hour_key, to_warehouse, warehouse_now

SQL_DIR = Path(__file__).resolve().parents[2] / "sql"
SCHEMA_SQL = SQL_DIR / "schema.sql"
STATE_SQL = SQL_DIR / "pipeline_state.sql"
VIEWS_SQL = SQL_DIR / "views.sql"

STATE_FILE = "pipeline.duckdb"
WAREHOUSE_DIR = "warehouse"
CATALOG_FILE = "catalog.sqlite"
# A warehouse whose catalog is in PostgreSQL holds, instead of the SQLite file, this JSON file:
# how finance's readers connect to the catalog (host, port, database, and a role that can
# only SELECT: `create_reader_role`).
CATALOG_POINTER = "catalog.postgres.json"
# The PostgreSQL schema of the DuckLake catalog's tables, beside the state tables in `public`.
CATALOG_SCHEMA = "ducklake"
POSTGRES_ENV = "STEPLEDGER_POSTGRES"
STATE = "state"
LAKE_DIR = "lake"
# The single DuckDB file that held ledger and bookkeeping together (schema version 1).
PREVIOUS_LAYOUT_FILE = "warehouse.duckdb"
# 1: one DuckDB file; 2: the DuckLake warehouse and pipeline.duckdb; 3: version 2 and the
# tables of provisional costs, closed-month adjustments and published digests.
SCHEMA_VERSION = 3
# Versions a writing connection brings to SCHEMA_VERSION in place: they lack tables only, which
# schema.sql's CREATE TABLE IF NOT EXISTS adds.
ADDITIVE_FROM = {2}
LEDGER = "ledger"

# The tables one pool-hour of attribution writes; replaced together, in one transaction.
HOUR_TABLES = ("invoices", "ledger_lines", "request_costs")
# What DuckLake cannot enforce as CHECK constraints, refused here.
LINE_KINDS = ("usage", "idle", "headroom", "unattributed", "platform_retry", "cache_credit")
SEVERITIES = ("ERROR", "WARN")


class WarehouseError(StateError):
    """The warehouse is missing, of another layout, or a write does not match a table."""


def warehouse_dir(data_dir: str | Path) -> Path:
    """The DuckLake warehouse of a data directory."""
    return Path(data_dir) / WAREHOUSE_DIR


def _quoted(text: str | Path) -> str:
    return "'" + str(text).replace("'", "''") + "'"


def extension_file(name: str) -> Path:
    """The installed file of DuckDB extension `name`. The extensions come as Python packages
    (duckdb-extension-<name>), so a machine without network loads them from the virtualenv,
    and their version always matches duckdb's."""
    package = importlib.import_module(f"duckdb_extension_{name}")
    path = (
        Path(package.__file__ or "").parent
        / "extensions"
        / f"v{duckdb.__version__}"
        / f"{name}.duckdb_extension"
    )
    if not path.is_file():
        raise WarehouseError(
            f"{path}: no {name} extension for duckdb {duckdb.__version__}; install "
            f"duckdb-extension-{name.replace('_', '-')}=={duckdb.__version__}"
        )
    return path


# DuckDB checks an extension's signature (a SHA-256 over its 33 MiB) on every LOAD: 0.13 CPU-s
# per extension, half the cost of opening the warehouse, which the pipeline does a few times
# per pool-hour. The pipeline's writing connection (to its state file) is created with this
# configuration, so its LOAD skips the check, and load_extensions checks each file once per
# process instead. Finance's connections keep DuckDB's default: `stepledger sql` runs the
# user's SQL, which must not LOAD unsigned code.
WRITER_CONFIG: dict[str, str | bool | int | float | list[str]] = {"allow_unsigned_extensions": True}

# A finance connection runs whatever SQL its reader types, so it is built unable to write
# (docs/warehouse.md, "Readers cannot write"). These hold from its start: no secret written to
# disk (DuckDB refuses to change this once a secret was looked up, which ATTACH does), no
# extension installed or loaded behind a query's back. `_seal` closes the rest once the
# warehouse is attached.
READER_CONFIG: dict[str, str | bool | int | float | list[str]] = {
    # A reader's files come through a Python file system (ReadOnlyFiles). DuckDB's worker
    # threads call it needing the GIL, which the thread that fetches a result may hold while
    # it waits for them: the query then spins for good (duckdb/duckdb#16501; seen here as a
    # report that never finished, now and then). One thread does every read itself.
    "threads": 1,
    "allow_persistent_secrets": False,
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "allow_community_extensions": False,
}
# What a reader may still SET: the zone timestamps are shown in (FOCUS exports in UTC).
READER_SETTABLE = ["TimeZone"]


@functools.cache
def _check_signature(path: Path, size: int, mtime_ns: int) -> None:
    """LOAD the file where DuckDB verifies its signature (raises if it does not verify); cached
    per file version, so a replaced extension file is checked again."""
    with duckdb.connect() as checking:
        checking.execute(f"LOAD {_quoted(path)}")


def load_extensions(
    con: duckdb.DuckDBPyConnection, catalog: str = "sqlite_scanner", *more: str
) -> None:
    """Load DuckLake and its catalog's database support (`sqlite_scanner` or
    `postgres_scanner`), and the extensions `more`, from the installed packages, each file's
    signature verified (once per process, see WRITER_CONFIG)."""
    for name in (catalog, "ducklake", *more):
        path = extension_file(name)
        version = path.stat()
        _check_signature(path, version.st_size, version.st_mtime_ns)
        con.execute(f"LOAD {_quoted(path)}")


def attach_warehouse(
    con: duckdb.DuckDBPyConnection,
    directory: Path,
    *,
    read_only: bool,
    as_of: datetime | int | None = None,
    data_path: str | None = None,
    postgres: str | None = None,
) -> None:
    """Attach the DuckLake in `directory` as `ledger`: read-only, or for writing (created if
    missing); `as_of` a snapshot id or a time (the last snapshot at or before it); `data_path`
    where its data files are read (a reader's; a writer's are where `writer_data_files` says:
    `directory`/data, or a store). Its catalog is the SQLite file in `directory`, or in
    PostgreSQL: `postgres` (the writer's connection string), or for a reader the connection
    `directory`'s CATALOG_POINTER names."""
    # The catalog stores the data path it was created with; a data directory moved or restored
    # elsewhere must still find its files, so the path is always given and overrides it.
    if data_path is None:
        data_path = _writer_data_path(con, directory)
    options = [f"DATA_PATH {_quoted(data_path)}", "OVERRIDE_DATA_PATH true"]
    if read_only:
        options.append("READ_ONLY")
    if isinstance(as_of, datetime):
        if as_of.tzinfo is None:
            raise WarehouseError(f"as of {as_of.isoformat()}: give a time zone (e.g. +00:00)")
        options.append(f"SNAPSHOT_TIME {_quoted(as_of.astimezone(UTC).isoformat())}")
    elif as_of is not None:
        options.append(f"SNAPSHOT_VERSION {int(as_of)}")
    catalog = _catalog_location(con, directory, postgres, options)
    try:
        con.execute(f"ATTACH {_quoted(catalog)} AS {LEDGER} ({', '.join(options)})")
    except duckdb.Error as err:
        if as_of is None:
            raise
        raise WarehouseError(f"{directory}: no snapshot as of {as_of} ({err})") from err


def _writer_data_path(con: duckdb.DuckDBPyConnection, directory: Path) -> str:
    """The data path a writer attaches the warehouse in `directory` with; on a store, httpfs
    loaded and given the writer's keys as a temporary secret (in memory only)."""
    local = directory / DATA_FILES_DIR
    existing = has_catalog(directory) or (local.is_dir() and any(local.iterdir()))
    data = writer_data_files(directory, existing)
    if not data.on_store:
        return data.uri
    load_extensions(con, "sqlite_scanner", "httpfs")
    try:
        con.execute(writer_secret_sql(f"{LEDGER}_store"))
    except duckdb.Error as err:
        # DuckDB's message may quote the statement, which holds the keys.
        raise WarehouseError(
            f"{data.uri}: DuckDB refused the store's credentials ({type(err).__name__})"
        ) from None
    return data.uri + "/"


def _catalog_location(
    con: duckdb.DuckDBPyConnection, directory: Path, postgres: str | None, options: list[str]
) -> str:
    """What to ATTACH for the catalog of the warehouse in `directory`, the extensions it needs
    loaded and its options added. A reader of a PostgreSQL catalog connects through a temporary
    secret: the connection string of an ATTACH would be looked up among persistent secrets,
    which a reader's connection refuses to use (READER_CONFIG)."""
    pointer = directory / CATALOG_POINTER
    if postgres is None and not pointer.is_file():
        load_extensions(con)
        return "ducklake:sqlite:" + str(directory / CATALOG_FILE)
    load_extensions(con, "postgres_scanner")
    options.append(f"METADATA_SCHEMA {_quoted(CATALOG_SCHEMA)}")
    if postgres is not None:
        return "ducklake:postgres:" + postgres
    reader = json.loads(pointer.read_text())
    fields = ", ".join(
        f"{key.upper()} {_quoted(reader[key])}"
        for key in ("host", "port", "database", "user", "password")
    )
    con.execute(f"CREATE TEMPORARY SECRET {LEDGER}_catalog (TYPE postgres, {fields})")
    options.append(f"META_SECRET {_quoted(LEDGER + '_catalog')}")
    return "ducklake:postgres:"


def lake_dir(directory: Path) -> Path:
    """The Parquet lake beside the warehouse in `directory`."""
    return directory.parent / LAKE_DIR


def _schema_versions(con: duckdb.DuckDBPyConnection) -> set[int]:
    return {
        row[0] for row in con.execute(f"SELECT version FROM {LEDGER}.schema_version").fetchall()
    }


def _check_version(con: duckdb.DuckDBPyConnection, directory: Path) -> None:
    versions = _schema_versions(con)
    if versions == {SCHEMA_VERSION}:
        return
    upgrade = ""
    if versions <= ADDITIVE_FROM:
        upgrade = (
            f"; the next billing run, or `stepledger migrate --data {directory.parent}`, "
            f"upgrades it in place (version {SCHEMA_VERSION} adds tables only)"
        )
    raise WarehouseError(
        f"{directory}: warehouse schema version {sorted(versions)}, this stepledger "
        f"reads version {SCHEMA_VERSION}{upgrade}"
    )


def _refuse_previous_layout(con: duckdb.DuckDBPyConnection, state_file: Path) -> None:
    previous = state_file.parent / PREVIOUS_LAYOUT_FILE
    holds_ledger = con.execute(
        "SELECT count(*) FROM duckdb_tables() "
        "WHERE database_name = current_database() AND table_name = 'invoices'"
    ).fetchall()[0][0]
    if holds_ledger or (previous != state_file and previous.is_file()):
        file = state_file if holds_ledger else previous
        raise WarehouseError(
            f"{file}: a warehouse of the previous single-file layout (schema version 1); "
            f"run `stepledger migrate --data {file.parent}` to move it to the DuckLake "
            f"warehouse (schema version {SCHEMA_VERSION})"
        )


def apply_schema(
    con: duckdb.DuckDBPyConnection,
    *,
    migrating: bool = False,
    postgres: str | None = None,
    directory: Path | None = None,
    ledger: bool = True,
    views: bool = True,
) -> None:
    """Make a connection to the pipeline's state a writing connection: its tables created
    (if missing); with `ledger`, the warehouse attached (created if missing) with its tables,
    both on the search path, and with `views` the finance views defined for this connection.
    Safe on every open, and cheap once the state and the warehouse record the sha256 of this
    release's DDL (`_apply_state_sql`, `_apply_warehouse_sql`).

    The state is the connection's own DuckDB file, or with `postgres` the PostgreSQL database
    attached as `state` (`open_state`), whose warehouse keeps its catalog in the same database
    and its data files in `directory`."""
    if postgres is not None:
        if directory is None:
            raise WarehouseError("a PostgreSQL store needs the warehouse directory of its files")
        state_db, state_schema = STATE, "public"
        con.execute(f"USE {STATE}")
    else:
        attached = con.execute(
            "SELECT database_name, path FROM duckdb_databases() "
            "WHERE database_name = current_database()"
        ).fetchall()
        state_db, path = attached[0]
        if path is None:
            raise WarehouseError(
                "the pipeline's state needs a DuckDB file, not an in-memory database"
            )
        state_file = Path(path).resolve()
        if not migrating:
            _refuse_previous_layout(con, state_file)
        state_schema = "main"
        directory = warehouse_dir(state_file.parent)
    _apply_state_sql(con)
    if not ledger:
        # The state alone: a query of the warehouse's tables fails, naming the table.
        con.execute(f"SET search_path = {_quoted(f'{state_db}.{state_schema}')}")
        return
    if not con.execute(
        "SELECT count(*) FROM duckdb_databases() WHERE database_name = ?", [LEDGER]
    ).fetchall()[0][0]:
        (directory / DATA_FILES_DIR).mkdir(parents=True, exist_ok=True)
        attach_warehouse(con, directory, read_only=False, postgres=postgres)
    recorded = _recorded_schema(con)
    if recorded != {(SCHEMA_VERSION, _sql_sha256(SCHEMA_SQL))}:
        # A warehouse of another version than these is refused as it is.
        if {version for version, _ in recorded} <= {SCHEMA_VERSION, *ADDITIVE_FROM}:
            con.execute(f"USE {LEDGER}")
            try:
                _apply_warehouse_sql(con)
            finally:
                con.execute(f"USE {_identifier(state_db)}")
        _check_version(con, directory)
    con.execute(f"SET search_path = {_quoted(f'{state_db}.{state_schema},{LEDGER}.main')}")
    if views:
        _define_views(con)


def _sql_sha256(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


def _apply_state_sql(con: duckdb.DuckDBPyConnection) -> None:
    """Create the state's tables and views unless it records that this STATE_SQL made them."""
    sha256 = _sql_sha256(STATE_SQL)
    try:
        recorded = con.execute("SELECT sha256 FROM state_schema").fetchall()
    except duckdb.CatalogException:
        recorded = []
    if recorded == [(sha256,)]:
        return
    with transaction(con):
        con.execute(STATE_SQL.read_text())
        con.execute("DELETE FROM state_schema")
        con.execute("INSERT INTO state_schema VALUES (?, now()::TIMESTAMP)", [sha256])


def _recorded_schema(con: duckdb.DuckDBPyConnection) -> set[tuple[int, str | None]]:
    """(version, schema_sha256) of each row of the attached warehouse's schema_version: none
    for a new warehouse, the sha256 None for one written before it was recorded."""
    try:
        return set(
            con.execute(f"SELECT version, schema_sha256 FROM {LEDGER}.schema_version").fetchall()
        )
    except duckdb.CatalogException:
        return set()
    except duckdb.BinderException:
        return {(version, None) for version in _schema_versions(con)}


def _apply_warehouse_sql(con: duckdb.DuckDBPyConnection) -> None:
    """Create the warehouse's tables (connection on the warehouse, `USE ledger`) and record
    the version and SCHEMA_SQL's sha256, in one transaction: one snapshot, where a statement
    each would commit one apiece (0.08 s against 1 s for a new warehouse). A warehouse of an
    ADDITIVE_FROM version is brought to SCHEMA_VERSION."""
    sha256 = _sql_sha256(SCHEMA_SQL)
    with transaction(con):
        con.execute(SCHEMA_SQL.read_text())
        versions = {row[0] for row in con.execute("SELECT version FROM schema_version").fetchall()}
        if not versions:
            con.execute(
                "INSERT INTO schema_version VALUES (?, now()::TIMESTAMP, ?)",
                [SCHEMA_VERSION, sha256],
            )
        elif versions <= ADDITIVE_FROM:
            con.execute(
                "UPDATE schema_version SET version = ?, applied_at = now()::TIMESTAMP, "
                "schema_sha256 = ?",
                [SCHEMA_VERSION, sha256],
            )
        else:
            con.execute("UPDATE schema_version SET schema_sha256 = ?", [sha256])


def _identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _define_views(con: duckdb.DuckDBPyConnection) -> None:
    # The views and macros are temporary, the connection's own: the warehouse holds data
    # only, and a reader's views read the snapshot it attached.
    con.execute(VIEWS_SQL.read_text())


def postgres_from_env() -> str | None:
    """The PostgreSQL database of the pipeline's state and catalog (STEPLEDGER_POSTGRES, a
    libpq connection string whose password may come from PGPASSWORD), or None: embedded."""
    return os.environ.get(POSTGRES_ENV) or None


def open_state(
    path: Path,
    postgres: str | None,
    open_file: Callable[[Path], duckdb.DuckDBPyConnection],
    *,
    ledger: bool = True,
    views: bool = True,
) -> duckdb.DuckDBPyConnection:
    """A writing connection (`apply_schema`) to the pipeline's state: the DuckDB file `path`
    opened by `open_file`, or with `postgres` that database (then no file is opened: `path`
    only places the warehouse's data files, in the warehouse directory beside it); with
    `ledger` the warehouse attached, and with `views` the finance views defined on it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    con = (
        _open_state_file(path, open_file)
        if postgres is None
        else duckdb.connect(config=WRITER_CONFIG)
    )
    try:
        if postgres is not None:
            load_extensions(con, "postgres_scanner")
            con.execute(f"ATTACH {_quoted(postgres)} AS {STATE} (TYPE postgres)")
        # Processes opening the PostgreSQL store at once create its tables and views at once.
        retry_conflicts(
            lambda: apply_schema(
                con,
                postgres=postgres,
                directory=warehouse_dir(path.resolve().parent),
                ledger=ledger,
                views=views,
            ),
            "the pipeline state's schema",
        )
    except BaseException:
        con.close()
        raise
    return con


def _open_state_file(
    path: Path, open_file: Callable[[Path], duckdb.DuckDBPyConnection]
) -> duckdb.DuckDBPyConnection:
    """`open_file(path)`. Creating the file on a full disk fails with the file created but
    empty, which DuckDB refuses as no database once there is room again: an empty file this
    open created is removed when it fails (one that was there before is left as it was)."""
    existed = path.exists()
    try:
        return open_file(path)
    except BaseException:
        if not existed and path.is_file() and path.stat().st_size == 0:
            path.unlink(missing_ok=True)
        raise


@contextmanager
def connect(
    path: str | Path, *, postgres: str | None = None
) -> Iterator[duckdb.DuckDBPyConnection]:
    """A writing connection (`open_state`) to the pipeline's state file `path`, or to the
    PostgreSQL store `postgres`; closed on exit."""
    con = open_state(
        Path(path), postgres, lambda file: duckdb.connect(str(file), config=WRITER_CONFIG)
    )
    try:
        yield con
    finally:
        con.close()


FINANCE_ROLE = "stepledger_finance"


def create_reader_role(
    con: duckdb.DuckDBPyConnection, directory: Path, password: str, role: str = FINANCE_ROLE
) -> Path:
    """Give finance's readers of a PostgreSQL catalog a role of their own that can only SELECT
    the catalog's tables (those DuckLake adds later too), never the pipeline's state, with
    every transaction read-only; and write the CATALOG_POINTER of the warehouse in
    `directory`, which
    `pipeline.finance.connect` connects with. `con`: a writing connection to the PostgreSQL
    store (`open_state`), whose role owns the catalog. Safe to repeat (a new password
    replaces the old). Returns the pointer file."""
    role_name = _identifier(role)
    secret = "'" + password.replace("'", "''") + "'"
    server = con.execute(
        f"SELECT * FROM postgres_query({_quoted(STATE)}, 'SELECT host(inet_server_addr()), "
        "inet_server_port(), current_database()')"
    ).fetchall()[0]
    host, port, database = server
    statements = [
        f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = {_quoted(role)}) "
        f"THEN CREATE ROLE {role_name}; END IF; END $$",
        f"ALTER ROLE {role_name} LOGIN PASSWORD {secret} NOSUPERUSER NOCREATEDB NOCREATEROLE",
        f"ALTER ROLE {role_name} SET default_transaction_read_only = on",
        f"GRANT CONNECT ON DATABASE {_identifier(database)} TO {role_name}",
        f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {role_name}",
        f"GRANT USAGE ON SCHEMA {CATALOG_SCHEMA} TO {role_name}",
        f"GRANT SELECT ON ALL TABLES IN SCHEMA {CATALOG_SCHEMA} TO {role_name}",
        f"ALTER DEFAULT PRIVILEGES IN SCHEMA {CATALOG_SCHEMA} GRANT SELECT ON TABLES TO {role_name}",
    ]
    for statement in statements:
        con.execute(f"CALL postgres_execute({_quoted(STATE)}, {_quoted(statement)})")
    pointer = directory / CATALOG_POINTER
    pointer.write_text(
        json.dumps(
            {
                "host": host,
                "port": str(port),
                "database": database,
                "user": role,
                "password": password,
            },
            indent=2,
        )
    )
    return pointer


# The tables of the previous layout that belong to the warehouse; the rest are bookkeeping.
# Columns of the previous layout that have another name now: (table, old name) -> new name.
RENAMED_COLUMNS = {("alerts", "dedupe_key"): "dedup_key"}
LEDGER_TABLES = ("invoices", "ledger_lines", "request_costs", "reconciliation", "alerts")


def migrate_previous_layout(data_dir: str | Path) -> dict[str, int]:
    """Move `<data_dir>/warehouse.duckdb` (schema version 1) to the DuckLake warehouse and
    `pipeline.duckdb`: the ledger tables in one warehouse snapshot, the bookkeeping in the new
    state file, each table's row count and money checked equal; then the old file is renamed
    `warehouse.duckdb.migrated` (kept, never deleted). Returns the rows moved per table."""
    data_dir = Path(data_dir)
    previous = data_dir / PREVIOUS_LAYOUT_FILE
    state_file = data_dir / STATE_FILE
    directory = warehouse_dir(data_dir)
    if not previous.is_file():
        raise WarehouseError(f"{previous}: no warehouse of the previous layout to migrate")
    for made in (state_file, directory):
        if made.exists():
            raise WarehouseError(f"{made} exists: {previous} seems migrated already; move it aside")
    moved: dict[str, int] = {}
    try:
        with duckdb.connect(str(state_file)) as con:
            apply_schema(con, migrating=True)
            try:
                con.execute(f"ATTACH {_quoted(previous)} AS previous (READ_ONLY)")
            except duckdb.Error as err:
                raise WarehouseError(
                    f"{previous}: cannot be read by duckdb {duckdb.__version__} ({err}); "
                    "export it with the DuckDB that wrote it (EXPORT DATABASE) and import it "
                    f"into a duckdb {duckdb.__version__} file of the same name, then migrate"
                ) from err
            old_tables = {
                row[0]: row[1]
                for row in con.execute(
                    "SELECT table_name, list(column_name ORDER BY column_index) "
                    "FROM duckdb_columns() WHERE database_name = 'previous' AND table_name IN "
                    "(SELECT table_name FROM duckdb_tables() WHERE database_name = 'previous') "
                    "GROUP BY ALL"
                ).fetchall()
            }
            if "invoices" not in old_tables:
                raise WarehouseError(f"{previous}: no invoices table; not a stepledger warehouse")
            state_db = con.execute("SELECT current_database()").fetchall()[0][0]
            for ledger in (False, True):
                target = LEDGER if ledger else state_db
                with transaction(con):
                    for table, columns in sorted(old_tables.items()):
                        if (table in LEDGER_TABLES) != ledger:
                            continue
                        listed = ", ".join(f'"{c}"' for c in columns)
                        renamed = ", ".join(
                            f'"{RENAMED_COLUMNS.get((table, c), c)}"' for c in columns
                        )
                        con.execute(
                            f"INSERT INTO {_identifier(target)}.main.{table} ({renamed}) "
                            f"SELECT {listed} FROM previous.main.{table}"
                        )
                        moved[table] = _check_copied(con, table, target, columns)
                    if ledger:
                        commit_message(con, f"migrated from {previous}", rows=moved)
    except BaseException:
        state_file.unlink(missing_ok=True)
        shutil.rmtree(directory, ignore_errors=True)
        raise
    previous.rename(previous.with_name(previous.name + ".migrated"))
    return moved


def _check_copied(
    con: duckdb.DuckDBPyConnection, table: str, target: str, columns: list[str]
) -> int:
    measure = "count(*), sum(amount_nano)" if "amount_nano" in columns else "count(*), 0"
    old, new = (
        con.execute(f"SELECT {measure} FROM {source}.main.{table}").fetchall()[0]
        for source in ("previous", _identifier(target))
    )
    if old != new:
        raise WarehouseError(f"migrating {table}: {old} rows/money before, {new} after")
    return int(old[0])


def read_connection(
    directory: str | Path, *, as_of: datetime | int | None = None
) -> duckdb.DuckDBPyConnection:
    """A read-only connection to the warehouse in `directory` (the latest snapshot, or the one
    `as_of` a time or snapshot id), with the finance views; it never opens the pipeline's
    state file, so it never blocks the pipeline."""
    directory = Path(directory)
    _require_warehouse(directory)
    data = reader_data_files(directory)
    return _warehouse_connection(
        directory, files=_reader_files(directory, data), data=data, as_of=as_of
    )


def _require_warehouse(directory: Path) -> None:
    if not has_catalog(directory):
        previous = directory.parent / PREVIOUS_LAYOUT_FILE
        how = (
            f"{previous} is of the previous layout: run `stepledger migrate --data {directory.parent}`"
            if previous.is_file()
            else "run `stepledger demo` or `stepledger run` first"
        )
        raise WarehouseError(f"{directory / CATALOG_FILE}: no warehouse ({how})")


# A snapshot-verified read commits nothing, so it only repeats while the pipeline commits
# during it: at most every few seconds (the live path's cycle) against milliseconds of query.
SNAPSHOT_READ_ATTEMPTS = 5


class SnapshotReader:
    """A finance connection held open while the warehouse commits snapshot after snapshot, for a
    server that answers from it: each read is of one snapshot whose published data files are
    the ones verified. A plain finance connection verifies the files published when it was
    opened; a file published later would be read unverified by a connection kept open."""

    def __init__(self, directory: Path) -> None:
        _require_warehouse(directory)
        self._directory = directory
        self._data = reader_data_files(directory)
        self._files = _reader_files(directory, self._data)
        self.con = _warehouse_connection(directory, files=self._files, data=self._data)
        # Which snapshot opening verified is not known: the first read verifies again.
        self._verified: int | None = None

    def read(self, query: Callable[[duckdb.DuckDBPyConnection], Result]) -> tuple[int, Result]:
        """`query`'s result and the snapshot it read, with that snapshot's published files
        verified. Snapshot ids only grow: the same id before and after the query is the one the
        query read; a snapshot committed meanwhile is verified and the query run again."""
        for _ in range(SNAPSHOT_READ_ATTEMPTS):
            before = current_snapshot(self.con)
            if before != self._verified:
                # Of `before` unless a snapshot was committed since; then the check after
                # the query fails, and the next attempt's `before` is newer and verified anew.
                self._files.verify_published(self._data, published_files(self.con))
                self._verified = before
            result = query(self.con)
            if current_snapshot(self.con) == before:
                return before, result
        raise WarehouseError(
            f"{self._directory}: a new snapshot was committed during each of "
            f"{SNAPSHOT_READ_ATTEMPTS} reads in a row"
        )

    def close(self) -> None:
        self.con.close()


def ledger_writer(directory: str | Path) -> duckdb.DuckDBPyConnection:
    """A writing connection to the warehouse alone (not the pipeline's state file), for
    finance's own writes such as closing a month; DuckLake commits it beside a running
    pipeline."""
    directory = Path(directory)
    if not has_catalog(directory):
        raise WarehouseError(f"{directory / CATALOG_FILE}: no warehouse")
    return _warehouse_connection(directory, files=None, postgres=postgres_from_env())


def has_catalog(directory: Path) -> bool:
    """Whether `directory` is a warehouse: its SQLite catalog, or the pointer to its
    PostgreSQL one."""
    return (directory / CATALOG_FILE).is_file() or (directory / CATALOG_POINTER).is_file()


def _reader_files(directory: Path, data: DataFiles) -> ReadOnlyFiles:
    """The one way a reader's connection reaches files: the warehouse's data files `data` (in
    its directory or on a store) and the Parquet lake beside the warehouse, read-only."""
    if data.on_store:
        return ReadOnlyFiles(lake_dir(directory), store=data)
    return ReadOnlyFiles(Path(data.root), lake_dir(directory))


def _warehouse_connection(
    directory: Path,
    *,
    files: ReadOnlyFiles | None,
    data: DataFiles | None = None,
    as_of: datetime | int | None = None,
    postgres: str | None = None,
) -> duckdb.DuckDBPyConnection:
    """A connection whose default catalog is the warehouse in `directory`, with the finance
    views: read-only and sealed when given the `files` it reads through (the data files
    `data` among them), else writing. Being
    the default catalog, a write through a read-only connection is refused rather than
    landing in the connection's scratch memory."""
    con = duckdb.connect(config=READER_CONFIG if files else {})
    try:
        if files:
            con.register_filesystem(files)
        attach_warehouse(
            con,
            directory,
            read_only=files is not None,
            as_of=as_of,
            data_path=files.data_url(data) if files and data else None,
            postgres=postgres,
        )
        _check_version(con, directory)
        con.execute(f"USE {LEDGER}")
        _define_views(con)
        if files and data:
            files.verify_published(data, published_files(con))
            _seal(con, files, lake_dir(directory))
    except BaseException:
        con.close()
        raise
    return con


def published_files(con: duckdb.DuckDBPyConnection) -> dict[str, PublishedFile]:
    """Every data file of a published pool-hour in the snapshot `con` reads, by its path
    relative to the data directory (none in a warehouse published before they were kept)."""
    if not con.execute(
        "SELECT count(*) FROM duckdb_tables() "
        f"WHERE database_name = '{LEDGER}' AND table_name = 'published_files'"
    ).fetchall()[0][0]:
        return {}
    rows = con.execute(
        f"SELECT path, table_name, hour, pool, sha256 FROM {LEDGER}.published_files"
    ).fetchall()
    return {
        path: PublishedFile(path, table_name, from_warehouse(hour), pool, sha256)
        for path, table_name, hour, pool, sha256 in rows
    }


def _seal(con: duckdb.DuckDBPyConnection, files: ReadOnlyFiles, lake: Path) -> None:
    """Leave a reader's connection nothing to touch but the warehouse and the lake, read-only,
    for good; the lake readable as `FROM lake('steps')` (or slots, holders, inputs).

    With external access off, DuckDB attaches, copies to, exports to, reads and installs from
    no file, loads no extension and creates no persistent secret; but it still lets a query
    write wherever it may read (`allowed_directories`), and it may read the files of what is
    attached, the catalog among them, so `COPY ... TO` the catalog would overwrite it. Hence
    DuckDB's local file system is disabled as well: the only files left are those of
    `ReadOnlyFiles`. The SQLite catalog is opened by SQLite itself, read-only (the DuckLake is
    attached READ_ONLY, and so is its catalog). Locking the configuration last keeps every one
    of these settings, and every other, as it is (but READER_SETTABLE)."""
    con.execute(
        f"CREATE TEMP MACRO lake(kind) AS TABLE FROM read_parquet("
        f"{_quoted(files.pattern(lake))} || kind || '/*/*/*.parquet', hive_partitioning = true)"
    )
    # A glob pattern is allowed by its text: below a root named with a wildcard, it begins
    # with the root escaped (`files.pattern`).
    readable = ", ".join(_quoted(url) for url in files.readable_urls())
    con.execute(f"SET allowed_directories = [{readable}]")
    con.execute("SET enable_external_access = false")
    con.execute("SET disabled_filesystems = 'LocalFileSystem'")
    con.execute(f"SET allowed_configs = {READER_SETTABLE!r}")
    con.execute("SET lock_configuration = true")


@contextmanager
def connect_read_only(state_file: str | Path) -> Iterator[duckdb.DuckDBPyConnection]:
    """A read-only connection to the warehouse next to the pipeline's state file."""
    con = read_connection(warehouse_dir(Path(state_file).resolve().parent))
    try:
        yield con
    finally:
        con.close()


def data_files(con: duckdb.DuckDBPyConnection) -> DataFiles:
    """Where the warehouse attached to a writing connection keeps its data files: the data
    path it was attached with (the state may be a PostgreSQL database, which has no directory),
    a directory or a store's prefix."""
    (path,) = con.execute(f"SELECT data_path FROM ducklake_settings('{LEDGER}')").fetchall()[0]
    return data_files_at(path)


def current_snapshot(con: duckdb.DuckDBPyConnection) -> int:
    """The id of the warehouse snapshot the connection reads."""
    return int(con.execute(f"SELECT id FROM {LEDGER}.current_snapshot()").fetchall()[0][0])


def commit_message(con: duckdb.DuckDBPyConnection, message: str, **extra: object) -> None:
    con.execute(
        f"CALL {LEDGER}.set_commit_message('stepledger', ?, extra_info => ?)",
        [message, json.dumps(extra, default=str)],
    )


@contextmanager
def transaction(con: duckdb.DuckDBPyConnection) -> Iterator[duckdb.DuckDBPyConnection]:
    """Everything inside commits together or not at all."""
    con.execute("BEGIN TRANSACTION")
    try:
        yield con
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")


# What concurrent writers of the state and the warehouse report when their transactions meet:
# DuckLake refuses a commit that conflicts with one committed since it began (its conflict
# rules: a table inserted into while another transaction deleted from it, one file deleted from
# twice); PostgreSQL refuses a row another transaction inserted with the same key, and a
# definition (a table or view) created or replaced by two at once. The transaction rolled back
# whole, so it is run again; it then sees what the other committed.
CONFLICTS = (
    "Transaction conflict",
    "duplicate key value violates unique constraint",
    "could not serialize access",
    "tuple concurrently updated",
    "deadlock detected",
)
CONFLICT_ATTEMPTS = 10
FIRST_CONFLICT_WAIT_S = 0.05
Result = TypeVar("Result")


def retry_conflicts(work: Callable[[], Result], what: str) -> Result:
    """Run `work` (one or more whole transactions) until it commits without conflicting with a
    concurrent writer, waiting a random, doubling time between attempts so that writers who
    met do not meet again; other errors are raised at once."""
    for attempt in range(CONFLICT_ATTEMPTS):
        try:
            return work()
        except duckdb.Error as err:
            if not any(conflict in str(err) for conflict in CONFLICTS):
                raise
            last = err
        time.sleep(random.uniform(0, FIRST_CONFLICT_WAIT_S * 2**attempt))
    raise WarehouseError(
        f"{what}: still conflicting with concurrent writers after {CONFLICT_ATTEMPTS} "
        f"attempts ({last})"
    )


def _naive_hours(frame: pl.DataFrame) -> pl.DataFrame:
    dtype = frame.schema.get("hour")
    if isinstance(dtype, pl.Datetime) and dtype.time_zone is not None:
        return frame.with_columns(
            pl.col("hour").dt.convert_time_zone("UTC").dt.replace_time_zone(None)
        )
    return frame


def _rerun_reason(before: pl.DataFrame, after: pl.DataFrame) -> str:
    """Why an hour's ledger lines changed, from the lines themselves: the weights or policy
    versions they were priced with, the tokens the hour's steps computed (more when segments
    arrived late), the requests without gateway context (fewer when a gateway file did)."""
    reasons = []
    for column, what in (("weights_version", "weights"), ("policy_version", "policy")):
        old, new = (sorted(set(f[column].to_list())) for f in (before, after))
        if old != new:
            reasons.append(f"{what} {', '.join(old)} -> {', '.join(new)}")

    def total(frame: pl.DataFrame, column: str, kind: str | None = None) -> int:
        rows = frame if kind is None else frame.filter(pl.col("line_kind") == kind)
        return int(rows[column].sum())

    old_tokens, new_tokens = (total(f, "new_tokens") for f in (before, after))
    if old_tokens != new_tokens:
        reasons.append(f"tokens {old_tokens} -> {new_tokens} (new segments)")
    old_bare, new_bare = (total(f, "requests", "unattributed") for f in (before, after))
    if old_bare != new_bare:
        reasons.append(
            f"requests without gateway context {old_bare} -> {new_bare} (a late gateway file)"
        )
    return "; ".join(reasons) or "re-run with the same inputs"


def _tenant_totals(lines: pl.DataFrame, name: str) -> pl.DataFrame:
    return lines.group_by("tenant").agg(pl.col("amount_nano").sum().cast(pl.Int64).alias(name))


def replace_hour(
    con: duckdb.DuckDBPyConnection,
    hour: datetime,
    pool: str,
    tables: Mapping[str, pl.DataFrame],
    *,
    then: Callable[[duckdb.DuckDBPyConnection], None] | None = None,
) -> None:
    """Replace the (hour, pool) rows of each table with `tables[name]`, all in one transaction,
    which is one warehouse snapshot. The hour's reconciliation rows go too: the new charges
    are unchecked (held back from finance) until the hour is reconciled again.

    Rows are inserted by column name, so frames may list columns in any order; a frame whose
    rows belong to another hour or pool is refused, because it would survive the next replace.
    If the hour was billed before, `reruns` gets a row per tenant with the old and new amounts
    and the reason, and the snapshot that still holds the old charges; in a closed month, each
    change is also an invoice adjustment (`pipeline.finance.adjustments`). `then` runs inside
    the transaction once the new rows are in (to record what was published with them).
    """
    naive_hour = to_warehouse(hour)
    tables = {name: _naive_hours(frame) for name, frame in tables.items()}
    for name, frame in tables.items():
        if frame.height and not (
            frame["pool"].eq(pool).all() and frame["hour"].eq(naive_hour).all()
        ):
            raise WarehouseError(f"{name}: rows outside hour {hour_key(hour)} pool {pool!r}")
    lines = tables.get("ledger_lines")
    if lines is not None and lines.height:
        unknown = sorted(set(lines["line_kind"].to_list()) - set(LINE_KINDS))
        if unknown:
            raise WarehouseError(
                f"ledger_lines of {hour_key(hour)} pool {pool!r}: line_kind {unknown} "
                f"not one of {list(LINE_KINDS)}"
            )
    retry_conflicts(
        lambda: _replace_hour_rows(con, hour, pool, tables, lines, then),
        f"bill {hour_key(hour)} {pool}",
    )


def _replace_hour_rows(
    con: duckdb.DuckDBPyConnection,
    hour: datetime,
    pool: str,
    tables: Mapping[str, pl.DataFrame],
    lines: pl.DataFrame | None,
    then: Callable[[duckdb.DuckDBPyConnection], None] | None,
) -> None:
    naive_hour = to_warehouse(hour)
    at_hour = [naive_hour, pool]
    previous_snapshot = current_snapshot(con)
    with transaction(con):
        billed_before = con.execute(
            "SELECT count(*) FROM invoices WHERE hour = ? AND pool = ?", at_hour
        ).fetchall()[0][0]
        before = query_frame(
            con,
            "SELECT tenant, line_kind, amount_nano, requests, new_tokens, weights_version, "
            "policy_version FROM ledger_lines WHERE hour = ? AND pool = ?",
            at_hour,
        )
        # A DELETE that matches no row changes nothing DuckLake checks, so a pool-hour published
        # for the first time only appends, side by side with other pool-hours; a re-run's
        # delete takes its turn through retry_conflicts.
        for name in (*tables, "reconciliation"):
            con.execute(f"DELETE FROM {name} WHERE hour = ? AND pool = ?", at_hour)
        for name, frame in tables.items():
            if frame.height:
                insert_frame(con, name, frame)
        reason = None
        if billed_before and lines is not None:
            reason = _rerun_reason(before, lines)
            reruns = (
                _tenant_totals(before, "previous_nano")
                .join(_tenant_totals(lines, "amount_nano"), on="tenant", how="full", coalesce=True)
                .fill_null(0)
                .with_columns(
                    delta_nano=pl.col("amount_nano") - pl.col("previous_nano"),
                    rerun_at=pl.lit(datetime.now(UTC)),
                    hour=pl.lit(naive_hour),
                    pool=pl.lit(pool),
                    reason=pl.lit(reason),
                    previous_snapshot=pl.lit(previous_snapshot, dtype=pl.Int64),
                )
                .sort("tenant")
            )
            insert_frame(con, "reruns", reruns)
            # Imported here: pipeline.finance reads through this module.
            from pipeline.finance.adjustments import record_adjustments

            record_adjustments(con, naive_hour, pool, reruns)
        if then is not None:
            then(con)
        commit_message(
            con, f"bill {hour_key(hour)} {pool}", hour=hour_key(hour), pool=pool, rerun=reason
        )


def query_frame(
    con: duckdb.DuckDBPyConnection, sql: str, params: list[Any] | None = None
) -> pl.DataFrame:
    """A query's result as a polars frame."""
    frame: pl.DataFrame = con.execute(sql, params or []).pl()
    return frame


def insert_frame(con: duckdb.DuckDBPyConnection, table: str, frame: pl.DataFrame) -> None:
    """Append a frame to a table, matching columns by name; unknown columns are an error."""
    known = {row[0] for row in con.execute(f"DESCRIBE {table}").fetchall()}
    unknown = sorted(set(frame.columns) - known)
    if unknown:
        raise WarehouseError(f"{table}: no column(s) {unknown}")
    columns = ", ".join(f'"{c}"' for c in frame.columns)
    # DuckDB scans the local Arrow table by its variable name (no registration to undo if the
    # insert aborts the transaction).
    incoming = frame.to_arrow()  # noqa: F841
    con.execute(f"INSERT INTO {table} ({columns}) SELECT {columns} FROM incoming")


def record_checks(
    con: duckdb.DuckDBPyConnection,
    hour: datetime,
    pool: str,
    check_names: list[str],
    results: Sequence[Any],
    *,
    then: Callable[[duckdb.DuckDBPyConnection], None] | None = None,
) -> None:
    """Replace the hour's rows of the named checks with `results` (objects with the
    reconciliation columns as attributes, e.g. pipeline.reconcile.CheckResult); `then` runs in
    the same transaction (one warehouse snapshot) once they are in."""
    stray = sorted({r.check_name for r in results} - set(check_names))
    if stray:
        raise WarehouseError(
            f"reconciliation: results of checks {stray} not among those replaced {check_names}"
        )
    checked_at = warehouse_now()
    rows = pl.DataFrame(
        {
            "hour": [to_warehouse(r.hour) for r in results],
            "pool": [r.pool for r in results],
            "replica": [r.replica for r in results],
            "check_name": [r.check_name for r in results],
            "passed": [bool(r.passed) for r in results],
            "expected": [str(r.expected) for r in results],
            "observed": [str(r.observed) for r in results],
            "detail": [str(r.detail) for r in results],
            "severity": [r.severity for r in results],
            "blocking": [bool(r.blocking) for r in results],
            "finding": [r.finding for r in results],
            "checked_at": [checked_at] * len(results),
        },
        schema={
            "hour": pl.Datetime("us"),
            "pool": pl.String,
            "replica": pl.String,
            "check_name": pl.String,
            "passed": pl.Boolean,
            "expected": pl.String,
            "observed": pl.String,
            "detail": pl.String,
            "severity": pl.String,
            "blocking": pl.Boolean,
            "finding": pl.String,
            "checked_at": pl.Datetime("us"),
        },
    )
    naive_hour = to_warehouse(hour)
    if rows.height and not (rows["pool"].eq(pool).all() and rows["hour"].eq(naive_hour).all()):
        raise WarehouseError(f"reconciliation: results outside hour {hour_key(hour)} pool {pool!r}")
    severities = sorted(set(rows["severity"].to_list()) - set(SEVERITIES))
    if severities:
        raise WarehouseError(f"reconciliation: severity {severities} not one of {list(SEVERITIES)}")

    def record() -> None:
        with transaction(con):
            con.execute(
                "DELETE FROM reconciliation "
                "WHERE hour = ? AND pool = ? AND list_contains(?, check_name)",
                [naive_hour, pool, check_names],
            )
            if rows.height:
                insert_frame(con, "reconciliation", rows)
            if then is not None:
                then(con)
            commit_message(
                con, f"reconcile {hour_key(hour)} {pool}", hour=hour_key(hour), pool=pool
            )

    retry_conflicts(record, f"reconcile {hour_key(hour)} {pool}")
