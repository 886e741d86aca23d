"""`stepledger costs`: the published ledger summed by tenant, feature, pool, day, hour or line
kind (several at once), over a UTC range and a choice of tenants, pools and features, as a
table, CSV, JSON or Parquet, without writing SQL."""

from __future__ import annotations

import csv
import io
import json
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import pyarrow.parquet as pq

from pipeline.cli.options import TimeRange, data_dir_option, file_option, range_options
from pipeline.datadir import check_output
from pipeline.finance.costs import BREAKDOWNS, CostFilter, cost_tables

FORMATS = ("table", "csv", "json", "parquet")

if TYPE_CHECKING:
    from rich.table import Table


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
        return format(value, "f")
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


# Column headings of the printed table; amount_nano is left to the files and SQL (it would not fit).
HEADINGS = {
    "day": "day",
    "hour": "hour",
    "pool": "pool",
    "tenant": "tenant",
    "feature": "feature",
    "line_kind": "line kind",
    "amount_usd": "USD",
    "requests": "requests",
    "tokens": "tokens",
    "usd_per_request": "USD/request",
    "usd_per_1k_tokens": "USD/1k tokens",
}
_NAME_COLUMNS = ("day", "hour", "pool", "tenant", "feature", "line_kind")


def print_wide(table: Table) -> None:
    """Print a table without cutting a name or a number: wider than the terminal rather than
    wrapped."""
    from rich.console import Console
    from rich.measure import Measurement

    wide = Console(width=1 << 12)
    needed = Measurement.get(wide, wide.options, table).maximum
    Console(width=max(Console().width, needed)).print(table)


def print_report(report: dict[str, list[dict[str, Any]]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    if not report["costs"]:
        console.print("[yellow]no published hours match[/yellow]")
    else:
        columns = [c for c in report["costs"][0] if c in HEADINGS]
        table = Table(title=title)
        for column in columns:
            table.add_column(
                HEADINGS[column],
                justify="left" if column in _NAME_COLUMNS else "right",
                no_wrap=True,
            )
        for row in report["costs"]:
            # Text, not markup: a tenant may be named "[bold]x[/]".
            table.add_row(*(Text(_cell(c, row[c])) for c in columns))
        print_wide(table)
    if report["held_back"]:
        held = Table(title="held back from the finance views")
        for column in ("hour", "pool", "amount_nano", "reason"):
            held.add_column(column)
        for row in report["held_back"]:
            held.add_row(
                *(Text(_cell(c, row[c])) for c in ("hour", "pool", "amount_nano", "reason"))
            )
        console.print(held)


def costs_csv(rows: list[dict[str, object]]) -> str:
    """The cost rows as CSV (exact decimals, ISO times)."""
    out = io.StringIO()
    if rows:
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(rows[0])
        writer.writerows([_plain(v) for v in row.values()] for row in rows)
    return out.getvalue()


def costs_json(report: dict[str, list[dict[str, object]]]) -> str:
    plain = {
        k: [{c: _plain(v) for c, v in row.items()} for row in rows] for k, rows in report.items()
    }
    return json.dumps(plain, indent=2)


@click.command("costs")
@data_dir_option(help="data directory whose warehouse (DATA/warehouse/) to read")
@click.option(
    "--by",
    "by",
    type=click.Choice(list(BREAKDOWNS)),
    multiple=True,
    help="group by these (repeat for several, e.g. --by day --by tenant); default tenant",
)
@range_options("charged")
@click.option("--tenant", "tenants", multiple=True, help="only this tenant (repeatable)")
@click.option("--pool", "pools", multiple=True, help="only this pool (repeatable)")
@click.option("--feature", "features", multiple=True, help="only this feature (repeatable)")
@click.option(
    "--as-of",
    "as_of",
    type=str,
    default=None,
    metavar="TIMESTAMP",
    help="as the warehouse stood then: ISO 8601 with a zone, e.g. 2026-12-01T09:00:00+00:00",
)
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="same as --format json")
@file_option("--out", help="write to this file instead of printing (required for parquet)")
def costs_command(
    data_dir: Path,
    by: tuple[str, ...],
    period: TimeRange,
    tenants: tuple[str, ...],
    pools: tuple[str, ...],
    features: tuple[str, ...],
    as_of: str | None,
    fmt: str,
    as_json: bool,
    out: Path | None,
) -> None:
    """What the published (reconciled) hours cost, by tenant, feature, pool, day, hour or line
    kind. Idle, headroom, unattributed, platform retries and cache credits are rows of their
    own with --by line-kind.

    \b
    stepledger costs --from 2026-11-30 --to 2026-11-30 --by tenant --by line-kind
    stepledger costs --from last-month --to last-month --by day
    stepledger costs --from mtd --tenant acme-support --by feature --format csv --out acme.csv
    """
    if as_json:
        fmt = "json"
    if fmt == "parquet" and out is None:
        raise click.UsageError("--format parquet writes a file: give --out FILE")
    where = CostFilter(period.start, period.end, tenants, pools, features)
    if fmt == "table" and out is not None:
        raise click.UsageError("--out writes csv, json or parquet: give --format")
    if out is not None:
        check_output(out, data_dir)
    tables = cost_tables(
        data_dir, by or ("tenant",), where=where, as_of=parse_as_of(as_of) if as_of else None
    )
    if fmt == "parquet":
        assert out is not None
        pq.write_table(tables["costs"], out)
        return
    report = {name: table.to_pylist() for name, table in tables.items()}
    if fmt == "table":
        title = "costs by " + ", ".join(by or ("tenant",))
        print_report(report, title + (f" as of {as_of}" if as_of else ""))
        return
    text = costs_csv(report["costs"]) if fmt == "csv" else costs_json(report)
    if out is None:
        click.echo(text, nl=False)
    else:
        out.write_text(text)
