"""`stepledger simulate`: write a run directory of simulated pools."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import click

from pipeline.cli.options import directory_option, file_option, workers_option
from pipeline.simulator.faults import FAULTS, FaultError, parse_fault
from schemas.config import DEFAULT_POOLS_PATH, PoolsFile, load_pools

if TYPE_CHECKING:
    from rich.console import Console

    from pipeline.simulator.run import SimulationSummary


def _fault_help() -> str:
    lines = [
        f"{name}{f'[={value_name}]' if value_name else ''} ({help_text}"
        + (f"; default {default:g})" if default is not None else ")")
        for name, (default, value_name, help_text) in FAULTS.items()
    ]
    return "Inject a fault, repeatable: " + "; ".join(lines) + "."


def _parse_start(ctx: click.Context, param: click.Parameter, value: str) -> datetime:
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as err:
        raise click.BadParameter(f"{value!r} is not an ISO time such as 2026-11-30T00:00Z") from err
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    moment = moment.astimezone(UTC)
    if (moment.minute, moment.second, moment.microsecond) != (0, 0, 0):
        raise click.BadParameter(f"{value!r} is not on the hour")
    return moment


@click.command("simulate")
@directory_option(
    "--out", "out_dir", required=True, help="Run directory to create (must not already hold a run)."
)
@click.option(
    "--hours",
    type=click.FloatRange(min=0.0, min_open=True),
    required=True,
    help="Simulated hours (fractions allowed).",
)
@click.option(
    "--seed", type=int, required=True, help="Random seed: the same seed gives the same data."
)
@file_option(
    "--pools",
    "pools_path",
    default=DEFAULT_POOLS_PATH,
    help="Pools file describing pools, replicas and workloads.",
)
@click.option(
    "--start",
    default="2026-11-30T00:00Z",
    show_default=True,
    callback=_parse_start,
    help="UTC start of the span, on the hour.",
)
@workers_option(
    1, help="Processes simulating replicas side by side (the data does not depend on it)."
)
@click.option("--fault", "fault_texts", multiple=True, metavar="NAME[=VALUE]", help=_fault_help())
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the summary as one JSON object instead of a table.",
)
def simulate_command(
    out_dir: Path,
    hours: float,
    seed: int,
    pools_path: Path,
    start: datetime,
    workers: int,
    fault_texts: tuple[str, ...],
    as_json: bool,
) -> None:
    """Simulate inference pools: step segments per replica (through the real StepRecorder),
    gateway request context and DCGM exporter scrapes, as production would deliver them.

    Faults aimed at one replica hit the first replica of the first pool with traffic
    (idle-replica: the last replica of the first pool with several); the summary names them.
    """
    from rich.console import Console

    faults = dict(parse_fault(text) for text in fault_texts)
    pools = load_pools(pools_path)

    # With --json, standard output carries only the JSON; the progress bar goes to stderr.
    console = Console(stderr=as_json)
    if not console.is_terminal:
        console.width = 160
    try:
        summary = _simulate_with_progress(
            console,
            out_dir,
            pools,
            hours=hours,
            seed=seed,
            start=start,
            faults=faults,
            workers=workers,
        )
    except (FaultError, FileExistsError, ValueError) as err:
        raise click.ClickException(str(err)) from err
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(summary), default=str, indent=2))
    else:
        _print_summary(console, summary, out_dir)


def _simulate_with_progress(
    console: Console,
    out_dir: Path,
    pools: PoolsFile,
    *,
    hours: float,
    seed: int,
    start: datetime,
    faults: dict[str, float | None],
    workers: int,
) -> SimulationSummary:
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from pipeline.simulator import simulate

    columns = (
        TextColumn("simulating"),
        BarColumn(),
        TextColumn("{task.completed:,.0f}/{task.total:,.0f} replica-s"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(
            "simulate", total=hours * 3600 * sum(len(p.streams) for p in pools.pools)
        )

        def progress(done: float, total: float) -> None:
            bar.update(task, completed=done, total=total)

        return simulate(
            out_dir,
            pools,
            hours=hours,
            seed=seed,
            start=start,
            faults=faults,
            progress=progress,
            workers=workers,
        )


def _print_summary(console: Console, summary: SimulationSummary, out_dir: Path) -> None:
    from rich.table import Table
    from rich.text import Text

    # Text, not markup, wherever a path or a name from the pools file is shown.
    table = Table(
        title=Text(f"{summary.requests:,} requests, {summary.steps:,} steps -> {out_dir}")
    )
    for column in (
        "pool",
        "replica",
        "requests",
        "finished",
        "steps",
        "dropped",
        "busy",
        "gpu busy",
        "preempted",
        "blocked steps",
    ):
        table.add_column(column, justify="left" if column in ("pool", "replica") else "right")
    for r in summary.replicas:
        table.add_row(
            Text(r.pool),
            Text(r.replica),
            f"{r.requests:,}",
            f"{r.finished:,}",
            f"{r.steps:,}",
            f"{r.dropped_steps:,}",
            f"{r.busy_fraction:.1%}",
            f"{r.gpu_busy_fraction:.1%}",
            f"{r.preemptions:,}",
            f"{r.admission_blocked_steps:,}",
        )
    console.print(table)
    console.print(f"gateway lines: {summary.gateway_lines:,} of {summary.requests:,} requests")
    for name, what in summary.faults.items():
        console.print(f"fault {name}: {what}", markup=False)
