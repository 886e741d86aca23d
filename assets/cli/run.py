"""`stepledger run`: every pool-hour of a data directory through the Dagster definitions."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import click
import dagster as dg
import duckdb

from assets.resources import warehouse_path
from assets.runner import execute_pool_hours, pool_hour_outcome
from pipeline.cli.dagster_instance import print_outcome
from pipeline.cli.options import data_dir_option, file_option
from pipeline.datadir import DataDir
from pipeline.reconcile import alerts, failed_checks
from pipeline.storage.warehouse import connect
from schemas.config import load_pools
from schemas.errors import StepledgerError
from schemas.units import hour_key, parse_hour_key


@dataclass(frozen=True)
class PoolHourRun:
    hour: datetime
    pool: str
    success: bool  # the Dagster run succeeded: no step failed and no check failed with ERROR
    held_back: bool  # a blocking check failed: the finance views leave the hour out
    failed_checks: list[str]  # "name: detail" of every failed check
    error: str | None  # the root cause of the first step failure that is not a failed check


class HoursHeldBack(click.ClickException):
    """Every pool-hour ran, and a failed blocking check held at least one back from finance:
    not a fault of the run, but not a result to pass as done either (exit status 8)."""

    exit_code = 8


class RunStopped(StepledgerError):
    """SIGTERM or SIGINT stopped `run_pool_hours` between pool-hours, or in one, which Dagster
    interrupted: its step in flight failed and rolled back, so the hour is as before the run or
    as its last finished step left it. `runs`: the pool-hours done, then the interrupted one
    (with its error) if any; `not_started` were never begun."""

    def __init__(
        self,
        signal_name: str,
        runs: list[PoolHourRun],
        interrupted: PoolHourRun | None,
        not_started: list[tuple[datetime, str]],
    ) -> None:
        self.runs = runs + ([interrupted] if interrupted else [])
        self.not_started = not_started
        parts = [f"stopped by {signal_name}: {len(runs)} pool-hour(s) done ({_listed(runs)})"]
        if interrupted:
            parts.append(f"interrupted and rolled back: {_listed([interrupted])}")
        parts.append(f"not started: {len(not_started)} ({_listed(not_started)})")
        super().__init__("; ".join(parts) + "; run those hours again to bill them")


def _listed(items: Sequence[PoolHourRun] | Sequence[tuple[datetime, str]]) -> str:
    keys = [(item.hour, item.pool) if isinstance(item, PoolHourRun) else item for item in items]
    return ", ".join(f"{hour_key(hour)} {pool}" for hour, pool in keys) or "none"


@contextmanager
def _stop_signals() -> Iterator[Callable[[], str | None]]:
    """SIGTERM and SIGINT noted, not raised, for the duration; yields a function returning the
    first one's name once one arrived. While a pool-hour runs, Dagster swaps in its own handler
    (it interrupts the step in flight), so the signals are read from the wakeup fd, which
    Python writes for every handled signal whichever handler runs."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    handlers = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    seen: list[str] = []

    def received() -> str | None:
        try:
            numbers = os.read(read_fd, 64)
        except BlockingIOError:
            numbers = b""
        seen.extend(signal.Signals(n).name for n in numbers if n in handlers)
        return seen[0] if seen else None

    try:
        yield received
    finally:
        signal.set_wakeup_fd(previous_fd)
        for number, handler in handlers.items():
            signal.signal(number, handler)
        os.close(read_fd)
        os.close(write_fd)


def run_pool_hours(
    data_dir: Path,
    hours: list[datetime],
    *,
    warehouse: Path | None = None,
    on_done: Callable[[PoolHourRun], None] | None = None,
    keep_stdout: bool = False,
) -> list[PoolHourRun]:
    """Materialize every (hour, pool) in order, in-process, on one ephemeral Dagster instance.

    A failed pool-hour owes on-call the same pages as under the daemon (`pipeline.reconcile.alerts`:
    recorded in the outbox, delivered now if the sink accepts, else by the delivery sensor or
    the next run). SIGTERM or SIGINT stops the run after the pool-hour in flight (interrupted
    and rolled back) and starts no other: `RunStopped` says which were done and which not.
    `keep_stdout`: pages the default sink would print go to stderr."""
    state_file = warehouse.resolve() if warehouse else warehouse_path(data_dir.resolve())
    # A sink configured wrong is refused before any pool-hour is billed, not after the first.
    sink = alerts.sink_from_env()
    if keep_stdout and isinstance(sink, alerts.JsonLinesSink) and sink.target is None:
        # Standard output is the caller's (run --json): pages printed go to stderr instead.
        sink = alerts.JsonLinesSink(sys.stderr)
    pools = load_pools(DataDir(data_dir).pools_file).pools
    pool_hours = [(hour, pool.name) for hour in hours for pool in pools]
    runs: list[PoolHourRun] = []
    with dg.DagsterInstance.ephemeral() as instance, _stop_signals() as stop_signal:
        if stopped := stop_signal():
            raise RunStopped(stopped, runs, None, pool_hours)
        # The generator starts a pool-hour only when asked for it: leaving the loop on a
        # signal leaves the rest unstarted.
        executions = execute_pool_hours(data_dir, hours, warehouse, instance)
        for index, (hour, pool, result) in enumerate(executions):
            run = PoolHourRun(hour=hour, pool=pool, **pool_hour_outcome(result))
            stopped = stop_signal()
            if stopped and not result.success:
                # Stopped on purpose, not a fault: on-call is not paged for it.
                error = f"interrupted by {stopped}: its step in flight was rolled back"
                interrupted = dataclasses.replace(run, error=error)
                if on_done:
                    on_done(interrupted)
                raise RunStopped(stopped, runs, interrupted, pool_hours[index + 1 :])
            _page(state_file, sink, run, result.run_id)
            runs.append(run)
            if on_done:
                on_done(run)
            if stopped := stopped or stop_signal():
                raise RunStopped(stopped, runs, None, pool_hours[index + 1 :])
    return runs


