"""`stepledger export focus`: the ledger as a FOCUS 1.2 file (Parquet or CSV)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import click

from pipeline.cli.options import data_dir_option, file_option
from pipeline.datadir import check_output
from pipeline.finance.focus import FORMATS, focus_table, write_focus

# Before and after any charge the ledger can hold.
_EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
_LATEST = datetime(9999, 1, 1, tzinfo=UTC)


@click.group("export")
def export_group() -> None:
    """Export the ledger for other tools."""


def _day(value: datetime | None, default: datetime) -> datetime:
    return default if value is None else value.replace(tzinfo=UTC)


@export_group.command("focus")
@data_dir_option(help="data directory whose warehouse (DATA/warehouse/) to export")
@file_option("--out", required=True)
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="parquet", show_default=True)
@click.option(
    "--from",
    "start",
    type=click.DateTime(["%Y-%m-%d"]),
    default=None,
    help="first UTC day charged (default: the first)",
)
@click.option(
    "--to",
    "end",
    type=click.DateTime(["%Y-%m-%d"]),
    default=None,
    help="UTC day after the last one charged (default: all)",
)
def focus_command(
    data_dir: Path, out: Path, fmt: str, start: datetime | None, end: datetime | None
) -> None:
    """Write the published ledger as a FOCUS 1.2 cost and usage dataset.

    Closed months (`stepledger close`) are exported as they were invoiced, with their invoice
    numbers; open months as they stand now, on provisional invoices
    (InvoiceId SL-YYYYMM-provisional-TENANT). Each pool's price per GPU-hour is its SKU's list
    price, and each line's PricingQuantity the GPU-hours its cost buys at it.

    \b
    Examples:
      stepledger export focus --data demo-run --out focus.parquet
      stepledger export focus --data demo-run --out nov.csv --format csv --from 2026-11-01 --to 2026-12-01
    """
    check_output(out, data_dir)
    table = focus_table(data_dir, _day(start, _EARLIEST), _day(end, _LATEST))
    write_focus(table, out, fmt)
    click.echo(f"{out}: {table.num_rows:,} FOCUS rows")
