"""The unattributed check: the share of the hour's usage without tenant context."""

from __future__ import annotations

from datetime import datetime

import polars as pl

from pipeline.reconcile.facts import HourFacts
from pipeline.reconcile.findings import OVER_THRESHOLD
from pipeline.reconcile.frames import rows_of_hour
from pipeline.reconcile.result import CheckResult, fold
from schemas.config import Pool

# Line kinds that charge work done for requests (the denominator of the unattributed share).
WORK_LINE_KINDS = ("usage", "unattributed", "platform_retry")


def run(facts: HourFacts) -> list[CheckResult]:
    """The unattributed check of the gathered pool-hour."""
    return check_unattributed(facts.hour, facts.pool, facts.ledger_lines)


def check_unattributed(hour: datetime, pool: Pool, ledger_lines: pl.DataFrame) -> list[CheckResult]:
    """The share of the hour's usage charges without tenant context, against the pool's threshold.

    Usage is the work charged to requests (line kinds usage, unattributed, platform_retry);
    idle, headroom and cache credits are not usage.
    """
    threshold = pool.policies.unattributed_alert_fraction
    lines = rows_of_hour(ledger_lines, hour, pool.name, "ledger_lines").filter(
        pl.col("line_kind").is_in(WORK_LINE_KINDS)
    )
    usage_nano = int(lines["amount_nano"].sum())
    orphan = lines.filter(pl.col("line_kind") == "unattributed")
    orphan_nano = int(orphan["amount_nano"].sum())
    orphan_requests = int(orphan["requests"].sum())
    share = orphan_nano / usage_nano if usage_nano else 0.0
    expected = f"at most {threshold:.2%} of usage unattributed"
    observed = (
        f"{share:.2%}: {orphan_nano} of {usage_nano} nano-dollars, {orphan_requests} requests"
    )
    findings = []
    if share > threshold:
        findings.append(
            OVER_THRESHOLD.found(
                f"{share:.2%} of the hour's usage ({orphan_nano} of {usage_nano} nano-dollars, "
                f"{orphan_requests} requests) has no tenant context, above the pool's "
                f"{threshold:.2%}: requests are missing from the gateway context log"
            )
        )
    return [
        fold(
            (hour, pool.name, None),
            "unattributed",
            expected,
            observed,
            findings,
            passed_detail="no usage in the hour"
            if not usage_nano
            else f"{share:.2%} of usage unattributed",
            weights=pool.policies.weights,
        )
    ]
