"""Budgets: spend against each budget of the budgets file (schemas.budgets), its projected
month-end, and notices through the alert outbox at each threshold crossed, once per crossing and
destination: to the budget's channel (a webhook of the budgets file's `channels`), and to
on-call as well when the budget says `page_on_call`.

Spend is the final lines of published hours plus the provisional usage of the others
(`spend_lines`), so a budget is seen crossing while the hour runs; provisional usage leaves
out idle and headroom until the hour closes. A notice's dedup key is the budget, period,
threshold and destination: the outbox (pipeline.reconcile.alerts) records each key once, with
the destination, so a crossing is told once to each however often budgets are checked, across
restarts too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import duckdb

from pipeline.live.price import PROVISIONAL_NOTE
from pipeline.reconcile.alerts import Alert, dedup_key, enqueue
from pipeline.report.money import usd
from schemas.budgets import Budget, BudgetsFile
from schemas.units import to_warehouse

Period = Literal["month", "day"]
PERIOD_NAMES: dict[Period, str] = {"month": "monthly", "day": "daily"}
# Notices below the last threshold warn; the last one (the budget spent) is an error.
NOTICE_KIND = "budget"


@dataclass(frozen=True)
class BudgetStatus:
    """One budget over one period: its limit, what is spent (final + provisional), the
    provisional part, the month's projected end (monthly budgets) and the thresholds crossed."""

    budget: Budget
    period: Period
    period_start: datetime
    limit_nano: int
    spent_nano: int
    provisional_nano: int
    projected_nano: int | None
    crossed_pct: list[int]

    def as_json(self) -> dict[str, Any]:
        return {
            "tenant": self.budget.tenant,
            "feature": self.budget.feature,
            "period": self.period,
            "period_start": self.period_start.isoformat(),
            "limit_nano": self.limit_nano,
            "spent_nano": self.spent_nano,
            "provisional_nano": self.provisional_nano,
            "spent_pct": round(100 * self.spent_nano / self.limit_nano, 2),
            "projected_nano": self.projected_nano,
            "crossed_pct": self.crossed_pct,
            "note": PROVISIONAL_NOTE if self.provisional_nano else None,
        }


def _month_start(now: datetime) -> datetime:
    return now.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def _spend(
    con: duckdb.DuckDBPyConnection, month: datetime, day: datetime
) -> dict[tuple[str, str], tuple[int, int, int]]:
    """(tenant, feature) -> (month's spend, day's spend, month's provisional spend)."""
    next_month = (month + timedelta(days=32)).replace(day=1)
    rows = con.execute(
        "SELECT tenant, feature, CAST(sum(amount_nano) AS BIGINT), "
        "CAST(coalesce(sum(amount_nano) FILTER (hour >= ?), 0) AS BIGINT), "
        "CAST(coalesce(sum(amount_nano) FILTER (basis = 'provisional'), 0) AS BIGINT) "
        "FROM spend_lines WHERE hour >= ? AND hour < ? GROUP BY ALL",
        [to_warehouse(day), to_warehouse(month), to_warehouse(next_month)],
    ).fetchall()
    return {(tenant, feature): (m, d, p) for tenant, feature, m, d, p in rows}


def budget_status(
    con: duckdb.DuckDBPyConnection,
    budgets: BudgetsFile,
    now: datetime,
    tenant: str | None = None,
) -> list[BudgetStatus]:
    """Every budget (of `tenant`, when given) for its month and, if it has one, its day."""
    month = _month_start(now)
    day = now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    spend = _spend(con, month, day)
    month_ns = ((month + timedelta(days=32)).replace(day=1) - month) // timedelta(microseconds=1)
    # At least an hour elapsed: the first minutes of a month would project absurdly.
    elapsed = max(now - month, timedelta(hours=1)) // timedelta(microseconds=1)
    statuses = []
    for budget in budgets.budgets:
        if tenant is not None and budget.tenant != tenant:
            continue
        mine = [
            v
            for (t, f), v in spend.items()
            if t == budget.tenant and (budget.feature is None or f == budget.feature)
        ]
        spent_month, spent_day, provisional = (sum(v[i] for v in mine) for i in range(3))
        periods: list[tuple[Period, datetime, int, int, int | None]] = [
            ("month", month, budget.monthly_nano, spent_month, spent_month * month_ns // elapsed)
        ]
        if budget.daily_nano is not None:
            periods.append(("day", day, budget.daily_nano, spent_day, None))
        for period, start, limit, spent, projected in periods:
            statuses.append(
                BudgetStatus(
                    budget=budget,
                    period=period,
                    period_start=start,
                    limit_nano=limit,
                    spent_nano=spent,
                    provisional_nano=min(provisional, spent),
                    projected_nano=projected,
                    crossed_pct=[
                        pct for pct in budgets.thresholds_pct if spent * 100 >= pct * limit
                    ],
                )
            )
    return statuses


def crossing_notices(
    statuses: list[BudgetStatus], budgets: BudgetsFile, now: datetime
) -> list[Alert]:
    """The notices of every threshold each budget period has crossed (the outbox keeps the
    first of each): one to the budget's channel, and one to on-call when it `page_on_call`."""
    thresholds_pct = budgets.thresholds_pct
    notices = []
    for status in statuses:
        budget = status.budget
        channel = budgets.channels[budget.channel]
        told = f"{budget.channel}{' and on-call' if budget.page_on_call else ''}"
        for pct in status.crossed_pct:
            finding = f"{status.period}-{pct}pct"
            projected = (
                f"; projected month-end {usd(status.projected_nano)}"
                if status.projected_nano is not None
                else ""
            )
            notice = Alert(
                raised_at=now,
                severity="ERROR" if pct >= thresholds_pct[-1] else "WARN",
                kind=NOTICE_KIND,
                hour=status.period_start,
                pool=budget.tenant,
                replica=budget.feature,
                finding=finding,
                detail=(
                    f"{budget.label} has spent {usd(status.spent_nano)} of its {PERIOD_NAMES[status.period]} "
                    f"budget {usd(status.limit_nano)} ({pct}% threshold crossed){projected}; "
                    f"{usd(status.provisional_nano)} of it provisional (idle and headroom "
                    f"of open hours not included); for {told}"
                ),
                # On-call's key is the one notices had when on-call was their only destination.
                dedup_key=dedup_key(
                    NOTICE_KIND, status.period_start, budget.tenant, budget.feature, finding
                ),
            )
            notices.append(
                replace(
                    notice,
                    destination=budget.channel,
                    destination_env=channel.webhook_url_env,
                    dedup_key=dedup_key(
                        NOTICE_KIND,
                        status.period_start,
                        budget.tenant,
                        budget.feature,
                        f"{finding} to {budget.channel}",
                    ),
                )
            )
            if budget.page_on_call:
                notices.append(notice)
    return notices


def notify(
    state_con: duckdb.DuckDBPyConnection,
    statuses: list[BudgetStatus],
    budgets: BudgetsFile,
    now: datetime,
) -> int:
    """Put the notices of every crossing not told yet, to each of its destinations, into the
    alert outbox of the pipeline's state (`state_con`); returns how many were new. Whatever
    delivers the outbox (`pipeline.reconcile.alerts.deliver_due`) posts each to its own."""
    return enqueue(state_con, crossing_notices(statuses, budgets, now))
