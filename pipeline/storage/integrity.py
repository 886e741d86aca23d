"""What was ingested and published is still there, unchanged: the lake files an hour is billed
from, and the rows and data files of every published pool-hour.

Ingest records each lake file's sha256 (`lake_files`); an hour is never attributed from fewer
of them than ingest wrote (`require_lake_files`): a missing file would move its replica's work
to idle. Publishing an hour records, in the same warehouse transaction, a digest of its rows
(`published_digests`: invoices, ledger lines and request costs in one canonical order and
encoding) and the sha256 of each DuckLake data file holding them (`published_files`). A re-run
verifies both before it replaces the hour (`verify_published_hour`), and every finance
connection verifies each data file it reads (`pipeline.storage.read_only_files`), so a data
file changed in place is refused, never served or silently rewritten.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import NoReturn

import duckdb

from pipeline.reconcile.findings import LAKE_FILES_MISSING, PUBLISHED_CHANGED, Finding
from pipeline.reconcile.result import CheckResult, failed
from pipeline.storage.read_only_files import PublishedFile, file_sha256
from schemas.errors import DataError
from schemas.units import hour_key, to_warehouse

# The tables of a pool-hour's rows digest, in the order they are hashed.
DIGESTED_TABLES = ("invoices", "ledger_lines", "request_costs")


class IntegrityError(DataError):
    """What the hour was billed or published from is missing or changed: the hour is held (its
    published ledger, if any, is kept) and the run fails, which pages on-call. `result` is the
    failed check of the finding."""

    def __init__(self, result: CheckResult) -> None:
        super().__init__(f"{result.finding}: {result.detail}")
        self.result = result


def _refuse(hour: datetime, pool: str, expected: str, observed: str, finding: Finding) -> NoReturn:
    raise IntegrityError(failed((hour, pool, None), expected, observed, [finding]))


def require_lake_files(lake: Path, pool: str, hour: datetime, hashes: Mapping[str, str]) -> None:
    """Refuse to bill the hour unless every lake file ingest recorded for it (and for the hour
    before, which holds its straddling steps) is still there: `hashes` maps each file's path
    relative to the lake to its sha256 (`lake_files`). Their content is verified where they
    are read (`pipeline.storage.lake.verify`)."""
    missing = sorted(path for path in hashes if not (lake / path).is_file())
    if missing:
        listed = ", ".join(str(lake / path) for path in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        _refuse(
            hour,
            pool,
            f"{len(hashes)} lake files",
            f"{len(missing)} missing",
            LAKE_FILES_MISSING.found(
                f"pool {pool} hour {hour_key(hour)}: {len(missing)} of the {len(hashes)} lake "
                f"files ingest wrote for it are missing ({listed}{more}); billing it would "
                "charge their steps as idle, so the hour is held and its published ledger kept"
            ),
        )


def _canonical_rows(con: duckdb.DuckDBPyConnection, table: str) -> str:
    """SQL: the text of each of the hour's rows of `table`, all columns in table order."""
    columns = [row[0] for row in con.execute(f"DESCRIBE {table}").fetchall()]
    packed = ", ".join(f'"{column}" := "{column}"' for column in columns)
    return f"SELECT CAST(struct_pack({packed}) AS VARCHAR) AS row_text FROM {table} WHERE hour = $hour AND pool = $pool"


def rows_digest(con: duckdb.DuckDBPyConnection, hour: datetime, pool: str) -> str:
    """sha256 over the pool-hour's rows of DIGESTED_TABLES: per table, its rows' texts sorted
    and joined by newlines, hashed; the tables' names and hashes joined and hashed again."""
    parts = " UNION ALL ".join(
        f"SELECT '{table}' AS name, {position} AS position, "
        f"sha256(coalesce(string_agg(row_text, chr(10) ORDER BY row_text), '')) AS digest "
        f"FROM ({_canonical_rows(con, table)})"
        for position, table in enumerate(DIGESTED_TABLES)
    )
    (digest,) = con.execute(
        f"SELECT sha256(string_agg(name || ':' || digest, chr(10) ORDER BY position)) FROM ({parts})",
        {"hour": to_warehouse(hour), "pool": pool},
    ).fetchall()[0]
    return str(digest)


def hour_data_files(
    con: duckdb.DuckDBPyConnection, data_dir: Path, hour: datetime, pool: str
) -> list[PublishedFile]:
    """The data files holding the pool-hour's rows of DIGESTED_TABLES, hashed now (rows
    inlined into the catalog have no file; the rows digest covers them)."""
    at_hour = {"hour": to_warehouse(hour), "pool": pool}
    found = []
    for table in DIGESTED_TABLES:
        names = con.execute(
            f"SELECT DISTINCT filename FROM {table} WHERE hour = $hour AND pool = $pool "
            "ORDER BY filename",
            at_hour,
        ).fetchall()
        for (name,) in names:
            path = Path(name)
            if path.is_absolute() and path.is_relative_to(data_dir):
                relative = str(path.relative_to(data_dir))
                found.append(PublishedFile(relative, table, hour, pool, file_sha256(path)))
    return found


def record_published_hour(
    con: duckdb.DuckDBPyConnection, data_dir: Path, hour: datetime, pool: str
) -> None:
    """Replace the pool-hour's digest and data-file hashes by those of its rows now (inside
    the transaction that publishes it, so the hour and its digest commit together)."""
    at_hour = [to_warehouse(hour), pool]
    for table in ("published_digests", "published_files"):
        con.execute(f"DELETE FROM {table} WHERE hour = ? AND pool = ?", at_hour)
    con.execute(
        "INSERT INTO published_digests VALUES (?, ?, ?)", [*at_hour, rows_digest(con, hour, pool)]
    )
    files = hour_data_files(con, data_dir, hour, pool)
    if files:
        con.executemany(
            "INSERT INTO published_files VALUES (?, ?, ?, ?, ?)",
            [[*at_hour, f.table_name, f.path, f.sha256] for f in files],
        )


def verify_published_hour(
    con: duckdb.DuckDBPyConnection, data_dir: Path, hour: datetime, pool: str
) -> None:
    """Refuse (IntegrityError) if the pool-hour's published rows or data files differ from
    what was published; an hour never published, or published before digests were, passes."""
    at_hour = [to_warehouse(hour), pool]
    recorded = con.execute(
        "SELECT rows_sha256 FROM published_digests WHERE hour = ? AND pool = ?", at_hour
    ).fetchall()
    if not recorded:
        return
    for path, table_name, sha256 in con.execute(
        "SELECT path, table_name, sha256 FROM published_files WHERE hour = ? AND pool = ? "
        "ORDER BY path",
        at_hour,
    ).fetchall():
        local = data_dir / path
        found = file_sha256(local) if local.is_file() else "(file missing)"
        if found != sha256:
            published = PublishedFile(path, table_name, hour, pool, sha256)
            _refuse(
                hour, pool, sha256, found, PUBLISHED_CHANGED.found(published.changed(local, found))
            )
    found_rows = rows_digest(con, hour, pool)
    if found_rows != recorded[0][0]:
        _refuse(
            hour,
            pool,
            recorded[0][0],
            found_rows,
            PUBLISHED_CHANGED.found(
                f"pool {pool} hour {hour_key(hour)}: its published rows (invoices, ledger "
                f"lines, request costs) digest to {found_rows}, but were published as "
                f"{recorded[0][0]}: the warehouse was changed after publishing, so the hour is "
                "not replaced"
            ),
        )
