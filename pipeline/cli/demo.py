"""`stepledger demo`: simulate the default pools, run every hour through the Dagster
definitions in-process, and print what each tenant cost and how reconciliation went."""

from __future__ import annotations

import shutil
from pathlib import Path

import click

from pipeline.cli.costs import cost_report, print_report
from pipeline.cli.run import run_with_progress

# Written into a demo's output directory, so a later demo may replace it (and nothing else).
DEMO_MARKER = ".stepledger-demo"


def prepare_out_dir(out: Path) -> None:
    """Make `out` ready for a fresh simulation: replace an earlier demo, refuse anything else."""
    if out.exists() and any(out.iterdir()):
        if not (out / DEMO_MARKER).is_file():
            raise click.ClickException(f"{out} exists and is not an earlier demo run: choose another --out")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / DEMO_MARKER).write_text("created by `stepledger demo`; the next demo into this directory replaces it\n")


@click.command("demo")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("demo-run"), show_default=True,
              help="directory for the simulated data, the Parquet lake and warehouse.duckdb")
@click.option("--hours", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="simulated hours (fractions allowed)")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--fault", "faults", multiple=True, metavar="NAME[=VALUE]",
              help="inject a fault into the simulation (repeatable), e.g. drop-records=0.01")
def demo_command(out: Path, hours: float, seed: int, faults: tuple[str, ...]) -> None:
    """Simulate the default pools and bill them, hour by hour, through the Dagster pipeline."""
    from rich.console import Console
    from rich.progress import Progress

    from pipeline.cli.run import hours_in_data
    from pipeline.simulator import FaultError, parse_fault, simulate
    from schemas.config import load_pools

    try:
        fault_values = dict(parse_fault(text) for text in faults)
    except FaultError as err:
        raise click.BadParameter(str(err), param_hint="--fault") from err
    prepare_out_dir(out)
    console = Console()
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"simulating {hours:g} h", total=1.0)
        summary = simulate(
            out, load_pools(), hours=hours, seed=seed, faults=fault_values,
            progress=lambda done, total: progress.update(task, completed=done / total),
        )
    console.print(f"simulated {summary.requests:,} requests, {summary.steps:,} steps into {out}")
    for name, what in summary.faults.items():
        console.print(f"  [yellow]fault[/yellow] {name}: {what}")
    runs = run_with_progress(out, hours_in_data(out))
    print_report(cost_report(out / "warehouse.duckdb", "tenant"), "costs by tenant (published hours)")
    held = sum(1 for r in runs if not r.success)
    console.print(
        f"{len(runs) - held} of {len(runs)} pool-hours published, {held} held back. "
        f"Query {out / 'warehouse.duckdb'} with DuckDB, or run `stepledger costs --data {out} --by feature`."
    )
