"""Budget status and notices on a warehouse written by hand: spend is final lines of published
hours plus provisional lines of the others, each threshold crossed is told once to each of its
destinations (the tenant's channel, and on-call where configured), through real local
webhooks."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import polars as pl

import pipeline.finance
from pipeline.budgets import budget_status, notify
from pipeline.datadir import DataDir
from pipeline.reconcile.alerts import deliver_due, sink_from_env
from pipeline.storage.warehouse import connect, insert_frame, transaction
from schemas.budgets import Budget, BudgetsFile, Channel
from tests.helpers.webhooks import RecordingSink

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
        channels={
            "#acme": Channel(webhook_url_env="ACME_WEBHOOK_URL"),
            "#a": Channel(webhook_url_env="A_WEBHOOK_URL"),
        },
        budgets=[
            Budget(tenant="acme", monthly_usd=Decimal("0.00001"), channel="#acme"),
            Budget(
                tenant="acme",
                feature="bot",
                monthly_usd=Decimal("0.000006"),
                channel="#a",
                daily_usd=Decimal("0.000004"),
            ),
        ],
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


# Crossings of NOW's statuses (test above): acme's month at 50%, acme/bot's month at 50, 80, 100%.
TENANT_CROSSINGS = [("acme", "month-50pct")]
FEATURE_CROSSINGS = sorted(("acme/bot", f"month-{pct}pct") for pct in (50, 80, 100))


def channel_budgets() -> BudgetsFile:
    """acme's budget tells #acme and pages on-call; acme/bot's tells #acme-bot only."""
    return BudgetsFile(
        channels={
            "#acme": Channel(webhook_url_env="ACME_SPEND_WEBHOOK_URL"),
            "#acme-bot": Channel(webhook_url_env="ACME_BOT_WEBHOOK_URL"),
        },
        budgets=[
            Budget(
                tenant="acme", monthly_usd=Decimal("0.00001"), channel="#acme", page_on_call=True
            ),
            Budget(
                tenant="acme", feature="bot", monthly_usd=Decimal("0.000006"), channel="#acme-bot"
            ),
        ],
    )


def told(sink: RecordingSink) -> list[tuple[str, str]]:
    """(budget, crossing) of each notice a Slack-compatible webhook received, sorted (notices
    raised together are delivered in the order of their dedup keys)."""
    found = []
    for body in sink.bodies:
        notice = re.match(
            r"\[(?:WARN|ERROR)\] stepledger budget failed for (\S+) hour \S+: .* \((\d+)% threshold",
            body["text"],
        )
        assert notice is not None, body
        label, crossing = notice.groups()
        found.append((label, f"month-{crossing}pct"))
    return sorted(found)


def check_and_deliver(data: Path, budgets: BudgetsFile, env: dict[str, str]) -> int:
    """What `stepledger budgets --notify` does, in a process of its own: the state reopened."""
    with pipeline.finance.connect(data) as con:
        statuses = budget_status(con, budgets, NOW)
    with connect(DataDir(data).state_file) as state:
        added = notify(state, statuses, budgets, NOW)
        deliver_due(state, sink_from_env(env), NOW, env)
    return added


def test_each_crossing_reaches_the_tenants_channel_and_on_call_once_each(tmp_path: Path):
    _warehouse(tmp_path)
    budgets = channel_budgets()
    with (
        RecordingSink("/hooks/acme") as acme,
        RecordingSink("/hooks/acme-bot") as bot,
        RecordingSink("/hooks/on-call") as on_call,
    ):
        env = {
            "ACME_SPEND_WEBHOOK_URL": acme.url,
            "ACME_BOT_WEBHOOK_URL": bot.url,
            "STEPLEDGER_ALERT_WEBHOOK_URL": on_call.url,
            "STEPLEDGER_ALERT_FORMAT": "slack",
        }
        assert check_and_deliver(tmp_path, budgets, env) == 5
        # Checked again, as after a restart: nothing new is owed, nothing is sent again.
        assert check_and_deliver(tmp_path, budgets, env) == 0
    assert told(acme) == TENANT_CROSSINGS
    assert told(bot) == FEATURE_CROSSINGS
    assert told(on_call) == TENANT_CROSSINGS
    assert acme.bodies[0]["text"].endswith("; for #acme and on-call")
    with connect(DataDir(tmp_path).state_file) as state:
        recorded = state.execute(
            "SELECT alert->>'destination', alert->>'destination_env', count(*), "
            "count(delivered_at) FROM alert_outbox GROUP BY ALL ORDER BY ALL NULLS FIRST"
        ).fetchall()
    # The outbox names each notice's destination and the variable of its URL, never the URL.
    assert recorded == [
        (None, None, 1, 1),
        ("#acme", "ACME_SPEND_WEBHOOK_URL", 1, 1),
        ("#acme-bot", "ACME_BOT_WEBHOOK_URL", 3, 3),
    ]


def test_a_channel_without_its_url_stays_owed_and_holds_up_no_other(tmp_path: Path):
    _warehouse(tmp_path)
    budgets = channel_budgets()
    with RecordingSink("/hooks/acme") as acme, RecordingSink("/hooks/on-call") as on_call:
        env = {
            "ACME_SPEND_WEBHOOK_URL": acme.url,
            "STEPLEDGER_ALERT_WEBHOOK_URL": on_call.url,
            "STEPLEDGER_ALERT_FORMAT": "slack",
        }
        assert check_and_deliver(tmp_path, budgets, env) == 5
    assert (told(acme), told(on_call)) == (TENANT_CROSSINGS, TENANT_CROSSINGS)
    with connect(DataDir(tmp_path).state_file) as state:
        owed = state.execute(
            "SELECT attempts, last_error FROM alert_outbox WHERE delivered_at IS NULL"
        ).fetchall()
    # The first of #acme-bot's notices was tried and refused; the channel got no more tries.
    assert sorted(owed) == [(0, None), (0, None), (1, CHANNEL_UNSET)]

    with RecordingSink("/hooks/acme-bot") as bot:
        later = NOW + timedelta(minutes=1)
        with connect(DataDir(tmp_path).state_file) as state:
            deliver_due(state, sink_from_env({}), later, {"ACME_BOT_WEBHOOK_URL": bot.url})
    assert told(bot) == FEATURE_CROSSINGS


CHANNEL_UNSET = (
    "channel #acme-bot: ACME_BOT_WEBHOOK_URL (its webhook URL) is not set in the environment "
    "of the process delivering alerts"
)
