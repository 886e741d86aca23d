"""`stepledger costs`: the finance views as tables (or JSON), without writing SQL."""

from __future__ import annotations

import json
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import click

from pipeline import finance
from pipeline.warehouse import WarehouseError

_COLUMNS = "amount_nano, amount_usd, requests, tokens, usd_per_request, usd_per_1k_tokens"
QUERIES = {
    "tenant": f"SELECT tenant, {_COLUMNS} FROM tenant_costs ORDER BY amount_nano DESC, tenant",
    "feature": f"SELECT tenant, feature, {_COLUMNS} FROM feature_costs ORDER BY amount_nano DESC, tenant, feature",
    "day": f"SELECT day, tenant, {_COLUMNS} FROM tenant_costs_daily ORDER BY day, amount_nano DESC, tenant",
}
HELD_BACK = "SELECT hour, pool, amount_nano, reason FROM held_back_hours ORDER BY hour, pool"


def cost_report(
    data_dir: Path, by: str, *, as_of: datetime | None = None
) -> dict[str, list[dict[str, Any]]]:
    """The rows of one finance breakdown and the hours held back, as plain dicts: now, or as
    the warehouse stood at `as_of`."""
    with finance.connect(data_dir, as_of=as_of) as con:
        report = {}
        for name, sql in (("costs", QUERIES[by]), ("held_back", HELD_BACK)):
            cursor = con.execute(sql)
            columns = [d[0] for d in cursor.description]
            report[name] = [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]
    return report


def parse_as_of(text: str) -> datetime:
    """An --as-of time: ISO 8601 carrying its time zone (a bare time is ambiguous)."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError as err:
        raise click.BadParameter(f"{text!r} is not an ISO 8601 time", param_hint="--as-of") from err
    if moment.tzinfo is None:
        raise click.BadParameter(
            f"{text!r} has no time zone; add one, e.g. {text}+00:00", param_hint="--as-of"
        )
    return moment


def _plain(value: object) -> object:
    if isinstance(value, Decimal):
        return str(value)
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value


def _cell(column: str, value: object) -> str:
    if value is None:
        return "-"
    if column == "amount_usd":
        return f"{value:,.6f}"
    if column.startswith("usd_per"):
        return f"{value:.6f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(_plain(value))


# Column headings of the printed table; amount_nano is left to --json and SQL (it would not fit).
HEADINGS = {
    "day": "day",
    "tenant": "tenant",
    "feature": "feature",
    "amount_usd": "USD",
    "requests": "requests",
    "tokens": "tokens",
    "usd_per_request": "USD/request",
    "usd_per_1k_tokens": "USD/1k tokens",
}


def print_report(report: dict[str, list[dict[str, Any]]], title: str) -> None:
    from rich.console import Console
    from rich.measure import Measurement
    from rich.table import Table
    from rich.text import Text

    console = Console()
    if not report["costs"]:
        console.print("[yellow]no published hours yet[/yellow]")
    else:
        columns = [c for c in report["costs"][0] if c in HEADINGS]
        table = Table(title=title)
        for column in columns:
            name_column = column in ("tenant", "feature", "day")
            table.add_column(
                HEADINGS[column], justify="left" if name_column else "right", no_wrap=True
            )
        for row in report["costs"]:
            # Text, not markup: a tenant may be named "[bold]x[/]".
            table.add_row(*(Text(_cell(c, row[c])) for c in columns))
        # Never cut a name or a number: print wider than the terminal rather than wrap.
        wide = Console(width=1 << 12)
        needed = Measurement.get(wide, wide.options, table).maximum
        Console(width=max(console.width, needed)).print(table)
    if report["held_back"]:
        held = Table(title="held back from the finance views")
        for column in ("hour", "pool", "amount_nano", "reason"):
            held.add_column(column)
        for row in report["held_back"]:
            held.add_row(
                *(Text(_cell(c, row[c])) for c in ("hour", "pool", "amount_nano", "reason"))
            )
        console.print(held)


@click.command("costs")
@click.option(
    "--data",
    "data_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("demo-run"),
    show_default=True,
    help="data directory whose warehouse (DATA/warehouse/) to read",
)
@click.option("--by", type=click.Choice(sorted(QUERIES)), default="tenant", show_default=True)
@click.option(
    "--as-of",
    "as_of",
    type=str,
    default=None,
    metavar="TIMESTAMP",
    help="as the warehouse stood then: ISO 8601 with a zone, e.g. 2026-12-01T09:00:00+00:00",
)
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def costs_command(data_dir: Path, by: str, as_of: str | None, as_json: bool) -> None:
    """What each tenant, feature or day cost, over the published (reconciled) hours."""
    try:
        report = cost_report(data_dir, by, as_of=parse_as_of(as_of) if as_of else None)
    except WarehouseError as err:
        raise click.ClickException(str(err)) from err
    if as_json:
        plain = {
            k: [{c: _plain(v) for c, v in row.items()} for row in rows]
            for k, rows in report.items()
        }
        click.echo(json.dumps(plain, indent=2))
    else:
        print_report(report, f"costs by {by}" + (f" as of {as_of}" if as_of else ""))
