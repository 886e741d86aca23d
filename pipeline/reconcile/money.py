"""The money check: the ledger lines sum to the invoice exactly, in integer nano-dollars."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

import polars as pl

from pipeline.attribution.ledger import LINE_KINDS
from pipeline.reconcile.facts import HourFacts
from pipeline.reconcile.findings import (
    INVOICE_COUNT,
    INVOICE_PRICE,
    LINE_KIND,
    MISMATCH,
    NOT_INTEGER,
    NULL_AMOUNT,
    Finding,
)
from pipeline.reconcile.frames import rows_of_hour
from pipeline.reconcile.result import CheckResult, failed, fold
from schemas.config import Pool
from schemas.units import hour_key, nano_of_usd


def run(facts: HourFacts) -> list[CheckResult]:
    """The money check of the gathered pool-hour."""
    return check_money(facts.hour, facts.pool, facts.invoices, facts.ledger_lines)


def check_money(
    hour: datetime, pool: Pool, invoices: pl.DataFrame, ledger_lines: pl.DataFrame
) -> list[CheckResult]:
    """Ledger lines of every kind sum to the invoice exactly, in integer nano-dollars.

    `invoices` and `ledger_lines` are the warehouse tables (other hours and pools are ignored).
    The invoice itself must equal its GPUs times the GPU-hour price in nano-dollars.
    """
    invoice_rows = rows_of_hour(invoices, hour, pool.name, "invoices")
    lines = rows_of_hour(ledger_lines, hour, pool.name, "ledger_lines")

    unreadable = _unreadable(hour, pool, invoice_rows, lines)
    if unreadable is not None:
        expected, observed, finding = unreadable
        return [failed((hour, pool.name, None), expected, observed, [finding])]
    invoice = invoice_rows.row(0, named=True)
    findings = []
    invoice_nano = int(invoice["amount_nano"])
    priced_nano = int(invoice["gpus"]) * nano_of_usd(Decimal(str(invoice["usd_per_gpu_hour"])))
    if priced_nano != invoice_nano:
        findings.append(
            INVOICE_PRICE.found(
                f"invoice {invoice_nano} nano-dollars != {invoice['gpus']} GPUs x "
                f"{invoice['usd_per_gpu_hour']} USD/GPU-hour = {priced_nano:f}"
            )
        )
    unknown = sorted(set(lines["line_kind"].to_list()) - set(LINE_KINDS))
    if unknown:
        findings.append(LINE_KIND.found(f"unknown ledger line kinds {unknown}"))
    by_kind = lines.group_by("line_kind").agg(pl.col("amount_nano").sum()).sort("line_kind")
    ledger_nano = int(lines["amount_nano"].sum())
    kinds = ", ".join(f"{kind} {amount}" for kind, amount in by_kind.iter_rows())
    if ledger_nano != invoice_nano:
        findings.append(
            MISMATCH.found(
                f"ledger lines sum to {ledger_nano} nano-dollars, the invoice is {invoice_nano}: "
                f"off by {ledger_nano - invoice_nano} ({kinds})"
            )
        )
    return [
        fold(
            (hour, pool.name, None),
            "money",
            f"{invoice_nano} nano-dollars (invoice)",
            f"{ledger_nano} nano-dollars in {lines.height} ledger lines",
            findings,
            passed_detail=f"ledger equals the invoice exactly ({kinds})",
            weights=pool.policies.weights,
        )
    ]


def _unreadable(
    hour: datetime, pool: Pool, invoice_rows: pl.DataFrame, lines: pl.DataFrame
) -> tuple[str, str, Finding] | None:
    """Why the hour's money cannot be summed (expected, observed, finding), or None: amounts
    that are not integers or are missing, or not exactly one invoice."""
    for table, frame in (("invoices", invoice_rows), ("ledger_lines", lines)):
        dtype = frame.schema["amount_nano"]
        if not dtype.is_integer():
            return (
                "integer nano-dollars",
                f"{table}.amount_nano is {dtype}",
                NOT_INTEGER.found(
                    f"{table}.amount_nano is {dtype}: money must be integer nano-dollars"
                ),
            )
        if frame["amount_nano"].null_count():
            return (
                "an amount on every row",
                f"{frame['amount_nano'].null_count()} null amounts",
                NULL_AMOUNT.found(f"{table} has rows without amount_nano for {hour_key(hour)}"),
            )
    if invoice_rows.height != 1:
        return (
            "one invoice",
            f"{invoice_rows.height} invoices",
            INVOICE_COUNT.found(
                f"expected exactly one invoice for pool {pool.name} hour {hour_key(hour)}, found {invoice_rows.height}"
            ),
        )
    return None
