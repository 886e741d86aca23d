"""`stepledger export focus`: the ledger as a FOCUS 1.2 file (Parquet or CSV)."""

from __future__ import annotations

from pathlib import Path

import click

from pipeline.cli.options import TimeRange, data_dir_option, file_option, range_options
from pipeline.datadir import check_output
from pipeline.finance.focus import FORMATS, focus_table, write_focus


@click.group("export")
def export_group() -> None:
    """Export the ledger for other tools."""


@export_group.command("focus")
@data_dir_option(help="data directory whose warehouse (DATA/warehouse/) to export")
@file_option("--out", required=True)
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="parquet", show_default=True)
@range_options("charged")
def focus_command(data_dir: Path, out: Path, fmt: str, period: TimeRange) -> None:
    """Write the published ledger as a FOCUS 1.2 cost and usage dataset.

    Closed months (`stepledger close`) are exported as they were invoiced, with their invoice
    numbers; open months as they stand now, on provisional invoices
    (InvoiceId SL-YYYYMM-provisional-TENANT). Each pool's price per GPU-hour is its SKU's list
    price, and each line's PricingQuantity the GPU-hours its cost buys at it.

    \b
    Examples:
      stepledger export focus --data demo-run --out focus.parquet
      stepledger export focus --data demo-run --out nov.csv --format csv --from 2026-11 --to 2026-11
      stepledger export focus --data demo-run --out last.parquet --from last-month --to last-month
    """
    check_output(out, data_dir)
    table = focus_table(data_dir, *period.closed())
    write_focus(table, out, fmt)
    click.echo(f"{out}: {table.num_rows:,} FOCUS rows")
