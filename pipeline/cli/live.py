"""`stepledger live`: price segments as they close, publishing provisional costs and budgets."""

from __future__ import annotations

import signal
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from pipeline.budgets import budget_status, notify
from pipeline.cli.options import data_dir_option, file_option
from pipeline.datadir import DataDir
from pipeline.live.price import PROVISIONAL_NOTE
from pipeline.live.service import DEFAULT_INTERVAL_S, CycleReport, LivePricer, serve_forever
from pipeline.report.money import usd
from pipeline.storage import warehouse
from schemas.budgets import load_budgets
from schemas.config import load_pools


@click.command("live")
@data_dir_option(help="data directory whose outbox and gateway files are priced", existing=True)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=DEFAULT_INTERVAL_S,
    show_default=True,
    help="seconds between looks at the outbox when nothing new closed",
)
@file_option("--budgets", "budgets_file", help="budgets file: notify crossings after each cycle")
@click.option("--once", is_flag=True, help="price what has closed, then exit")
def live_command(data_dir: Path, interval: float, budgets_file: Path | None, once: bool) -> None:
    """Price every closed segment as it arrives, with the hourly path's kernel, weights and
    allocator, and publish provisional request costs and tenant spend to the warehouse.
    Provisional figures hold usage only (idle and headroom are known when the hour closes);
    the hourly ledger supersedes them. Safe to restart: a segment is priced once."""
    layout = DataDir(data_dir)
    pricer = LivePricer(data_dir, load_pools(layout.pools_file))
    budgets = load_budgets(budgets_file) if budgets_file is not None else None

    def report(cycle: CycleReport) -> None:
        hours = ", ".join(h.strftime("%Y-%m-%dT%H") for h in cycle.hours)
        click.echo(
            f"priced {cycle.segments} segment(s), {cycle.steps} steps, {cycle.requests} request "
            f"rows: {usd(cycle.amount_nano)} of usage in {hours} ({PROVISIONAL_NOTE})"
        )
        if budgets is not None and budgets.budgets:
            now = datetime.now(UTC)
            with warehouse.connect_read_only(layout.state_file) as reader:
                statuses = budget_status(reader, budgets, now)
            with warehouse.connect(layout.state_file) as state:
                told = notify(state, statuses, budgets, now)
            if told:
                click.echo(f"{told} budget notice(s) put in the alert outbox")

    if once:
        con = pricer.open_warehouse()
        try:
            cycle = pricer.cycle(con)
        finally:
            con.close()
        if cycle is None:
            click.echo("no new closed segments")
        else:
            report(cycle)
        return
    stop = threading.Event()

    def stopping(signum: int, frame: Any) -> None:
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stopping)
    serve_forever(pricer, stop, interval_s=interval, on_cycle=report)
