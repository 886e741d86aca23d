"""Adjustments of closed months: an hour of a month `stepledger close` invoiced is billed again.

The issued invoices never change. Each tenant's change of the hour's charge is recorded in
`invoice_adjustments`, a debit (positive) or a credit (negative) carried on the tenant's
invoice of the next month still open, as billing systems do; `close_month` adds them to that
invoice. The re-bill is also a WARN finding (`closed_month`/`rebilled`) in `alerts`, and a
warning on the command line.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import date, datetime, timedelta

import duckdb
import polars as pl

from pipeline.reconcile.alerts import alert_for
from pipeline.reconcile.findings import REBILLED_CLOSED_MONTH
from pipeline.reconcile.result import CheckResult, failed
from pipeline.storage.warehouse import insert_frame
from schemas.units import from_warehouse, hour_key, nano_to_usd, to_warehouse, warehouse_now

log = logging.getLogger(__name__)


def next_open_month(con: duckdb.DuckDBPyConnection, month: date) -> date:
    """The first month after `month` that is not closed."""
    closed = {row[0] for row in con.execute("SELECT month FROM closed_months").fetchall()}
    following = _month_after(month)
    while following in closed:
        following = _month_after(following)
    return following


def _month_after(month: date) -> date:
    return (month.replace(day=1) + timedelta(days=32)).replace(day=1)


def record_adjustments(
    con: duckdb.DuckDBPyConnection, hour: datetime, pool: str, reruns: pl.DataFrame
) -> None:
    """In the re-billing transaction of (`hour` naive UTC, `pool`), with `reruns` its rows:
    when the hour's month is closed, an adjustment per tenant whose charge moved, and the
    WARN finding."""
    month = hour.date().replace(day=1)
    closed = con.execute("SELECT 1 FROM closed_months WHERE month = ?", [month]).fetchall()
    if not closed:
        return
    issued = dict(
        con.execute(
            "SELECT tenant, invoice_id FROM invoice_numbers WHERE month = ?", [month]
        ).fetchall()
    )
    invoice_month = next_open_month(con, month)
    adjustments = reruns.filter(pl.col("delta_nano") != 0).select(
        pl.col("rerun_at").alias("recorded_at"),
        "hour",
        "pool",
        "tenant",
        pl.lit(month).alias("charge_month"),
        pl.lit(invoice_month).alias("invoice_month"),
        pl.col("tenant")
        .replace_strict(issued, default=None, return_dtype=pl.String)
        .alias("corrects_invoice_id"),
        pl.col("delta_nano").alias("amount_nano"),
        "reason",
        "previous_snapshot",
    )
    if adjustments.height:
        insert_frame(con, "invoice_adjustments", adjustments)
    result = rebilled_closed_month(from_warehouse(hour), pool, adjustments, invoice_month)
    _warn(con, result, int(reruns["previous_snapshot"][0]))


def rebilled_closed_month(
    hour: datetime, pool: str, adjustments: pl.DataFrame, invoice_month: date
) -> CheckResult:
    """The WARN finding of a closed month's hour (aware UTC) billed again, with each
    tenant's adjustment (`adjustments`: tenant, amount_nano) and the month carrying them."""
    changes = ", ".join(
        f"{tenant} {nano_to_usd(amount):+,.9f} USD"
        for tenant, amount in adjustments.select("tenant", "amount_nano").iter_rows()
    )
    return failed(
        (hour, pool, None),
        f"no hour of closed month {hour:%Y-%m} billed again",
        f"{hour_key(hour)} billed again",
        [
            REBILLED_CLOSED_MONTH.found(
                f"{hour_key(hour)} {pool} is in {hour:%Y-%m}, a closed month, and was billed "
                "again: its invoices stand as issued; "
                + (
                    f"adjustments on the {invoice_month:%Y-%m} invoices: {changes}"
                    if changes
                    else "no tenant's charge changed"
                )
            )
        ],
    )


def _warn(con: duckdb.DuckDBPyConnection, result: CheckResult, snapshot: int) -> None:
    """Say it on the command line and record the WARN in `alerts` (once per re-bill: the
    replaced snapshot is part of its key)."""
    log.warning("%s", result.detail)
    alert = alert_for(replace(result, finding=f"{result.finding}@{snapshot}"), warehouse_now())
    con.execute(
        "INSERT INTO alerts (raised_at, severity, kind, hour, pool, detail, dedup_key) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        [
            alert.raised_at,
            alert.severity,
            alert.kind,
            to_warehouse(alert.hour),
            alert.pool,
            alert.detail,
            alert.dedup_key,
        ],
    )
