"""Finance's one read path: `connect(data_dir)`.

    import pipeline.finance
    con = pipeline.finance.connect("demo-run")
    con.sql("SELECT * FROM tenant_costs_daily").show()

The connection is read-only, in memory, with the DuckLake warehouse attached as `ledger` and
every finance view (sql/views.sql) defined. It reads a snapshot per query and never holds a
lock the pipeline needs, so it may stay open all day while hours are billed and re-billed;
each query sees the latest committed snapshot, or the one of `as_of`.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import duckdb

from pipeline.warehouse import CATALOG_FILE, read_connection, warehouse_dir


def connect(
    data_dir: str | Path, *, as_of: datetime | int | None = None
) -> duckdb.DuckDBPyConnection:
    """A read-only connection to the warehouse of `data_dir` (or to the warehouse directory
    itself): the latest snapshot, or `as_of` a time (aware) or snapshot id."""
    directory = Path(data_dir)
    if not (directory / CATALOG_FILE).is_file():
        directory = warehouse_dir(directory)
    return read_connection(directory, as_of=as_of)
