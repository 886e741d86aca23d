"""`stepledger whatif`: past hours attributed again under other policies, never published."""

from __future__ import annotations

import json
from pathlib import Path

import click

from pipeline.cli.costs import parse_range, print_wide
from pipeline.cli.options import data_dir_option


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}%"


@click.command("whatif")
@data_dir_option(help="data directory whose lake and warehouse to read (nothing is written)")
@click.option("--hour", metavar="HOUR", help="one hour, YYYY-MM-DDTHH (UTC)")
@click.option("--from", "start", metavar="WHEN", help="first month, day or hour (UTC), inclusive")
@click.option("--to", "end", metavar="WHEN", help="last month, day or hour (UTC), inclusive")
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
    start: str | None,
    end: str | None,
    pairs: tuple[str, ...],
    as_json: bool,
) -> None:
    """What billed hours would have cost with some policies changed, per tenant and feature
    (absolute and %), each hour still summing to its invoice. Attributes again from the
    lake; publishes nothing.

    \b
    stepledger whatif --hour 2026-11-30T00 --set idle=capacity_owner --set alpha=0.5
    """
    from pipeline.finance.whatif import parse_settings, what_if

    if hour is not None and (start or end):
        raise click.UsageError("give --hour or --from/--to, not both")
    first, after = parse_range(hour or start, hour or end)
    if first is None or after is None:
        raise click.UsageError("give --hour, or both --from and --to")
    settings = parse_settings(list(pairs))
    if not settings:
        raise click.UsageError("give at least one --set NAME=VALUE")
    result = what_if(data_dir, first, after, settings)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "settings": settings,
                    "balanced": result.balanced,
                    "changes": result.changes.to_dicts(),
                    "hours": result.hours.to_dicts(),
                },
                indent=2,
            )
        )
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    table = Table(title="what if " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    for heading in ("tenant", "feature", "before (nano-$)", "after (nano-$)", "change", "%"):
        table.add_column(heading, justify="left" if heading in ("tenant", "feature") else "right")
    for row in result.changes.iter_rows(named=True):
        table.add_row(
            Text(row["tenant"]),
            Text(row["feature"]),
            f"{row['before_nano']:,}",
            f"{row['after_nano']:,}",
            f"{row['change_nano']:+,}",
            _percent(row["change_pct"]),
        )
    print_wide(table)
    hours = result.hours
    console.print(
        f"{hours.height} pool-hour(s), invoices {int(hours['invoice_nano'].sum()):,} nano-dollars: "
        + (
            "both ledgers balance to the nano-dollar"
            if result.balanced
            else "[red]a ledger does not sum to its invoice[/red]"
        )
        + "; nothing was published"
    )
