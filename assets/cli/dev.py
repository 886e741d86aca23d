"""`stepledger dev`: the Dagster UI and daemon on a data directory (the demo's by default)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import click

from assets.resources import DATA_ENV

DAGSTER_HOME = Path(__file__).resolve().parents[2] / "dagster_home"


@click.command("dev")
@click.option(
    "--data",
    "data_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("demo-run"),
    show_default=True,
    help="data directory the schedule and sensor work on",
)
@click.option("--port", type=int, default=3000, show_default=True)
def dev_command(data_dir: Path, port: int) -> None:
    """Start `dagster dev` on the stepledger code location, with DAGSTER_HOME=dagster_home."""
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
    env = {**os.environ, "DAGSTER_HOME": str(DAGSTER_HOME), DATA_ENV: str(data_dir.resolve())}
    os.execve(dagster, [dagster, "dev", "-m", "assets.definitions", "-p", str(port)], env)
