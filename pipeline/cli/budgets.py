"""`stepledger budgets`: each budget's spend, thresholds crossed and projected month-end."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import click

import pipeline.finance
from pipeline.budgets import budget_status, notify
from pipeline.cli.options import data_dir_option, file_option
from pipeline.datadir import DataDir
from pipeline.live.price import PROVISIONAL_NOTE
from pipeline.reconcile import alerts
from pipeline.report.money import usd
from pipeline.storage import warehouse
from schemas.budgets import load_budgets


@click.command("budgets")
@data_dir_option(help="data directory whose warehouse holds the spend")
@file_option("--config", "budgets_file", required=True, help="the budgets file")
@click.option("--tenant", help="only this tenant's budgets")
@click.option(
    "--notify",
    "send",
    is_flag=True,
    help="put new crossings in the alert outbox, then deliver what it owes",
)
@click.option("--json", "as_json", is_flag=True, help="JSON lines instead of a table")
def budgets_command(
    data_dir: Path, budgets_file: Path, tenant: str | None, send: bool, as_json: bool
) -> None:
    """Spend against each budget this month (and day): final figures of published hours plus
    provisional usage of the others, the thresholds crossed and the projected month-end."""
    budgets = load_budgets(budgets_file)
    now = datetime.now(UTC)
    con = pipeline.finance.connect(data_dir)
    try:
        statuses = budget_status(con, budgets, now, tenant)
    finally:
        con.close()
    for status in statuses:
        if as_json:
            click.echo(json.dumps(status.as_json()))
            continue
        projected = (
            "" if status.projected_nano is None else f"  projected {usd(status.projected_nano)}"
        )
        crossed = ",".join(f"{p}%" for p in status.crossed_pct) or "-"
        click.echo(
            f"{status.budget.label:30} {status.period:5} {usd(status.spent_nano):>18} of "
            f"{usd(status.limit_nano):>18}  crossed {crossed}{projected}"
        )
    if not as_json and any(s.provisional_nano for s in statuses):
        click.echo(f"({PROVISIONAL_NOTE})")
    if send:
        with warehouse.connect(DataDir(data_dir).state_file) as state:
            told = notify(state, statuses, budgets, now)
            delivered = alerts.deliver_due(state, alerts.sink_from_env(), now)
        click.echo(
            f"{told} new notice(s) put in the alert outbox, {len(delivered)} alert(s) delivered",
            err=True,
        )
