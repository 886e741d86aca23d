"""Pool-hours published by hand, as `pipeline.storage.publish.publish_hour` publishes them
(the hour's rows replaced and their digest and data files recorded in one transaction), with
enough ledger lines that DuckLake writes them to a data file rather than into its catalog."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import duckdb
import polars as pl

from pipeline.storage.integrity import record_published_hour
from pipeline.storage.warehouse import data_files, replace_hour

LINES_PER_HOUR = 200


def publish_by_hand(con: duckdb.DuckDBPyConnection, hour: datetime, pool: str) -> None:
    """Publish `pool`'s `hour`: an invoice of LINES_PER_HOUR nano-dollars, a nano-dollar a line."""
    naive = hour.replace(tzinfo=None)
    lines = pl.DataFrame(
        {
            "hour": [naive] * LINES_PER_HOUR,
            "pool": [pool] * LINES_PER_HOUR,
            "tenant": [f"t{i % 4}" for i in range(LINES_PER_HOUR)],
            "feature": [f"f{i}" for i in range(LINES_PER_HOUR)],
            "line_kind": ["usage"] * LINES_PER_HOUR,
            "amount_nano": [1] * LINES_PER_HOUR,
            "requests": [1] * LINES_PER_HOUR,
            "new_tokens": [10] * LINES_PER_HOUR,
            "cached_tokens": [0] * LINES_PER_HOUR,
            "weights_version": ["w"] * LINES_PER_HOUR,
            "policy_version": ["p"] * LINES_PER_HOUR,
        }
    )
    invoice = pl.DataFrame(
        {
            "hour": [naive],
            "pool": [pool],
            "gpus": [1],
            "usd_per_gpu_hour": [1.0],
            "amount_nano": [LINES_PER_HOUR],
        }
    )
    data = data_files(con)
    replace_hour(
        con,
        hour,
        pool,
        {"invoices": invoice, "ledger_lines": lines},
        then=lambda writing: record_published_hour(writing, data, hour, pool),
    )


def ledger_lines_file(con: duckdb.DuckDBPyConnection, hour: datetime, pool: str) -> Path:
    """The data file holding the published hour's ledger lines."""
    (path,) = con.execute(
        "SELECT path FROM published_files WHERE table_name = 'ledger_lines' AND hour = ? "
        "AND pool = ?",
        [hour.replace(tzinfo=None), pool],
    ).fetchall()[0]
    return Path(data_files(con).path(str(path)))


def double_every_amount(file: Path) -> None:
    """Rewrite the data file in place, every line twice as dear."""
    pl.read_parquet(file).with_columns(amount_nano=pl.col("amount_nano") * 2).write_parquet(file)
