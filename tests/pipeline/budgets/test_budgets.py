"""Budget status and notices on a warehouse written by hand: spend is final lines of published
hours plus provisional lines of the others, each threshold crossed is told once."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import polars as pl

import pipeline.finance
from pipeline.budgets import budget_status, notify
from pipeline.datadir import DataDir
from pipeline.storage.warehouse import connect, insert_frame, transaction
from schemas.budgets import Budget, BudgetsFile

NOW = datetime(2026, 11, 16, 0, 0, tzinfo=UTC)  # half of November gone
PUBLISHED = datetime(2026, 11, 2, 5)
OPEN = datetime(2026, 11, 15, 23)


def _lines(hour: datetime, rows: list[tuple[str, str, str, int]]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "hour": [hour] * len(rows),
            "pool": ["p"] * len(rows),
            "tenant": [r[0] for r in rows],
            "feature": [r[1] for r in rows],
            "line_kind": [r[2] for r in rows],
            "amount_nano": [r[3] for r in rows],
            "new_tokens": [0] * len(rows),
            "cached_tokens": [0] * len(rows),
            "weights_version": ["w"] * len(rows),
            "policy_version": ["v"] * len(rows),
        }
    )


def _warehouse(root: Path) -> None:
    final = _lines(
        PUBLISHED, [("acme", "bot", "usage", 3_000), ("acme", "bot", "idle", 1_000)]
    ).with_columns(requests=pl.lit(1, dtype=pl.Int64))
    provisional = _lines(OPEN, [("acme", "bot", "usage", 2_000), ("acme", "docs", "usage", 500)])
    with connect(DataDir(root).state_file) as con, transaction(con):
        insert_frame(con, "ledger_lines", final)
        insert_frame(
            con,
            "invoices",
            pl.DataFrame(
                {
                    "hour": [PUBLISHED],
                    "pool": ["p"],
                    "gpus": [1],
                    "usd_per_gpu_hour": [1.0],
                    "amount_nano": [4_000],
                }
            ),
        )
        insert_frame(
            con,
            "reconciliation",
            pl.DataFrame(
                {
                    "hour": [PUBLISHED],
                    "pool": ["p"],
                    "check_name": ["money"],
                    "passed": [True],
                    "expected": [""],
                    "observed": [""],
                    "detail": [""],
                }
            ),
        )
        insert_frame(
            con,
            "provisional_lines",
            provisional.with_columns(batch_id=pl.lit("b"), priced_at=pl.lit(OPEN)),
        )


def test_spend_is_final_plus_provisional_and_each_crossing_is_told_once(tmp_path: Path):
    _warehouse(tmp_path)
    budgets = BudgetsFile(
        budgets=[
            Budget(tenant="acme", monthly_usd=Decimal("0.00001"), channel="#acme"),
            Budget(
                tenant="acme",
                feature="bot",
                monthly_usd=Decimal("0.000006"),
                channel="#a",
                daily_usd=Decimal("0.000004"),
            ),
        ]
    )
    with pipeline.finance.connect(tmp_path) as con:
        statuses = budget_status(con, budgets, NOW)
    seen = {(s.budget.label, s.period): s for s in statuses}
    tenant = seen[("acme", "month")]
    # 3000 + 1000 final, 2000 + 500 provisional: 6500 of 10000.
    assert (tenant.spent_nano, tenant.provisional_nano, tenant.crossed_pct) == (6_500, 2_500, [50])
    # Projected over the 30-day month from its first 15 days.
    assert tenant.projected_nano == 13_000
    bot = seen[("acme/bot", "month")]
    assert (bot.spent_nano, bot.crossed_pct) == (6_000, [50, 80, 100])
    # 16 November has no spend yet: the open hour is the 15th.
    day = seen[("acme/bot", "day")]
    assert (day.spent_nano, day.limit_nano, day.crossed_pct) == (0, 4_000, [])
    with connect(DataDir(tmp_path).state_file) as state:
        assert notify(state, statuses, budgets, NOW) == 4
        assert notify(state, statuses, budgets, NOW) == 0
        told = state.execute("SELECT count(*) FROM alert_outbox").fetchall()[0][0]
    assert told == 4
