"""`stepledger costs`: the published ledger summed by tenant, feature, pool, day, hour or line
kind (several at once), over a UTC range and a choice of tenants, pools and features, as a
table, CSV, JSON or Parquet, without writing SQL."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import finance
from pipeline.cli.options import data_dir_option, file_option
from pipeline.datadir import check_output
from schemas.units import parse_range_bound, to_warehouse

if TYPE_CHECKING:
    from rich.table import Table

# --by name -> the columns it groups by, in the order they are listed. A feature belongs to a
# tenant, so grouping by feature keeps the tenant.
BREAKDOWNS = {
    "day": ("day",),
    "hour": ("hour",),
    "pool": ("pool",),
    "tenant": ("tenant",),
    "feature": ("tenant", "feature"),
    "line-kind": ("line_kind",),
}
_COLUMN_ORDER = ("day", "hour", "pool", "tenant", "feature", "line_kind")
FORMATS = ("table", "csv", "json", "parquet")
# Requests are counted as every view counts them (`charged_requests`, sql/views.sql).
_TOTALS = """CAST(sum(amount_nano) AS BIGINT) AS amount_nano,
       nano_to_usd(sum(amount_nano)) AS amount_usd,
       CAST(coalesce(sum(charged_requests), 0) AS BIGINT) AS requests,
       CAST(sum(new_tokens) AS BIGINT) AS tokens,
       usd_per(sum(amount_nano), sum(charged_requests)) AS usd_per_request,
       usd_per(sum(amount_nano) * 1000, sum(new_tokens)) AS usd_per_1k_tokens"""
HELD_BACK = "SELECT hour, pool, amount_nano, reason FROM held_back_hours"


@dataclass(frozen=True)
class CostFilter:
    """Which published ledger lines to sum: hours in [start, end) (UTC), and only the listed
    tenants, pools and features (empty: all)."""

    start: datetime | None = None
    end: datetime | None = None
    tenants: tuple[str, ...] = ()
    pools: tuple[str, ...] = ()
    features: tuple[str, ...] = ()

    def where(self, *, held_back: bool = False) -> tuple[str, list[object]]:
        """The SQL condition and its parameters (`held_back`: for held_back_hours, which has
        hours and pools only)."""
        conditions: list[str] = ["TRUE"]
        params: list[object] = []
        if self.start is not None:
            conditions.append("hour >= ?")
            params.append(to_warehouse(self.start))
        if self.end is not None:
            conditions.append("hour < ?")
            params.append(to_warehouse(self.end))
        chosen = [("pool", self.pools)]
        if not held_back:
            chosen += [("tenant", self.tenants), ("feature", self.features)]
        for column, values in chosen:
            if values:
                conditions.append(f"{column} IN ({', '.join('?' * len(values))})")
                params.extend(values)
        return " AND ".join(conditions), params


def cost_query(by: Sequence[str], where: CostFilter) -> tuple[str, list[object]]:
    """The SQL summing the published ledger lines matching `where`, grouped by `by`."""
    unknown = [b for b in by if b not in BREAKDOWNS]
    if unknown:
        raise ValueError(f"--by {unknown[0]!r}: not one of {', '.join(BREAKDOWNS)}")
    wanted = {c for b in by for c in BREAKDOWNS[b]}
    columns = [c for c in _COLUMN_ORDER if c in wanted]
    listed = ", ".join(columns)
    condition, params = where.where()
    # Money first within a period, names after: the biggest cost of each day or hour on top.
    periods = [c for c in columns if c in ("day", "hour")]
    order = ", ".join([*periods, "amount_nano DESC", *(c for c in columns if c not in periods)])
    sql = (
        f"SELECT {listed}{', ' if columns else ''}{_TOTALS}\n"
        "FROM (SELECT *, CAST(date_trunc('day', hour) AS DATE) AS day FROM published_ledger_lines)\n"
        f"WHERE {condition}\n" + (f"GROUP BY {listed}\n" if columns else "") + f"ORDER BY {order}"
    )
    return sql, params


def cost_tables(
    data_dir: Path,
    by: Sequence[str] | str = ("tenant",),
    *,
    where: CostFilter | None = None,
    as_of: datetime | None = None,
) -> dict[str, pa.Table]:
    """One finance breakdown ("costs") and the hours held back of the same range and pools
    ("held_back"): now, or as the warehouse stood at `as_of`."""
    where = where or CostFilter()
    sql, params = cost_query((by,) if isinstance(by, str) else by, where)
    held_condition, held_params = where.where(held_back=True)
    queries = (
        ("costs", sql, params),
        ("held_back", f"{HELD_BACK} WHERE {held_condition} ORDER BY hour, pool", held_params),
    )
    with finance.connect(data_dir, as_of=as_of) as con:
        return {name: con.execute(q, p).to_arrow_table() for name, q, p in queries}


def cost_report(
    data_dir: Path,
    by: Sequence[str] | str = ("tenant",),
    *,
    where: CostFilter | None = None,
    as_of: datetime | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """`cost_tables` as rows of plain dicts."""
    tables = cost_tables(data_dir, by, where=where, as_of=as_of)
    return {name: table.to_pylist() for name, table in tables.items()}


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


def parse_range(start: str | None, end: str | None) -> tuple[datetime | None, datetime | None]:
    """--from and --to (each a month, day or hour, UTC; both inclusive) as [start, end)."""
    bounds = []
    for text, option, is_end in ((start, "--from", False), (end, "--to", True)):
        try:
            bounds.append(None if text is None else parse_range_bound(text, end=is_end))
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint=option) from err
    first, after = bounds
    if first is not None and after is not None and after <= first:
        raise click.BadParameter(f"--to {end} is before --from {start}", param_hint="--to")
    return first, after


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
@click.option("--from", "start", metavar="WHEN", help="first month, day or hour (UTC), inclusive")
@click.option("--to", "end", metavar="WHEN", help="last month, day or hour (UTC), inclusive")
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
    start: str | None,
    end: str | None,
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
    stepledger costs --from 2026-11 --tenant acme --by feature --format csv --out acme.csv
    """
    if as_json:
        fmt = "json"
    if fmt == "parquet" and out is None:
        raise click.UsageError("--format parquet writes a file: give --out FILE")
    first, after = parse_range(start, end)
    where = CostFilter(first, after, tenants, pools, features)
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