def _page(state_file: Path, sink: alerts.AlertSink, run: PoolHourRun, run_id: str) -> None:
    now = datetime.now(UTC)
    try:
        with connect(state_file) as con:
            if not run.success:
                findings = failed_checks(con, run.pool, run.hour)
                alerts.enqueue(
                    con, alerts.hour_alerts(findings, run.pool, run.hour, run_id, run.error, now)
                )
            alerts.deliver_due(con, sink, now)
    except (duckdb.Error, OSError) as err:
        _page_without_state(state_file, sink, run, run_id, err, now)


def _page_without_state(
    state_file: Path,
    sink: alerts.AlertSink,
    run: PoolHourRun,
    run_id: str,
    err: Exception,
    now: datetime,
) -> None:
    """The pipeline's state cannot be opened or written (a read-only or full data directory,
    a path that is no file): the outbox cannot hold what the run owes on-call, so the run's
    failure goes straight to the sink, which needs no disk for a webhook or standard output;
    when that fails too, it is said plainly. Either way the run goes on to the next pool-hour."""
    click.echo(
        f"{state_file}: the pipeline's state cannot be written ({err}); "
        f"{hour_key(run.hour)} {run.pool} cannot be recorded or its pages kept",
        err=True,
    )
    if run.success:
        return
    detail = "; ".join([*filter(None, [run.error]), *run.failed_checks])
    if str(err) not in detail:
        detail += f" ({state_file} cannot be written: {err})"
    owed = alerts.hour_alerts([], run.pool, run.hour, run_id, detail, now)
    try:
        for alert in owed:
            sink.send(alert)
    except (alerts.AlertDeliveryError, OSError) as failed:
        click.echo(
            f"on-call could not be paged for {hour_key(run.hour)} {run.pool} either: {failed}",
            err=True,
        )


def run_with_progress(
    data_dir: Path, hours: list[datetime], warehouse: Path | None = None, *, quiet: bool = False
) -> list[PoolHourRun]:
    """run_pool_hours with a rich progress bar and, unless quiet, one line per finished pool-hour."""
    from rich.console import Console
    from rich.progress import Progress

    # Quiet runs keep standard output for machine-readable results: the bar goes to stderr.
    console = Console(stderr=quiet)
    total = len(hours) * len(load_pools(DataDir(data_dir).pools_file).pools)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("ledger", total=total)

        def done(run: PoolHourRun) -> None:
            progress.advance(task)
            if not quiet:
                print_outcome(
                    console,
                    hour_key(run.hour),
                    run.pool,
                    held_back=run.held_back,
                    error=run.error,
                    failed_checks=run.failed_checks,
                )

        return run_pool_hours(data_dir, hours, warehouse=warehouse, on_done=done, keep_stdout=quiet)


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
            sorted({parse_hour_key(k) for k in hour_keys})
            if hour_keys
            else DataDir(data_dir).hours()
        )
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--hour") from err
    if not hours:
        raise click.ClickException(
            f"{DataDir(data_dir).gateway}: no hourly gateway files, so no hours to run"
        )
    try:
        runs = run_with_progress(data_dir, hours, warehouse, quiet=as_json)
    except RunStopped as stop:
        if as_json:
            click.echo(_as_json(stop.runs))
        raise click.ClickException(str(stop)) from None
    except alerts.AlertConfigError as err:
        raise click.ClickException(f"alert sink: {err}") from None
    if as_json:
        click.echo(_as_json(runs))
    if any(r.error for r in runs):
        raise click.ClickException("some pool-hours failed; see above")
    held = [r for r in runs if r.held_back]
    if held:
        raise HoursHeldBack(
            f"{len(held)} pool-hour(s) held back from finance by a failed blocking check "
            f"({_listed(held)}); on-call is paged with what to do"
        )


def _as_json(runs: list[PoolHourRun]) -> str:
    return json.dumps([dataclasses.asdict(r) | {"hour": hour_key(r.hour)} for r in runs], indent=2)
