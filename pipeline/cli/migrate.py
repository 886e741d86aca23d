"""`stepledger migrate`: move a warehouse of the previous single-file layout to the DuckLake, or
bring a DuckLake warehouse of an earlier schema version to this one."""

from __future__ import annotations

from pathlib import Path

import click

from pipeline.datadir import DataDir
from pipeline.storage.warehouse import (
    PREVIOUS_LAYOUT_FILE,
    SCHEMA_VERSION,
    connect,
    migrate_previous_layout,
    postgres_from_env,
)


@click.command("migrate")
@click.option(
    "--data",
    "data_dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    required=True,
    help="data directory holding the warehouse to migrate",
)
def migrate_command(data_dir: Path) -> None:
    """Move DATA/warehouse.duckdb (schema version 1) to the DuckLake warehouse DATA/warehouse/
    and the pipeline's state file DATA/pipeline.duckdb; the old file is kept, renamed
    warehouse.duckdb.migrated. Stop the pipeline (and close sessions on the old file) first.
    A DuckLake warehouse of an earlier version is brought to this one in place (a writing
    connection adds the tables it lacks)."""
    if not (data_dir / PREVIOUS_LAYOUT_FILE).is_file():
        with connect(DataDir(data_dir).state_file, postgres=postgres_from_env()):
            pass
        click.echo(f"{data_dir}: at schema version {SCHEMA_VERSION}")
        return
    moved = migrate_previous_layout(data_dir)
    for table, rows in moved.items():
        click.echo(f"{table}: {rows:,} rows")
    click.echo(f"{data_dir}: migrated to schema version {SCHEMA_VERSION}")
