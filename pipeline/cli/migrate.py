"""`stepledger migrate`: move a warehouse of the previous single-file layout to the DuckLake."""

from __future__ import annotations

from pathlib import Path

import click

from pipeline.storage.warehouse import SCHEMA_VERSION, migrate_previous_layout


@click.command("migrate")
@click.option(
    "--data",
    "data_dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    required=True,
    help="data directory holding the previous layout's warehouse.duckdb",
)
def migrate_command(data_dir: Path) -> None:
    """Move DATA/warehouse.duckdb (schema version 1) to the DuckLake warehouse DATA/warehouse/
    and the pipeline's state file DATA/pipeline.duckdb; the old file is kept, renamed
    warehouse.duckdb.migrated. Stop the pipeline (and close sessions on the old file) first."""
    moved = migrate_previous_layout(data_dir)
    for table, rows in moved.items():
        click.echo(f"{table}: {rows:,} rows")
    click.echo(f"{data_dir}: migrated to schema version {SCHEMA_VERSION}")
