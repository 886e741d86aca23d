"""`stepledger whatif`: past hours attributed again under other policies, never published."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import click

from pipeline.cli.costs import print_wide
from pipeline.cli.options import TimeRange, data_dir_option, range_options
from schemas.units import nano_to_usd, parse_hour_key

if TYPE_CHECKING:
    import polars as pl

    from pipeline.finance.whatif import WhatIf


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}%"


def usd(nano: int, *, signed: bool = False) -> str:
    """Exact dollars (nine decimals: the sums add up as printed)."""
    return f"{nano_to_usd(nano):{'+' if signed else ''},.9f}"


def _change_table(title: str, rows: pl.DataFrame, names: tuple[str, ...]) -> None:
    """Billed, what-if and the change per `names` (tenant, or tenant and feature), in USD."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title)
    for heading in (*names, "billed USD", "what-if USD", "change USD", "%"):
        table.add_column(heading, justify="left" if heading in names else "right")
    for row in rows.iter_rows(named=True):
        table.add_row(
            *(Text(row[name]) for name in names),
            usd(row["before_nano"]),
            usd(row["after_nano"]),
            usd(row["change_nano"], signed=True),
            _percent(row["change_pct"]),
        )
    print_wide(table)


def print_what_if(result: WhatIf, settings: dict[str, object]) -> None:
    from rich.console import Console

    scenario = ", ".join(f"{k}={v}" for k, v in settings.items())
    _change_table(f"what if {scenario}: per tenant", result.tenants, ("tenant",))
    _change_table(f"what if {scenario}: per feature", result.changes, ("tenant", "feature"))
    hours = result.hours
    invoices = int(hours["invoice_nano"].sum())
    Console().print(
        f"{hours.height} pool-hour(s), invoices {usd(invoices)} USD "
        f"({invoices:,} nano-dollars): "
        + (
            "both ledgers balance to the nano-dollar"
            if result.balanced
            else "[red]a ledger does not sum to its invoice[/red]"
        )
        + "; nothing was published"
    )


@click.command("whatif")
@data_dir_option(help="data directory whose lake and warehouse to read (nothing is written)")
@click.option("--hour", metavar="HOUR", help="one hour, YYYY-MM-DDTHH (UTC)")
@range_options("billed")
@click.option(
    "--set",
    "pairs",
    multiple=True,
    metavar="NAME=VALUE",
    help="a policy to change: idle=spread|capacity_owner|spread_then_headroom, "
    "prefix_cache=first_writer|split_by_holders|cache_read, alpha=0..1, weights=kernel|fitted",
)
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of tables")
def whatif_command(
    data_dir: Path,
    hour: str | None,
    period: TimeRange,
    pairs: tuple[str, ...],
    as_json: bool,
) -> None:
    """What billed hours would have cost with some policies changed, per tenant and per
    feature, in USD (billed, what-if, change and %), each hour still summing to its invoice.
    Attributes again from the lake; publishes nothing.

    \b
    stepledger whatif --hour 2026-11-30T00 --set idle=capacity_owner --set alpha=0.5
    stepledger whatif --from yesterday --to yesterday --set prefix_cache=cache_read
    """
    from pipeline.finance.whatif import parse_settings, what_if

    if hour is not None:
        if period.start or period.end:
            raise click.UsageError("give --hour or --from/--to, not both")
        try:
            first = parse_hour_key(hour)
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--hour") from err
        period = TimeRange(first, first + timedelta(hours=1))
    if period.start is None:
        raise click.UsageError("give --hour, or --from (and --to, else through the last hour)")
    settings = parse_settings(list(pairs))
    if not settings:
        raise click.UsageError("give at least one --set NAME=VALUE")
    result = what_if(data_dir, *period.closed(), settings)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "settings": settings,
                    "balanced": result.balanced,
                    "tenants": result.tenants.to_dicts(),
                    "changes": result.changes.to_dicts(),
                    "hours": result.hours.to_dicts(),
                },
                indent=2,
            )
        )
        return
    print_what_if(result, settings)
