"""One pool-hour's reconciliation: its facts read once from the lake, the warehouse and the
DCGM scrapes, every check of the registry run over them, the results recorded."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import duckdb
import polars as pl

from pipeline.attribution.calibration import CalibrationStore
from pipeline.ingestion.dcgm import read_dcgm_hour
from pipeline.ingestion.ingest import committed_batches
from pipeline.reconcile import (
    calibration,
    clock,
    conservation,
    money,
    plausibility,
    sequence,
    silence,
    timing,
    unattributed,
)
from pipeline.reconcile.alerts import add_alerts
from pipeline.reconcile.facts import Check, HourFacts
from pipeline.reconcile.findings import CHECKS
from pipeline.reconcile.result import CheckResult
from pipeline.storage.lake import last_seq_before, load_hour, steps_of_other_hours
from pipeline.storage.warehouse import query_frame, record_checks
from schemas.config import Pool, Settings
from schemas.units import from_warehouse, hour_key, to_warehouse, utc_hour

# Every check run on a pool-hour, in the order their results are recorded.
REGISTRY: tuple[Check, ...] = (
    sequence.run,
    timing.run,
    money.run,
    plausibility.run,
    silence.run,
    clock.run,
    conservation.run,
    unattributed.run,
    calibration.run,
)


def _pool_rows(con: duckdb.DuckDBPyConnection, table: str, pool: Pool) -> pl.DataFrame:
    """A warehouse table's rows for the pool's replicas (damage by the replica outbox holding the file)."""
    if table == "damage":
        return query_frame(
            con,
            "SELECT * FROM damage WHERE list_contains(?, regexp_extract(path, '([^/]+)/[^/]*$', 1))",
            [[r.id for r in pool.streams]],
        )
    return query_frame(con, f"SELECT * FROM {table} WHERE pool = ?", [pool.name])


def attributed_hours(con: duckdb.DuckDBPyConnection, pool: Pool, hour: datetime) -> set[str]:
    """Keys of the pool's hours with an invoice (published or held back), and `hour`'s own."""
    rows = con.execute("SELECT DISTINCT hour FROM invoices WHERE pool = ?", [pool.name]).fetchall()
    return {hour_key(from_warehouse(row[0])) for row in rows} | {hour_key(hour)}


def reconcile_hour(
    con: duckdb.DuckDBPyConnection,
    lake: Path,
    dcgm_dir: Path,
    pool: Pool,
    hour: datetime,
    settings: Settings,
    *,
    calibration_file: Path | None = None,
) -> list[CheckResult]:
    """Run the CHECKS on one published pool-hour and record them in the warehouse's
    `reconciliation` table, and the failures in `alerts` (`pipeline.reconcile.alerts.add_alerts`),
    in one transaction.

    Everything the checks read is read once, from the committed batches of the lake, the
    warehouse and the DCGM scrapes, before any check runs. `calibration_file`: the calibration
    store (`<data dir>/calibration.yaml`); without one no engine version has been calibrated."""
    hour = utc_hour(hour)
    store = (
        CalibrationStore.load(calibration_file)
        if calibration_file is not None
        else CalibrationStore()
    )
    batches = committed_batches(con)
    # The checks read the steps; only a fitted pool's drift check reads their slots.
    tables = ("steps", "slots") if pool.policies.weights == "fitted" else ("steps",)
    data = load_hour(lake, pool.name, hour, batches, tables=tables)
    kv = load_hour(
        lake, pool.name, hour, batches, ["replica", "seq", "kv_blocks"], tables=("slots", "holders")
    )
    at_hour = [to_warehouse(hour), pool.name]
    segments = _pool_rows(con, "segments", pool)
    facts = HourFacts(
        hour=hour,
        pool=pool,
        settings=settings,
        steps=data.steps,
        drops=_pool_rows(con, "drops", pool),
        damage=_pool_rows(con, "damage", pool),
        segments=segments,
        clock_jumps=_pool_rows(con, "clock_jumps", pool),
        last_seq_before=last_seq_before(lake, pool.name, hour, batches),
        invoices=query_frame(con, "SELECT * FROM invoices WHERE hour = ? AND pool = ?", at_hour),
        ledger_lines=query_frame(
            con, "SELECT * FROM ledger_lines WHERE hour = ? AND pool = ?", at_hour
        ),
        dcgm=read_dcgm_hour(dcgm_dir, hour),
        kv_held=plausibility.kv_held_by_step(kv.slots, kv.holders),
        elsewhere=steps_of_other_hours(lake, pool.name, attributed_hours(con, pool, hour), batches),
        calibration=calibration.calibration_facts(pool, segments, data, store),
    )
    results = [result for check in REGISTRY for result in check(facts)]
    # The failures' alerts in the same snapshot: one warehouse commit per reconciled hour.
    record_checks(
        con, hour, pool.name, list(CHECKS), results, then=lambda con: add_alerts(con, results)
    )
    return results


def failed_checks(con: duckdb.DuckDBPyConnection, pool: str, hour: datetime) -> list[CheckResult]:
    """The hour's failed reconciliation results, as recorded in the warehouse."""
    rows = query_frame(
        con,
        "SELECT hour, pool, replica, check_name, passed, expected, observed, detail, severity, blocking, finding "
        "FROM reconciliation WHERE hour = ? AND pool = ? AND NOT passed ORDER BY check_name, replica",
        [to_warehouse(hour), pool],
    )
    return [
        CheckResult(**{**row, "hour": from_warehouse(row["hour"])})
        for row in rows.iter_rows(named=True)
    ]
