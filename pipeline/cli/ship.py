"""`stepledger ship`: the sidecar beside an engine that moves its closed segments to the store."""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

import click

from pipeline.reconcile.alerts import sink_from_env
from pipeline.ship.shipper import Shipper, ship_pending
from pipeline.ship.store import STORE_VARIABLE, open_store
from schemas.errors import DataError

MIB = 1 << 20


@click.command("ship")
@click.option(
    "--outbox",
    type=click.Path(path_type=Path, file_okay=False),
    required=True,
    help="the engines' outbox on this node: closed segments under OUTBOX/<replica>/",
)
@click.option(
    "--store",
    envvar=STORE_VARIABLE,
    required=True,
    help=f"s3://bucket/prefix (default ${STORE_VARIABLE}); credentials from the environment",
)
@click.option("--pool", required=True, help="the engines' pool, named in a page")
@click.option(
    "--budget-mib",
    type=click.IntRange(min=1),
    default=2048,
    show_default=True,
    help="page on-call when the outbox holds more than this",
)
@click.option(
    "--interval", type=click.FloatRange(min=0.1), default=5.0, show_default=True, help="seconds"
)
@click.option("--once", is_flag=True, help="ship what is closed now, then exit")
def ship_command(
    outbox: Path, store: str, pool: str, budget_mib: int, interval: float, once: bool
) -> None:
    """Upload each closed segment of OUTBOX to the object store exactly once, verify it, then
    delete it locally. Runs until SIGTERM or SIGINT; killed at any point and started again, it
    loses and duplicates nothing. Runs at a lower CPU priority than the engine."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    os.nice(10)
    segment_store = open_store(store)
    if once:
        report = ship_pending(segment_store, outbox)
        for segment in report.shipped:
            click.echo(f"shipped {segment_store.uri}/{segment.key}")
        if report.failed:
            raise DataError("; ".join(report.failed))
        return
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    Shipper(segment_store, outbox, pool, budget_mib * MIB, sink_from_env(), interval).run(stop)
