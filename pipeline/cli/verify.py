"""`stepledger verify`: every published pool-hour checked against what was published."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from pipeline.cli.options import TimeRange, data_dir_option, range_options
from pipeline.storage.integrity import sweep_warehouse
from pipeline.storage.read_only_files import PublishedFileChanged
from pipeline.storage.warehouse import warehouse_dir
from schemas.units import hour_key


@click.command("verify")
@data_dir_option(help="data directory whose warehouse is verified", existing=True)
@range_options("to verify")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per changed pool-hour")
def verify_command(data_dir: Path, period: TimeRange, as_json: bool) -> None:
    """Hash every data file of each published pool-hour and digest its rows, against the
    hashes and digest recorded when it was published. Each changed pool-hour is listed with
    the files that changed; exit status 5 if any did. Reads only."""
    started = time.perf_counter()
    sweep = sweep_warehouse(warehouse_dir(data_dir), period.start, period.end)
    seconds = time.perf_counter() - started
    for change in sweep.changed:
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "hour": hour_key(change.hour),
                        "pool": change.pool,
                        "finding": change.finding,
                        "detail": change.detail,
                    }
                )
            )
        else:
            click.echo(f"{hour_key(change.hour)} {change.pool}: {change.detail}")
    click.echo(
        f"{sweep.hours} published pool-hour(s) of {period.label()} verified, {sweep.files} data "
        f"file(s) hashed in {seconds:.2f} s: {len(sweep.changed)} changed",
        err=True,
    )
    if sweep.changed:
        changed = ", ".join(f"{change.pool} {hour_key(change.hour)}" for change in sweep.changed)
        raise PublishedFileChanged(
            f"published pool-hour(s) changed since publishing: {changed}; restore the named "
            "files under warehouse/data/ from a backup"
        )
