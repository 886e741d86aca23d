"""`stepledger dev`: the Dagster webserver and daemon on a data directory (the demo's by default).

The Dagster instance is `DAGSTER_HOME` when it is set, else `<data>/dagster`
(pipeline.cli.dagster_instance): the history `stepledger demo` left there shows in the UI.

`dagster dev` runs in a process group of its own; Ctrl-C or SIGTERM asks it to stop, and
whatever of the group is still alive after the grace period is killed, so no webserver, daemon
or code server outlives the command.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

import click

from pipeline.cli.dagster_instance import (
    CODE_LOCATION,
    INSTANCE_TEMPLATE,
    instance_dir,
    prepare_instance,
)
from pipeline.cli.options import data_dir_option
from pipeline.datadir import DATA_ENV

# `dagster dev` stops its webserver, daemon and code server within a few seconds of SIGTERM.
STOP_GRACE_SECONDS = 20.0


def group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs. Zombies do not count: an orphan that the
    machine's init does not reap has exited all the same."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


def stop_group(process: subprocess.Popen[bytes], grace_seconds: float) -> int:
    """Ask `dagster dev` to stop (SIGTERM: it shuts its webserver and daemon down in order),
    then SIGKILL whatever of its process group is still running after the grace period."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline:
        process.poll()
        if not group_alive(process.pid):
            break
        time.sleep(0.1)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return process.wait()


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
    stop_requested: list[int] = []

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop_requested.append(signum)

    # Installed before the start, so that no signal can end this process and orphan the group.
    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    # A session of its own: a terminal's Ctrl-C reaches only this process, which then stops
    # the whole group in order instead of every process dying at once.
    process = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        while process.poll() is None and not stop_requested:
            time.sleep(0.2)
    finally:
        returncode = stop_group(process, STOP_GRACE_SECONDS)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not stop_requested and returncode != 0:
        raise SystemExit(returncode)
