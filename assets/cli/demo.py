"""`stepledger demo`: simulate the default pools, run every pool-hour through Dagster on a
persistent instance (OUT/dagster, or DAGSTER_HOME when set: `stepledger dev --data OUT` shows
its runs, partitions and checks), print what each tenant cost and how reconciliation went, and
write the HTML report."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from pipeline.cli.costs import print_report
from pipeline.cli.dagster_instance import (
    instance_dir,
    materialize_pool_hours,
    prepare_instance,
    print_outcome,
)
from pipeline.cli.options import DEMO_DIR, directory_option, workers_option
from pipeline.cli.stack import STACK_DIR
from pipeline.datadir import DataDir
from pipeline.finance.costs import cost_report

if TYPE_CHECKING:
    from rich.console import Console

    from pipeline.attribution.calibration import CalibrationEntry
    from schemas.config import PoolsFile

REPORT_NAME = "report.html"
# Written into a demo's output directory, so a later demo may replace it (and nothing else).
DEMO_MARKER = ".stepledger-demo"


def prepare_out_dir(out: Path) -> None:
    """Make `out` ready for a fresh simulation: replace an earlier demo, refuse anything else."""
    if out.exists() and any(out.iterdir()):
        if not (out / DEMO_MARKER).is_file():
            raise click.ClickException(
                f"{out} exists and is not an earlier demo run: choose another --out"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / DEMO_MARKER).write_text(
        "created by `stepledger demo`; the next demo into this directory replaces it\n"
    )


# The calibration sweep before billing (at most as long as the billed span): long enough for
# thousands of steps of every pool over mixed batch sizes, short enough to add seconds.
CALIBRATION_SWEEP_HOURS = 2 / 60


def calibrate_from_segments(segment_paths: list[Path], store_path: Path) -> list[CalibrationEntry]:
    """Fit the work model per (model, GPU type, engine version, driver version) in the
    segments and store each fit in `store_path` (what `stepledger calibrate` does)."""
    from pipeline.attribution.calibration import CalibrationStore, fit_decoded_log
    from pipeline.ingestion.decoder import read_segments

    log = read_segments(segment_paths)
    fits = fit_decoded_log(log.steps, log.slots, log.segments)
    store = CalibrationStore.load(store_path)
    entries = [store.put(*key, fit) for key, fit in fits.items()]
    store.save(store_path)
    return entries


def calibrate_fleet(
    out: Path, pools: PoolsFile, *, hours: float, seed: int, workers: int
) -> list[CalibrationEntry]:
    """Simulate a short clean sweep of the pools into `out/calibration-sweep` and store its
    fits in `out/calibration.yaml`, as a production fleet is calibrated before its engines
    bill: the calibration check then knows the fleet's engine version, and a version the
    fleet starts to report later (fault `new-engine-version`) is one nobody calibrated."""
    from pipeline.simulator import simulate

    sweep = out / "calibration-sweep"
    simulate(
        sweep, pools, hours=min(hours, CALIBRATION_SWEEP_HOURS), seed=seed + 1, workers=workers
    )
    return calibrate_from_segments(
        sorted(DataDir(sweep).outbox.glob("*/*.seg")), DataDir(out).calibration_file
    )


def print_calibration(console: Console, entries: list[CalibrationEntry]) -> None:
    for entry in entries:
        console.print(
            f"calibrated {entry.model} on {entry.gpu_type}, engine {entry.engine_version}, "
            f"driver {entry.driver_version}: R^2 {entry.r_squared:.3f} over {entry.n_steps:,} steps",
            markup=False,
        )


def bill_through_dagster(
    out: Path, hours: list[datetime], pools: PoolsFile, console: Console
) -> list[dict[str, Any]]:
    """Every pool-hour through the Dagster instance of `out`, one line per finished pool-hour."""
    from rich.progress import Progress

    home = instance_dir(out, dict(os.environ))
    prepare_instance(home)
    runs = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("ledger", total=len(hours) * len(pools.pools))
        for run in materialize_pool_hours(out, hours, home):
            progress.advance(task)
            runs.append(run)
            print_outcome(
                console,
                run["hour"],
                run["pool"],
                held_back=run["held_back"],
                error=run["error"],
                failed_checks=run["failed_checks"],
            )
    # Paths print as text (markup=False): a directory may be named like markup.
    console.print(
        f"Dagster history in {home}: `stepledger dev --data {out}` shows it", markup=False
    )
    page_failed_runs(out, runs)
    return runs


def page_failed_runs(out: Path, runs: list[dict[str, Any]]) -> None:
    """Page on-call for the failed pool-hours as the daemon's failure sensor does in
    production: record each one's pages in the outbox and deliver them through the sink the
    environment configures, linking the report the demo writes. Done once billing is over (the
    runner process holds the pipeline's state while it bills), and reported after the table."""
    from assets.cli.run import default_sink_to_stderr, report_pages
    from assets.partitions import partition_key
    from pipeline.reconcile import alerts, failed_checks
    from pipeline.storage.warehouse import connect
    from schemas.units import parse_hour_key

    state_file = DataDir(out).state_file
    now = datetime.now(UTC)
    with alerts.Courier(state_file, default_sink_to_stderr(alerts.sink_from_env())) as courier:
        with connect(state_file) as con:
            for run in runs:
                if run["success"]:
                    continue
                hour = parse_hour_key(run["hour"])
                links = alerts.links_for(
                    run["run_id"],
                    str(partition_key(hour, run["pool"])),
                    report=(out / REPORT_NAME).resolve().as_uri(),
                )
                findings = failed_checks(con, run["pool"], hour)
                owed = alerts.hour_alerts(
                    findings, run["pool"], hour, run["run_id"], run["error"], now, links
                )
                alerts.enqueue(con, owed)
        courier.wake()
    report_pages(courier)


def use_profile(profile: str, stack: Path, out: Path) -> None:
    """With the production profile, bill into `out` through the running stack in `stack`: a
    store of the demo's own on its server, and its Dagster instance; the runner, the report
    and finance's reads reach it through the environment."""
    if profile == "production":
        from pipeline.stack import demo_environment

        os.environ.update(demo_environment(stack, out))


# Where the production profile's demo moves the engines' outbox: the disk of the GPU node the
# segments are shipped from (its outbox where a data directory's is), which the pipeline
# never reads.
GPU_NODE = "gpu-node"


def ship_through_store(out: Path, console: Console) -> dict[str, Any]:
    """Ship the simulated segments as `stepledger ship` does beside the engines: the outbox
    moves to the GPU node's disk (OUT/gpu-node/outbox), each closed segment is put on the
    store (`STEPLEDGER_STORE`), verified and deleted there, and billing pulls them from the
    store into OUT/outbox. A segment that cannot be shipped stays on the node, unbilled, and
    is named."""
    from pipeline.ship.shipper import ship_pending
    from pipeline.ship.store import store_from_env

    store = store_from_env()
    if store is None:
        raise click.ClickException("--profile production: the stack gave no STEPLEDGER_STORE")
    node_outbox = DataDir(out / GPU_NODE).outbox
    node_outbox.parent.mkdir()
    DataDir(out).outbox.rename(node_outbox)
    with console.status(f"shipping the segments to {store.uri}"):
        report = ship_pending(store, node_outbox)
    size = sum(segment.size for segment in report.shipped)
    console.print(
        f"shipped {len(report.shipped)} segments ({size / 1e6:.1f} MB) from {node_outbox} "
        f"to {store.uri}",
        markup=False,
    )
    for failure in report.failed:
        console.print(f"  not shipped: {failure}", markup=False)
    return {
        "store": store.uri,
        "segments": len(report.shipped),
        "bytes": size,
        "failed": report.failed,
    }


def echo_json(**parts: Any) -> None:
    click.echo(json.dumps(parts, default=str, indent=2))


def price_provisionally(out: Path, pools: PoolsFile, console: Console) -> list[dict[str, Any]]:
    """Price the segments as `stepledger live` does while an hour runs, before it is billed:
    each tenant's provisional usage, which the hourly ledger then supersedes."""
    from pipeline.live.price import PROVISIONAL_NOTE
    from pipeline.live.service import LivePricer
    from pipeline.report.money import usd

    pricer = LivePricer(out, pools)
    con = pricer.open_warehouse()
    try:
        pricer.cycle(con)
        rows = con.execute(
            "SELECT tenant, CAST(sum(amount_nano) AS BIGINT) AS amount_nano FROM provisional_lines "
            "GROUP BY tenant ORDER BY amount_nano DESC, tenant"
        ).fetchall()
    finally:
        con.close()
    console.print(f"provisional usage before the hours are billed ({PROVISIONAL_NOTE}):")
    for tenant, amount in rows:
        console.print(f"  {tenant:24} {usd(amount):>16}", markup=False)
    return [{"tenant": tenant, "amount_nano": amount} for tenant, amount in rows]


@click.command("demo")
@directory_option(
    "--out",
    default=DEMO_DIR,
    help="directory for the simulated data, the Parquet lake, the warehouse and report.html",
)
@click.option(
    "--hours",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="simulated hours (fractions allowed)",
)
@click.option("--seed", type=int, default=1, show_default=True)
@click.option(
    "--fault",
    "faults",
    multiple=True,
    metavar="NAME[=VALUE]",
    help="inject a fault into the simulation (repeatable), e.g. drop-records=0.01",
)
@workers_option(2, help="processes simulating replicas in parallel (one per core)")
@click.option(
    "--profile",
    type=click.Choice(["embedded", "production"]),
    default="embedded",
    show_default=True,
    help="embedded: no server; production: through the running `stepledger stack` (--stack)",
)
@directory_option("--stack", default=STACK_DIR, help="the stack's directory (--profile production)")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="print one JSON object (calibration, simulation, runs, costs, report path) instead of tables",
)
def demo_command(
    out: Path,
    hours: float,
    seed: int,
    faults: tuple[str, ...],
    workers: int,
    profile: str,
    stack: Path,
    as_json: bool,
) -> None:
    """Simulate the default pools, calibrate them, bill them hour by hour through the Dagster
    pipeline, and write an HTML report (OUT/report.html)."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.text import Text

    from pipeline.report import Scope, write_report
    from pipeline.simulator import FaultError, parse_fault, simulate
    from schemas.config import load_pools

    try:
        fault_values = dict(parse_fault(text) for text in faults)
    except FaultError as err:
        raise click.BadParameter(str(err), param_hint="--fault") from err
    prepare_out_dir(out)
    use_profile(profile, stack, out)
    pools = load_pools()
    # With --json, standard output carries only the JSON; progress and status go to stderr.
    console = Console(stderr=as_json, quiet=as_json)
    with console.status("calibrating: a short clean sweep of every pool"):
        entries = calibrate_fleet(out, pools, hours=hours, seed=seed, workers=workers)
    print_calibration(console, entries)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"simulating {hours:g} h", total=1.0)
        summary = simulate(
            out,
            pools,
            hours=hours,
            seed=seed,
            faults=fault_values,
            workers=workers,
            progress=lambda done, total: progress.update(task, completed=done / total),
        )
    console.print(
        f"simulated {summary.requests:,} requests, {summary.steps:,} steps into {out}",
        markup=False,
    )
    for name, what in summary.faults.items():
        console.print(Text.assemble("  ", ("fault", "yellow"), f" {name}: {what}"))
    provisional = price_provisionally(out, pools, console)
    shipped = {"shipped": ship_through_store(out, console)} if profile == "production" else {}
    runs = bill_through_dagster(out, DataDir(out).hours(), pools, console)
    costs = cost_report(out, "tenant")
    if not as_json:
        print_report(costs, "costs by tenant (published hours)")
    held = sum(1 for r in runs if r["held_back"])
    console.print(
        f"{len(runs) - held} of {len(runs)} pool-hours published, {held} held back. "
        f"Query it with `stepledger sql --data {out}`, or run `stepledger costs --data {out} --by feature`.",
        markup=False,
    )
    report = out / REPORT_NAME
    with console.status("writing the report"):
        write_report(DataDir(out).state_file, pools, DataDir(out).lake, Scope.everything(), report)
    if as_json:
        echo_json(
            calibration=[dataclasses.asdict(e) for e in entries],
            simulation=dataclasses.asdict(summary),
            provisional=provisional,
            runs=runs,
            costs=costs,
            report=str(report),
            **shipped,
        )
        return
    # Plain, unwrapped: the path is meant to be copied.
    click.echo(f"report: {report}")
