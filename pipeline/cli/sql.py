"""`stepledger sql`: finance's SQL session on the warehouse, through `pipeline.finance.connect`."""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TextIO

import click
import duckdb

from pipeline import finance
from pipeline.cli.costs import _plain, parse_as_of
from pipeline.cli.options import data_dir_option
from pipeline.storage.read_only_files import refusal_in
from pipeline.storage.warehouse import WarehouseError

FORMATS = ("table", "csv", "json")
PROMPT = "stepledger> "


def print_result(con: duckdb.DuckDBPyConnection, query: str, fmt: str) -> None:
    """Run one statement and print its rows (nothing for a statement without a result)."""
    if fmt == "table":
        relation = con.sql(query)
        if relation is not None:
            relation.show(max_rows=10_000, max_width=10_000)
        return
    cursor = con.execute(query)
    if cursor.description is None:
        return
    columns = [d[0] for d in cursor.description]
    rows = cursor.fetchall()
    if fmt == "csv":
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([_plain(v) for v in row] for row in rows)
    else:
        plain = [{c: _plain(v) for c, v in zip(columns, row, strict=True)} for row in rows]
        click.echo(json.dumps(plain, indent=2))


def statements(lines: Iterable[str]) -> Iterator[str]:
    """Complete statements (ending in ';') as the lines come; a last one without ';' too."""
    pending: list[str] = []
    for line in lines:
        pending.append(line)
        if line.rstrip().endswith(";"):
            yield "".join(pending)
            pending = []
    if "".join(pending).strip():
        yield "".join(pending)


@click.command("sql")
@data_dir_option(help="data directory whose warehouse (DATA/warehouse/) to read")
@click.option("-c", "--command", "query", default=None, help="run this one query and exit")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True)
@click.option(
    "--as-of",
    "as_of",
    default=None,
    metavar="TIMESTAMP",
    help="as the warehouse stood then: ISO 8601 with a zone, e.g. 2026-12-01T09:00:00+00:00",
)
def sql_command(data_dir: Path, query: str | None, fmt: str, as_of: str | None) -> None:
    """Query the warehouse read-only, with every finance view defined.

    Without -c, statements are read from standard input (each ending in ';'); at a terminal
    that is an interactive session (end it with Ctrl-D). Finance and billing never block
    each other: keep the session open as long as you like.

    \b
    Examples:
      stepledger sql --data demo-run -c "SELECT * FROM tenant_costs_daily"
      stepledger sql --data demo-run --format csv -c "SELECT * FROM focus_costs" > focus.csv
      stepledger sql --data demo-run --as-of 2026-12-01T09:00:00+00:00 -c "FROM tenant_costs"
    """
    try:
        con = finance.connect(data_dir, as_of=parse_as_of(as_of) if as_of else None)
    except WarehouseError as err:
        raise click.ClickException(str(err)) from err
    with con:
        if query is not None:
            _run(con, query, fmt)
            return
        interactive = sys.stdin.isatty()
        failed = False
        for statement in statements(_prompted(sys.stdin) if interactive else sys.stdin):
            try:
                _run(con, statement, fmt)
            except click.ClickException as err:
                if not interactive:
                    raise
                failed = True
                err.show()
        if failed:
            click.echo("(some statements failed)", err=True)


def _prompted(stream: TextIO) -> Iterator[str]:
    while True:
        click.echo(PROMPT, nl=False, err=True)
        line = stream.readline()
        if not line:
            click.echo(err=True)
            return
        yield line


def _run(con: duckdb.DuckDBPyConnection, query: str, fmt: str) -> None:
    try:
        print_result(con, query, fmt)
    except duckdb.Error as err:
        raise refusal_in(err) or click.ClickException(str(err)) from err
