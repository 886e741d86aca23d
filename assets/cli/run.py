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
import duckdb

from assets.partitions import partition_key
from assets.resources import warehouse_path
from assets.runner import data_dir_instance, execute_pool_hours, pool_hour_outcome
from pipeline.cli.dagster_instance import print_outcome
from pipeline.cli.options import data_dir_option, file_option
from pipeline.cli.status import pool_hour_statuses
from pipeline.datadir import DataDir
from pipeline.reconcile import alerts, failed_checks
from pipeline.storage.warehouse import connect
from schemas.config import load_pools
from schemas.errors import StepledgerError
from schemas.units import hour_key, parse_hour_key, parse_range_bound


@dataclass(frozen=True)
class PoolHourRun:
    hour: datetime
    pool: str
    success: bool  # the Dagster run succeeded: no step failed and no check failed with ERROR
    held_back: bool  # a blocking check failed: the finance views leave the hour out
    failed_checks: list[str]  # "ERROR name: detail" or "WARN name: detail" of every failed check
    error: str | None  # the root cause of the first step failure that is not a failed check
    run_id: str  # the Dagster run


class HoursHeldBack(click.ClickException):
    """Every pool-hour ran, and a failed blocking check held at least one back from finance:
    not a fault of the run, but not a result to pass as done either (exit status 8)."""

    exit_code = 8


class RunStopped(StepledgerError):
    """SIGTERM or SIGINT stopped `run_pool_hours` between pool-hours, or in one, which Dagster
    interrupted: its step in flight failed and rolled back, so the hour is as before the run or
    as its last finished step left it (invoiced and not reconciled: held back), which its
    error says. `runs`: the pool-hours done, then the interrupted one
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
            parts.append(f"interrupted: {_listed([interrupted])} ({interrupted.error})")
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
    on_courier: Callable[[alerts.Courier], None] | None = None,
) -> list[PoolHourRun]:
    """Materialize every (hour, pool) in order, in-process, on the data directory's Dagster
    instance (assets.runner.data_dir_instance), so the UI shows the runs.

    A failed pool-hour owes on-call the same pages as under the daemon (`pipeline.reconcile.alerts`:
    recorded in the outbox and delivered by a courier thread while the next pool-hour bills,
    else by the delivery sensor or the next run); the run returns once the courier's last
    round is over. SIGTERM or SIGINT stops the run after the pool-hour in flight and starts no
    other: `RunStopped` says which were done and which not. `on_courier` is handed the
    courier, whose report says what became of the pages."""
    state_file = warehouse.resolve() if warehouse else warehouse_path(data_dir.resolve())
    # A sink configured wrong is refused before any pool-hour is billed, not after the first.
    sink = default_sink_to_stderr(alerts.sink_from_env())
    pools = load_pools(DataDir(data_dir).pools_file).pools
    pool_hours = [(hour, pool.name) for hour in hours for pool in pools]
    runs: list[PoolHourRun] = []
    # The instance first: a disk it cannot be written to stops the run before the courier
    # creates the state file there, which a full disk would leave empty and unopenable.
    with (
        data_dir_instance(data_dir) as instance,
        alerts.Courier(state_file, sink) as courier,
        _stop_signals() as stop_signal,
    ):
        if on_courier:
            on_courier(courier)
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
                interrupted = dataclasses.replace(run, error=interruption(stopped, state_file, run))
                if on_done:
                    on_done(interrupted)
                raise RunStopped(stopped, runs, interrupted, pool_hours[index + 1 :])
            _page(state_file, courier, run)
            runs.append(run)
            if on_done:
                on_done(run)
            if stopped := stopped or stop_signal():
                raise RunStopped(stopped, runs, None, pool_hours[index + 1 :])
    return runs


def interruption(signal_name: str, state_file: Path, run: PoolHourRun) -> str:
    """What a pool-hour interrupted by a signal left: its step in flight rolled back, and the
    steps before it stay committed, so the hour may be invoiced but not reconciled (held
    back), or as published as before."""
    try:
        standing = [
            status
            for status in pool_hour_statuses(
                state_file, run.hour, parse_range_bound(hour_key(run.hour), end=True)
            )
            if status.pool == run.pool
        ]
    except (StepledgerError, duckdb.Error) as err:
        return f"interrupted by {signal_name}: its step in flight rolled back ({err})"
    left = "the hour has no invoice: nothing of it is published"
    for status in standing:
        left = f"the hour is {status.standing}" + (
            f" ({status.reason})" if status.standing == "held back" else ""
        )
    return (
        f"interrupted by {signal_name}: its step in flight rolled back, the steps before it "
        f"stay committed; {left}"
    )


def default_sink_to_stderr(sink: alerts.AlertSink) -> alerts.AlertSink:
    """The sink, but pages the default sink would print go to standard error: standard output
    is the command's table (or its JSON), which pages printed as they are delivered would cut."""
    if isinstance(sink, alerts.JsonLinesSink) and sink.target is None:
        return alerts.JsonLinesSink(sys.stderr)
    return sink


def _page(state_file: Path, courier: alerts.Courier, run: PoolHourRun) -> None:
    """Record what a failed pool-hour owes on-call in the outbox and wake the courier, which
    delivers it apart from billing."""
    now = datetime.now(UTC)
    links = alerts.links_for(run.run_id, str(partition_key(run.hour, run.pool)))
    try:
        with connect(state_file) as con:
            if not run.success:
                findings = failed_checks(con, run.pool, run.hour)
                owed = alerts.hour_alerts(
                    findings, run.pool, run.hour, run.run_id, run.error, now, links
                )
                alerts.enqueue(con, owed)
    except (duckdb.Error, OSError) as err:
        _page_without_state(state_file, courier, run, err, now, links)
    courier.wake()


def _page_without_state(
    state_file: Path,
    courier: alerts.Courier,
    run: PoolHourRun,
    err: Exception,
    now: datetime,
    links: tuple[alerts.Link, ...],
) -> None:
    """The pipeline's state cannot be opened or written (a read-only or full data directory,
    a path that is no file): the outbox cannot hold what the run owes on-call, so the run's
    failure goes straight to the sink, which needs no disk for a webhook or standard error;
    the courier says plainly when that fails too. Either way the run goes on to the next
    pool-hour."""
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
    courier.send(alerts.hour_alerts([], run.pool, run.hour, run.run_id, detail, now, links))


def run_with_progress(
    data_dir: Path, hours: list[datetime], warehouse: Path | None = None, *, quiet: bool = False
) -> list[PoolHourRun]:
    """run_pool_hours with a rich progress bar and, unless quiet, one line per finished
    pool-hour; what was paged is reported after them, on standard error."""
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

        couriers: list[alerts.Courier] = []
        try:
            return run_pool_hours(
                data_dir, hours, warehouse=warehouse, on_done=done, on_courier=couriers.append
            )
        finally:
            for courier in couriers:
                report_pages(courier)


def report_pages(courier: alerts.Courier) -> None:
    """After the table, on standard error: what was paged, and what could not be."""
    if courier.delivered:
        click.echo(
            f"paged on-call: {len(courier.delivered)} alert(s) delivered to {courier.sink!r}",
            err=True,
        )
    for line in courier.report:
        click.echo(line, err=True)


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
