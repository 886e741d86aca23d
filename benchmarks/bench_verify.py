"""What verifying published data files costs finance. A finance connection hashes each data
file of a published pool-hour the first time a query of its process opens it: the first
`tenant_costs_daily` query (what `stepledger costs` runs) hashes the ledger lines' files and no
others. `verify_warehouse_s` is the time hashing those takes; `verify_all_files_s` what hashing
every published file would (verifying the whole warehouse on each connection).

The verification sweep (`stepledger verify`, the `verify_published` sensor) checks every
published pool-hour: `verify_sweep_first_ms_per_pool_hour` is its cost per pool-hour in a
process that has hashed nothing yet (every file read through), `verify_sweep_ms_per_pool_hour`
that of the next sweep, whose files are hashed already (by path, size and modification time):
a stat per file and the digest of the rows.

The warehouse is finance_query_ms's (benchmarks/bench_finance.py) for a week (quick: six
hours), each pool-hour published as the pipeline publishes it (one transaction with its digest
and data-file hashes), with 20,000 (quick: 2,000) request costs per pool-hour: the bulk of the
warehouse, which a query of the ledger lines never opens."""

from __future__ import annotations

import functools
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import polars as pl

from benchmarks.bench_finance import FEATURES_PER_HOUR, POOLS, START, TENANTS, _day_rows
from benchmarks.figure import Figure
from pipeline import finance
from pipeline.datadir import DataDir
from pipeline.storage.data_files import DATA_FILES_DIR
from pipeline.storage.integrity import record_published_hour, sweep_warehouse
from pipeline.storage.read_only_files import cached_sha256, file_sha256
from pipeline.storage.warehouse import (
    connect,
    data_files,
    replace_hour,
    warehouse_dir,
)

# The `verify_published` sensor sweeps hourly: a month of four pools (2,880 pool-hours) must be
# swept within the hour.
SWEEP_TARGET_MS = 3600 * 1000 / 2880


def _request_costs(hour: datetime, pool: str, requests: int) -> pl.DataFrame:
    return (
        pl.DataFrame({"r": range(requests)})
        .with_columns(
            hour=pl.lit(hour),
            pool=pl.lit(pool),
            request_id=pl.format("{}-{}-{}", pl.lit(pool), pl.lit(hour.isoformat()), pl.col("r")),
            tenant=pl.format("tenant-{}", pl.col("r") % TENANTS),
            feature=pl.format("feature-{}", pl.col("r") % FEATURES_PER_HOUR),
            compute_nano=pl.col("r") * 7 + 1,
            kv_nano=pl.col("r") * 3,
            amount_nano=pl.col("r") * 10 + 1,
            steps=pl.col("r") % 500,
            new_tokens=pl.col("r") % 900,
            cached_tokens=pl.col("r") % 90,
            prompt_tokens=pl.col("r") % 2000,
            output_tokens=pl.col("r") % 700,
            line_kind=pl.lit("usage"),
        )
        .drop("r")
    )


def build(root: Path, hours: int, requests: int) -> None:
    """`hours` hours of finance's benchmark warehouse (its ledger lines, invoices and passed
    checks), each pool-hour published with `requests` request costs."""
    with connect(DataDir(root).state_file) as con:
        data = data_files(con)
        for day in range(-(-hours // 24)):
            rows = _day_rows(day)
            for hour in (START + timedelta(days=day, hours=h) for h in range(min(24, hours))):
                for pool in POOLS:
                    tables = {
                        name: frame.filter((pl.col("hour") == hour) & (pl.col("pool") == pool))
                        for name, frame in rows.items()
                    }
                    tables["request_costs"] = _request_costs(hour, pool, requests)
                    replace_hour(
                        con,
                        hour.replace(tzinfo=UTC),
                        pool,
                        tables,
                        then=functools.partial(
                            record_published_hour,
                            data=data,
                            hour=hour.replace(tzinfo=UTC),
                            pool=pool,
                        ),
                    )


def hashing_s(files: list[Path]) -> float:
    started = time.perf_counter()
    for file in files:
        file_sha256(file)
    return time.perf_counter() - started


def figures(quick: bool) -> list[Figure]:
    hours, requests = (6, 2_000) if quick else (7 * 24, 20_000)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build(root, hours, requests)
        data_dir = warehouse_dir(root) / DATA_FILES_DIR
        with finance.connect(root) as con:
            files = {
                table: [data_dir / path for (path,) in rows]
                for table in ("ledger_lines", "request_costs")
                if (
                    rows := con.execute(
                        "SELECT path FROM published_files WHERE table_name = ?", [table]
                    ).fetchall()
                )
            }
            cached_sha256.cache_clear()
            con.execute("SELECT * FROM tenant_costs_daily").fetchall()
            hashed = cached_sha256.cache_info().misses
        if hashed != len(files["ledger_lines"]):
            raise AssertionError(
                f"tenant_costs_daily hashed {hashed} files, expected the "
                f"{len(files['ledger_lines'])} ledger_lines files"
            )
        read = hashing_s(files["ledger_lines"])
        everything = hashing_s(files["ledger_lines"] + files["request_costs"])
        cached_sha256.cache_clear()
        cold = sweep_s(root)
        warm = sweep_s(root)
    pool_hours = hours * len(POOLS)
    return [
        Figure("verify_warehouse_s", round(read, 3), "s", 1.0, "max"),
        Figure("verify_all_files_s", round(everything, 3), "s", 10.0, "max"),
        Figure(
            "verify_sweep_first_ms_per_pool_hour",
            round(1000 * cold / pool_hours, 2),
            "ms",
            SWEEP_TARGET_MS,
            "max",
        ),
        Figure(
            "verify_sweep_ms_per_pool_hour",
            round(1000 * warm / pool_hours, 2),
            "ms",
            SWEEP_TARGET_MS,
            "max",
        ),
    ]


def sweep_s(root: Path) -> float:
    """One verification sweep of the whole warehouse (the `verify_published` sensor's tick)."""
    started = time.perf_counter()
    sweep = sweep_warehouse(warehouse_dir(root))
    if sweep.changed:
        raise AssertionError(f"an untouched warehouse swept as changed: {sweep.changed[0].detail}")
    return time.perf_counter() - started


if __name__ == "__main__":
    for figure in figures(quick=False):
        print(figure.as_dict())
