"""The DuckDB warehouse: connections, its schema, and exact replacement of an hour.

Writers open short read/write connections (DuckDB is single-writer per file); finance and the
CLI read through `connect_read_only`, which can never change the ledger.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb
import polars as pl

from pipeline.hours import hour_key, utc_hour

SQL_DIR = Path(__file__).resolve().parent.parent / "sql"
SCHEMA_SQL = SQL_DIR / "schema.sql"
VIEWS_SQL = SQL_DIR / "views.sql"

# The tables one pool-hour of attribution writes; replaced together, in one transaction.
HOUR_TABLES = ("invoices", "ledger_lines", "request_costs")


class WarehouseError(RuntimeError):
    """The warehouse file is missing, unreadable, or a write does not match a table."""


def apply_schema(con: duckdb.DuckDBPyConnection) -> None:
    """Create the tables (if missing) and (re)create the views; safe to run on every open."""
    con.execute(SCHEMA_SQL.read_text())
    con.execute(VIEWS_SQL.read_text())


@contextmanager
def connect(path: str | Path) -> Iterator[duckdb.DuckDBPyConnection]:
    """A read/write connection with the schema applied; closed on exit."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect(str(path))
    try:
        apply_schema(con)
        yield con
    finally:
        con.close()


@contextmanager
def connect_read_only(path: str | Path) -> Iterator[duckdb.DuckDBPyConnection]:
    """A read-only connection for finance queries; the file must exist."""
    path = Path(path)
    if not path.is_file():
        raise WarehouseError(
            f"{path}: no warehouse file (run `stepledger demo` or `stepledger run` first)"
        )
    con = duckdb.connect(str(path), read_only=True)
    try:
        yield con
    finally:
        con.close()


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


def _naive(hour: datetime) -> datetime:
    # Warehouse hours are TIMESTAMP (no zone) holding UTC.
    return utc_hour(hour).replace(tzinfo=None)


def _naive_hours(frame: pl.DataFrame) -> pl.DataFrame:
    dtype = frame.schema.get("hour")
    if isinstance(dtype, pl.Datetime) and dtype.time_zone is not None:
        return frame.with_columns(
            pl.col("hour").dt.convert_time_zone("UTC").dt.replace_time_zone(None)
        )
    return frame


def replace_hour(
    con: duckdb.DuckDBPyConnection, hour: datetime, pool: str, tables: Mapping[str, pl.DataFrame]
) -> None:
    """Replace the (hour, pool) rows of each table with `tables[name]`, all in one transaction.

    Rows are inserted by column name, so frames may list columns in any order; a frame whose
    rows belong to another hour or pool is refused, because it would survive the next replace.
    """
    naive_hour = _naive(hour)
    tables = {name: _naive_hours(frame) for name, frame in tables.items()}
    for name, frame in tables.items():
        if frame.height and not (
            frame["pool"].eq(pool).all() and frame["hour"].eq(naive_hour).all()
        ):
            raise WarehouseError(f"{name}: rows outside hour {hour_key(hour)} pool {pool!r}")
    with transaction(con):
        for name, frame in tables.items():
            con.execute(f"DELETE FROM {name} WHERE hour = ? AND pool = ?", [naive_hour, pool])
            if frame.height:
                insert_frame(con, name, frame)


def query_frame(
    con: duckdb.DuckDBPyConnection, sql: str, params: list[Any] | None = None
) -> pl.DataFrame:
    """A query's result as a polars frame."""
    frame: pl.DataFrame = con.sql(sql, params=params).pl()
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
    results: list[Any],
) -> None:
    """Replace the hour's rows of the named checks with `results` (objects with the
    reconciliation columns as attributes, e.g. pipeline.reconcile.CheckResult)."""
    stray = sorted({r.check_name for r in results} - set(check_names))
    if stray:
        raise WarehouseError(
            f"reconciliation: results of checks {stray} not among those replaced {check_names}"
        )
    rows = pl.DataFrame(
        {
            "hour": [_naive(r.hour) for r in results],
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
        },
    )
    naive_hour = _naive(hour)
    if rows.height and not (rows["pool"].eq(pool).all() and rows["hour"].eq(naive_hour).all()):
        raise WarehouseError(f"reconciliation: results outside hour {hour_key(hour)} pool {pool!r}")
    with transaction(con):
        con.execute(
            "DELETE FROM reconciliation WHERE hour = ? AND pool = ? AND list_contains(?, check_name)",
            [naive_hour, pool, check_names],
        )
        if rows.height:
            insert_frame(con, "reconciliation", rows)
