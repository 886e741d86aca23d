"""What was ingested and published is still there, unchanged: the lake files an hour is billed
from, and the rows and data files of every published pool-hour.

Ingest records each lake file's sha256 (`lake_files`); an hour is never attributed from fewer
of them than ingest wrote (`require_lake_files`): a missing file would move its replica's work
to idle. Publishing an hour records, in the same warehouse transaction, a digest of its rows
(`published_digests`: invoices, ledger lines and request costs in one canonical order and
encoding) and the sha256 of each DuckLake data file holding them (`published_files`). A re-run
verifies both before it replaces the hour (`verify_published_hour`), and every finance
connection verifies each data file it reads (`pipeline.storage.read_only_files`), so a data
file changed in place is refused, never served or silently rewritten. A file no run and no
reader touches is found by the verification sweep (`sweep_published`: `stepledger verify`, and
the `verify_published` sensor, which pages).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import NoReturn

import duckdb

from pipeline.reconcile.findings import LAKE_FILES_MISSING, PUBLISHED_CHANGED, Finding
from pipeline.reconcile.result import CheckResult, failed
from pipeline.storage.data_files import MISSING, DataFiles, reader_data_files
from pipeline.storage.read_only_files import PublishedFile, cached_sha256
from pipeline.storage.warehouse import read_connection
from schemas.errors import DataError
from schemas.units import from_warehouse, hour_key, to_warehouse

# The tables of a pool-hour's rows digest, in the order they are hashed.
DIGESTED_TABLES = ("invoices", "ledger_lines", "request_costs")
ONE_HOUR = timedelta(hours=1)


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


def _canonical_rows(con: duckdb.DuckDBPyConnection, table: str, where: str) -> str:
    """SQL: hour, pool and the text of each row of `table` that `where` selects, all columns
    in table order."""
    columns = [row[0] for row in con.execute(f"DESCRIBE {table}").fetchall()]
    packed = ", ".join(f'"{column}" := "{column}"' for column in columns)
    return (
        f"SELECT hour, pool, CAST(struct_pack({packed}) AS VARCHAR) AS row_text FROM {table} "
        f"WHERE {where}"
    )


def _rows_digests_sql(con: duckdb.DuckDBPyConnection, keys: str, where: str) -> str:
    """SQL: hour, pool and the rows digest (`rows_digest`) of each pool-hour `keys` (a query
    of hour and pool) lists, from the rows of DIGESTED_TABLES that `where` selects (a
    condition on hour and pool narrowing what is read to at least those pool-hours)."""
    tables = [
        f"t{position} AS (SELECT hour, pool, "
        f"sha256(string_agg(row_text, chr(10) ORDER BY row_text)) AS digest "
        f"FROM ({_canonical_rows(con, table, where)}) GROUP BY hour, pool)"
        for position, table in enumerate(DIGESTED_TABLES)
    ]
    # A table without rows in the pool-hour digests as the empty text.
    joined = " || chr(10) || ".join(
        f"'{table}:' || coalesce(t{position}.digest, sha256(''))"
        for position, table in enumerate(DIGESTED_TABLES)
    )
    joins = " ".join(
        f"LEFT JOIN t{position} USING (hour, pool)" for position in range(len(DIGESTED_TABLES))
    )
    return (
        f"WITH keys AS ({keys}), {', '.join(tables)} "
        f"SELECT hour, pool, sha256({joined}) AS digest FROM keys {joins}"
    )


def rows_digest(con: duckdb.DuckDBPyConnection, hour: datetime, pool: str) -> str:
    """sha256 over the pool-hour's rows of DIGESTED_TABLES: per table, its rows' texts sorted
    and joined by newlines, hashed; the tables' names and hashes joined by newlines and hashed
    again."""
    (row,) = con.execute(
        _rows_digests_sql(
            con,
            "SELECT CAST($hour AS TIMESTAMP) AS hour, CAST($pool AS VARCHAR) AS pool",
            "hour = $hour AND pool = $pool",
        ),
        {"hour": to_warehouse(hour), "pool": pool},
    ).fetchall()
    return str(row[2])


def hour_data_files(
    con: duckdb.DuckDBPyConnection, data: DataFiles, hour: datetime, pool: str
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
            relative = data.relative_of(name)
            if relative is not None:
                found.append(PublishedFile(relative, table, hour, pool, data.sha256(relative)))
    return found


def record_published_hour(
    con: duckdb.DuckDBPyConnection, data: DataFiles, hour: datetime, pool: str
) -> None:
    """Replace the pool-hour's digest and data-file hashes by those of its rows now (inside
    the transaction that publishes it, so the hour and its digest commit together)."""
    at_hour = [to_warehouse(hour), pool]
    for table in ("published_digests", "published_files"):
        con.execute(f"DELETE FROM {table} WHERE hour = ? AND pool = ?", at_hour)
    con.execute(
        "INSERT INTO published_digests VALUES (?, ?, ?)", [*at_hour, rows_digest(con, hour, pool)]
    )
    files = hour_data_files(con, data, hour, pool)
    if files:
        con.executemany(
            "INSERT INTO published_files VALUES (?, ?, ?, ?, ?)",
            [[*at_hour, f.table_name, f.path, f.sha256] for f in files],
        )


def _files_changed(
    data: DataFiles, hour: datetime, pool: str, files: Iterable[tuple[str, str, str]]
) -> CheckResult | None:
    """The failed `published_changed` result naming every one of the pool-hour's published
    data files `files` (path, table name, sha256 as published) that is not what was
    published; None if none. Each local file is hashed once per version in the process."""
    changed = []
    for path, table_name, sha256 in files:
        found = _current_sha256(data, path)
        if found != sha256:
            published = PublishedFile(path, table_name, hour, pool, sha256)
            changed.append(
                (
                    sha256,
                    found,
                    PUBLISHED_CHANGED.found(published.changed(data.where(path), found)),
                )
            )
    if not changed:
        return None
    return failed(
        (hour, pool, None),
        ", ".join(expected for expected, _, _ in changed),
        ", ".join(found for _, found, _ in changed),
        [finding for _, _, finding in changed],
    )


def _current_sha256(data: DataFiles, relative: str) -> str:
    """An object on a store is hashed each time: its modification time, in whole seconds,
    cannot tell two versions of it apart."""
    if data.on_store:
        return data.sha256(relative)
    local = Path(data.path(relative))
    try:
        version = local.stat()
    except FileNotFoundError:
        return MISSING
    return cached_sha256(str(local), version.st_size, version.st_mtime_ns)


def _rows_changed(hour: datetime, pool: str, recorded: str, found: str) -> CheckResult:
    return failed(
        (hour, pool, None),
        recorded,
        found,
        [
            PUBLISHED_CHANGED.found(
                f"pool {pool} hour {hour_key(hour)}: its published rows (invoices, ledger "
                f"lines, request costs) digest to {found}, but were published as "
                f"{recorded}: the warehouse was changed after publishing, so the hour is "
                "not replaced"
            )
        ],
    )


def published_hour_change(
    con: duckdb.DuckDBPyConnection, data: DataFiles, hour: datetime, pool: str
) -> CheckResult | None:
    """The failed `published_changed` result of the pool-hour if its published data files or
    rows differ from what was published, naming every changed file (a changed file is not read
    for the rows digest); None if it is unchanged, never published, or published before
    digests were."""
    at_hour = [to_warehouse(hour), pool]
    recorded = con.execute(
        "SELECT rows_sha256 FROM published_digests WHERE hour = ? AND pool = ?", at_hour
    ).fetchall()
    if not recorded:
        return None
    files = con.execute(
        "SELECT path, table_name, sha256 FROM published_files WHERE hour = ? AND pool = ? "
        "ORDER BY path",
        at_hour,
    ).fetchall()
    if (change := _files_changed(data, hour, pool, files)) is not None:
        return change
    found = rows_digest(con, hour, pool)
    return None if found == recorded[0][0] else _rows_changed(hour, pool, recorded[0][0], found)


def verify_published_hour(
    con: duckdb.DuckDBPyConnection, data: DataFiles, hour: datetime, pool: str
) -> None:
    """Refuse (IntegrityError) if the pool-hour's published rows or data files differ from
    what was published; an hour never published, or published before digests were, passes."""
    change = published_hour_change(con, data, hour, pool)
    if change is not None:
        raise IntegrityError(change)


@dataclass(frozen=True)
class Sweep:
    """What a verification sweep saw: the published pool-hours and data files it checked, and
    a failed `published_changed` result per pool-hour that changed since publishing."""

    hours: int
    files: int
    changed: list[CheckResult]


def _window(start: datetime | None, end: datetime | None) -> tuple[str, list[datetime]]:
    """SQL selecting the hours [start, end) (unbounded on a side that is None), its parameters."""
    bounds, params = ["true"], []
    if start is not None:
        bounds.append("hour >= ?")
        params.append(to_warehouse(start))
    if end is not None:
        bounds.append("hour < ?")
        params.append(to_warehouse(end))
    return " AND ".join(bounds), params


def _window_digests(
    con: duckdb.DuckDBPyConnection, start: datetime | None, end: datetime | None
) -> dict[tuple[datetime, str], str]:
    """The rows digest of every published pool-hour of the hours [start, end), in one query:
    a query per pool-hour would read the tables once per pool-hour."""
    where, params = _window(start, end)
    keys = f"SELECT hour, pool FROM published_digests WHERE {where}"
    # Each of the query's table scans repeats the bounds, so their parameters repeat too.
    rows = con.execute(
        _rows_digests_sql(con, keys, where), params * (1 + len(DIGESTED_TABLES))
    ).fetchall()
    return {(from_warehouse(hour), pool): digest for hour, pool, digest in rows}


def sweep_published(
    con: duckdb.DuckDBPyConnection,
    data: DataFiles,
    start: datetime | None = None,
    end: datetime | None = None,
) -> Sweep:
    """Verify every published pool-hour (of the hours [start, end), either side unbounded when
    None) against its recorded data-file hashes and rows digest: what pages when a published
    file changes and no run or reader touches its hour. `con` may be a finance connection,
    which refuses to read a changed file: the files are hashed first, and the rows of an hour
    with a changed file are digested pool-hour by pool-hour (never reading that file), those
    of the other hours all in one query per stretch of hours between them."""
    where, params = _window(start, end)
    recorded = {
        (from_warehouse(hour), pool): digest
        for hour, pool, digest in con.execute(
            f"SELECT hour, pool, rows_sha256 FROM published_digests WHERE {where}", params
        ).fetchall()
    }
    files: dict[tuple[datetime, str], list[tuple[str, str, str]]] = {}
    for hour, pool, path, table_name, sha256 in con.execute(
        f"SELECT hour, pool, path, table_name, sha256 FROM published_files WHERE {where} "
        "ORDER BY path",
        params,
    ).fetchall():
        files.setdefault((from_warehouse(hour), pool), []).append((path, table_name, sha256))
    changed = {
        key: change
        for key, hour_files in files.items()
        if key in recorded and (change := _files_changed(data, *key, hour_files)) is not None
    }
    damaged_hours = sorted({hour for hour, _ in changed})
    found: dict[tuple[datetime, str], str] = {}
    for first, after in zip(
        [start, *(hour + ONE_HOUR for hour in damaged_hours)],
        [*damaged_hours, end],
        strict=True,
    ):
        if first is None or after is None or first < after:
            found.update(_window_digests(con, first, after))
    for hour, pool in recorded:
        if hour in damaged_hours and (hour, pool) not in changed:
            found[(hour, pool)] = rows_digest(con, hour, pool)
    for key, digest in recorded.items():
        if key not in changed and found[key] != digest:
            changed[key] = _rows_changed(*key, digest, found[key])
    return Sweep(
        len(recorded),
        sum(len(f) for f in files.values()),
        [changed[key] for key in sorted(changed)],
    )


def sweep_warehouse(
    warehouse: Path, start: datetime | None = None, end: datetime | None = None
) -> Sweep:
    """`sweep_published` over the warehouse directory `warehouse`, read through a finance
    connection: it never opens the pipeline's state, so a run does not hold it up."""
    con = read_connection(warehouse)
    try:
        return sweep_published(con, reader_data_files(warehouse), start, end)
    finally:
        con.close()
