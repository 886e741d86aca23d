"""`stepledger dev`: the Dagster webserver and daemon on a data directory (the demo's by default).

The Dagster instance is `DAGSTER_HOME` when it is set, else `<data>/dagster`
(pipeline.cli.dagster_instance): the history `stepledger demo` left there shows in the UI.

`dagster dev` runs in a process group of its own (assets.supervise); Ctrl-C or SIGTERM asks it
to stop, and whatever of the group is still alive 8 s later is killed, so no webserver, daemon
or code server outlives the command by more than that.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import click

from assets.supervise import supervise
from pipeline.cli.dagster_instance import (
    CODE_LOCATION,
    INSTANCE_TEMPLATE,
    instance_dir,
    prepare_instance,
)
from pipeline.cli.options import data_dir_option
from pipeline.datadir import DATA_ENV


@click.command("dev")
@data_dir_option(help="data directory the schedule and sensors work on")
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="address the webserver listens on (0.0.0.0 exposes it to the network)",
)
@click.option("--port", type=int, default=3000, show_default=True)
def dev_command(data_dir: Path, host: str, port: int) -> None:
    """The Dagster webserver, daemon (schedule, sensors, run queue) and code server on DATA.

    The instance is $DAGSTER_HOME when set, else DATA/dagster. Ctrl-C or SIGTERM stops all of it.
    """
    if not data_dir.is_dir():
        raise click.ClickException(
            f"{data_dir}: no such directory (run `stepledger demo` first, or pass --data)"
        )
    dagster = shutil.which("dagster", path=str(Path(sys.executable).parent)) or shutil.which(
        "dagster"
    )
    if dagster is None:
        raise click.ClickException(
            "the `dagster` command is not installed (pip install dagster-webserver)"
        )
    home = instance_dir(data_dir, dict(os.environ))
    if prepare_instance(home):
        click.echo(f"{home / 'dagster.yaml'}: created from {INSTANCE_TEMPLATE}", err=True)
    click.echo(f"Dagster instance: {home}; UI: http://{host}:{port}", err=True)
    env = {**os.environ, "DAGSTER_HOME": str(home), DATA_ENV: str(data_dir.resolve())}
    command = [dagster, "dev", "-m", CODE_LOCATION, "--host", host, "--port", str(port)]
    returncode, stopped = supervise(command, env)
    if not stopped and returncode != 0:
        raise SystemExit(returncode)
