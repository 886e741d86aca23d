"""`stepledger close`: finance closes a month, numbering its invoices."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import click

from pipeline.cli.options import data_dir_option
from pipeline.finance import close_month
from schemas.units import nano_to_usd


@click.command("close")
@data_dir_option(help="data directory whose warehouse (DATA/warehouse/) holds the month")
@click.option(
    "--month", type=click.DateTime(["%Y-%m"]), required=True, help="the UTC month, YYYY-MM"
)
def close_command(data_dir: Path, month: datetime) -> None:
    """Close a month: one numbered invoice per tenant, and the warehouse snapshot they were
    computed from frozen for its FOCUS export. Refused while any hour of the month is held
    back, and for a month closed before."""
    invoices = close_month(data_dir, month.date())
    for invoice_id, tenant, amount in invoices:
        click.echo(f"{invoice_id}  {tenant}  {nano_to_usd(amount):,.9f} USD")
