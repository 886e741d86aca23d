"""`stepledger stack up|down|env`: the production stack on one machine (pipeline/stack.py)."""

from __future__ import annotations

import shlex
from pathlib import Path

import click

from pipeline.cli.options import data_dir_option, directory_option

STACK_DIR = Path(".stepledger-stack")


@click.group("stack")
def stack_group() -> None:
    """PostgreSQL, an S3 server, the Dagster daemon and webserver of the production profile,
    on loopback."""


@stack_group.command("up")
@directory_option("--dir", "directory", default=STACK_DIR, help="a new directory for the stack")
@data_dir_option(help="data directory the pipeline bills")
@click.option("--port", type=int, default=3000, show_default=True, help="the webserver's port")
def up_command(directory: Path, data_dir: Path, port: int) -> None:
    """Start the stack: a new PostgreSQL cluster in DIR holding Dagster's instance, the
    pipeline's state and the warehouse's catalog, an S3 server (SeaweedFS) for the engines'
    segments, then the daemon and the webserver."""
    from pipeline import stack

    record = stack.up(directory, data_dir, webserver_port=port)
    click.echo(f"stack up in {directory}: webserver {record['webserver']}")
    click.echo(f"`stepledger stack env --dir {directory}` prints its environment")


@stack_group.command("down")
@directory_option("--dir", "directory", default=STACK_DIR, help="the stack's directory")
def down_command(directory: Path) -> None:
    """Stop everything `stack up` started in DIR (its data stays)."""
    from pipeline import stack

    click.echo(f"stopped: {', '.join(stack.down(directory))}")


@stack_group.command("env")
@directory_option("--dir", "directory", default=STACK_DIR, help="the stack's directory")
def env_command(directory: Path) -> None:
    """The variables that reach the running stack, as `export` lines for a shell: Dagster's,
    STEPLEDGER_POSTGRES, and the store's (STEPLEDGER_STORE, AWS_ENDPOINT_URL, AWS_REGION and
    the key pair) for `stepledger ship` and `stepledger run`. They hold the stack's secrets."""
    from pipeline import stack

    for name, value in stack.environment_of(directory).items():
        click.echo(f"export {name}={shlex.quote(value)}")
