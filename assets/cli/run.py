"""`stepledger run`: every pool-hour of a data directory through the Dagster definitions."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import click
import dagster as dg

from assets.resources import warehouse_path
from assets.runner import execute_pool_hours, pool_hour_outcome
from pipeline import alerts
from pipeline.cli.options import data_dir_option, file_option
from pipeline.datadir import hours_in_data, pools_file
from pipeline.hours import hour_key, parse_hour_key
from pipeline.reconcile import failed_checks
from pipeline.warehouse import connect
from schemas.config import load_pools


@dataclass(frozen=True)
class PoolHourRun:
    hour: datetime
    pool: str
    success: bool  # the Dagster run succeeded: no step failed and no check failed with ERROR
    held_back: bool  # a blocking check failed: the finance views leave the hour out
    failed_checks: list[str]  # "name: detail" of every failed check
    error: str | None  # the root cause of the first step failure that is not a failed check


def run_pool_hours(
    data_dir: Path,
    hours: list[datetime],
    *,
    warehouse: Path | None = None,
    on_done: Callable[[PoolHourRun], None] | None = None,
) -> list[PoolHourRun]:
    """Materialize every (hour, pool) in order, in-process, on one ephemeral Dagster instance.

    A failed pool-hour owes on-call the same pages as under the daemon (`pipeline.alerts`:
    recorded in the outbox, delivered now if the sink accepts, else by the delivery sensor or
    the next run)."""
    state_file = warehouse.resolve() if warehouse else warehouse_path(data_dir.resolve())
    runs = []
    with dg.DagsterInstance.ephemeral() as instance:
        for hour, pool, result in execute_pool_hours(data_dir, hours, warehouse, instance):
            run = PoolHourRun(hour=hour, pool=pool, **pool_hour_outcome(result))
            runs.append(run)
            _page(state_file, run, result.run_id)
            if on_done:
                on_done(run)
    return runs


def _page(state_file: Path, run: PoolHourRun, run_id: str) -> None:
    now = datetime.now(UTC)
    with connect(state_file) as con:
        if not run.success:
            findings = failed_checks(con, run.pool, run.hour)
            alerts.enqueue(
                con, alerts.hour_alerts(findings, run.pool, run.hour, run_id, run.error, now)
            )
        alerts.deliver_due(con, alerts.sink_from_env(), now)


def run_with_progress(
    data_dir: Path, hours: list[datetime], warehouse: Path | None = None, *, quiet: bool = False
) -> list[PoolHourRun]:
    """run_pool_hours with a rich progress bar and, unless quiet, one line per finished pool-hour."""
    from rich.console import Console
    from rich.progress import Progress

    # Quiet runs keep standard output for machine-readable results: the bar goes to stderr.
    console = Console(stderr=quiet)
    total = len(hours) * len(load_pools(pools_file(data_dir)).pools)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("ledger", total=total)

        def done(run: PoolHourRun) -> None:
            progress.advance(task)
            if quiet:
                return
            status = "[red]held back[/red]" if run.held_back else "[green]published[/green]"
            if run.error:
                status = f"[red]failed[/red]: {run.error.splitlines()[0]}"
            console.print(f"{hour_key(run.hour)} {run.pool}: {status}")
            for finding in run.failed_checks:
                shown = finding if len(finding) <= 150 else finding[:149] + "…"
                console.print(
                    f"    [yellow]check failed[/yellow] {shown}", overflow="ellipsis", no_wrap=True
                )

        return run_pool_hours(data_dir, hours, warehouse=warehouse, on_done=done)


@click.command("run")
@data_dir_option(
    help="directory with outbox/, gateway/, dcgm/ and pools.yaml (as `stepledger simulate` writes)",
    existing=True,
)
@click.option(
    "--hour",
    "hour_keys",
    multiple=True,
    metavar="YYYY-MM-DDTHH",
    help="an hour to (re)run; repeatable (default: every hour with a gateway file)",
)
@file_option("--warehouse", help="the pipeline's state file (default: DATA/pipeline.duckdb)")
@click.option(
    "--json", "as_json", is_flag=True, help="print one JSON object per pool-hour run, as an array"
)
def run_command(
    data_dir: Path, hour_keys: tuple[str, ...], warehouse: Path | None, as_json: bool
) -> None:
    """Ingest, attribute, publish and reconcile every pool-hour of DATA."""
    try:
        hours = (
            sorted({parse_hour_key(k) for k in hour_keys}) if hour_keys else hours_in_data(data_dir)
        )
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--hour") from err
    if not hours:
        raise click.ClickException(
            f"{data_dir / 'gateway'}: no hourly gateway files, so no hours to run"
        )
    runs = run_with_progress(data_dir, hours, warehouse, quiet=as_json)
    if as_json:
        click.echo(
            json.dumps([dataclasses.asdict(r) | {"hour": hour_key(r.hour)} for r in runs], indent=2)
        )
    if any(r.error for r in runs):
        raise click.ClickException("some pool-hours failed; see above")
