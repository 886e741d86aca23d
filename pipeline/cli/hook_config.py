"""`stepledger hook-config --replica R`: the replica descriptor an engine hook reads at start."""

from __future__ import annotations

from pathlib import Path

import click

from pipeline.cli.options import file_option
from pipeline.hook.replica import ReplicaDescriptor
from schemas.config import DEFAULT_POOLS_PATH, ConfigError, load_pools


@click.command("hook-config")
@click.option("--replica", required=True, help="The replica's id in the pools file.")
@file_option(
    "--pools", "pools_path", default=DEFAULT_POOLS_PATH, help="Pools file listing the replica."
)
@file_option("--out", help="Write the descriptor to this file instead of standard output.")
def hook_config_command(replica: str, pools_path: Path, out: Path | None) -> None:
    """Write REPLICA's descriptor (its pool, model, GPU type and GPU count) as JSON.

    Point the engine's STEPLEDGER_HOOK_CONFIG at the file: the recording scheduler reads it
    at start, without the pools file, and refuses to start an engine that runs other than
    its pool declares. Write it again when the pools file changes the replica's pool.
    """
    try:
        pools = load_pools(pools_path).pools
    except ConfigError as err:
        raise click.ClickException(str(err)) from err
    pool = next((p for p in pools if replica in {r.id for r in p.replicas}), None)
    if pool is None:
        raise click.ClickException(f"{pools_path}: replica {replica!r} is in no pool")
    descriptor = ReplicaDescriptor(
        pool=pool.name,
        replica=replica,
        model=pool.model,
        gpu_type=pool.gpu_type,
        gpus_per_replica=pool.gpus_per_replica,
        data_parallel=pool.data_parallel,
    )
    text = descriptor.to_json().decode() + "\n"
    if out is None:
        click.echo(text, nl=False)
    else:
        out.write_text(text, encoding="utf-8")
