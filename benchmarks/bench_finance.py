"""Finance's query latency on the DuckLake warehouse: `tenant_costs_daily` over 30 simulated
days, through the documented read path (`pipeline.finance.connect`).

The warehouse holds 30 days of two pools, 24 hours each, with the ledger lines, invoices and
reconciliation rows of a busy fleet (40 tenant features per pool-hour). The full run commits
one snapshot per day, as a day's re-runs would leave its files; --quick commits all days at
once. The figure is the median of repeated queries on a connection held open, as an analyst's
session is."""

from __future__ import annotations

import statistics
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

import polars as pl

from benchmarks.figure import Figure
from pipeline import finance
from pipeline.datadir import DataDir
from pipeline.storage.warehouse import connect, insert_frame, transaction

DAYS = 30
POOLS = ("chat-8b", "reason-dsv3")
FEATURES_PER_HOUR = 40
TENANTS = 12
START = datetime(2026, 11, 1)


def _day_rows(day: int) -> dict[str, pl.DataFrame]:
    hours = [START + timedelta(days=day, hours=h) for h in range(24)]
    keys = pl.DataFrame({"hour": hours}).join(pl.DataFrame({"pool": POOLS}), how="cross")
    lines = keys.join(pl.DataFrame({"f": range(FEATURES_PER_HOUR)}), how="cross").with_columns(
        tenant=pl.format("tenant-{}", pl.col("f") % TENANTS),
        feature=pl.format("feature-{}", pl.col("f")),
        line_kind=pl.lit("usage"),
        amount_nano=(pl.col("f") + 1) * 1_000_003,
        requests=pl.col("f") + 10,
        new_tokens=(pl.col("f") + 1) * 997,
        cached_tokens=pl.col("f") * 13,
        weights_version=pl.lit("kernel-bench"),
        policy_version=pl.lit("pol-bench"),
    )
    invoices = (
        lines.group_by("hour", "pool")
        .agg(pl.col("amount_nano").sum())
        .with_columns(gpus=pl.lit(8, dtype=pl.Int32), usd_per_gpu_hour=pl.lit(3.6))
    )
    checks = keys.with_columns(
        check_name=pl.lit("money"),
        passed=pl.lit(True),
        expected=pl.lit(""),
        observed=pl.lit(""),
        detail=pl.lit(""),
    )
    return {"ledger_lines": lines.drop("f"), "invoices": invoices, "reconciliation": checks}


def build(root: Path, *, commits: int) -> None:
    """30 days in `commits` snapshots."""
    days = [_day_rows(day) for day in range(DAYS)]
    per_commit = -(-DAYS // commits)
    with connect(DataDir(root).state_file) as con:
        for first in range(0, DAYS, per_commit):
            batch = days[first : first + per_commit]
            with transaction(con):
                for table in ("invoices", "ledger_lines", "reconciliation"):
                    insert_frame(con, table, pl.concat([d[table] for d in batch]))


def query_ms(root: Path, repeats: int) -> tuple[float, int]:
    with finance.connect(root) as con:
        con.execute("SELECT * FROM tenant_costs_daily").fetchall()  # warm the catalog
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            rows = con.execute("SELECT * FROM tenant_costs_daily").fetchall()
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), len(rows)


def figures(quick: bool) -> list[Figure]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build(root, commits=1 if quick else DAYS)
        median, rows = query_ms(root, repeats=5 if quick else 20)
    if rows != DAYS * TENANTS:
        raise AssertionError(f"tenant_costs_daily returned {rows} rows, expected {DAYS * TENANTS}")
    return [Figure("finance_query_ms", round(median, 1), "ms", 200.0, "max")]


if __name__ == "__main__":
    for figure in figures(quick=False):
        print(figure.as_dict())
