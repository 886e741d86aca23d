"""FOCUS 1.2 export: the `focus_costs` view written as Parquet or CSV that FinOps tools accept.

Open months come from the latest snapshot, on their tenants' provisional invoices; a closed
month (`stepledger close`) from the snapshot frozen when it was closed, with its invoice
numbers, so an export reproduces what was invoiced even after an hour of the month was
re-billed. Such a re-bill is exported as Adjustment rows (ChargeClass Correction) on the
invoices of the month that carries them.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from pipeline import finance

FORMATS = ("parquet", "csv")
# A row is in a range by the hour it charges; a correction (Adjustment) by the first hour of
# the billing period whose invoice carries it, so a month's export has its invoices' every
# row and ranges that split a month share none.
_PLACED_AT = (
    "CASE WHEN ChargeCategory = 'Adjustment' THEN BillingPeriodStart ELSE ChargePeriodStart END"
)
_RANGE = f"{_PLACED_AT} >= ? AND {_PLACED_AT} < ?"
# The month whose invoice a row is on: a correction's is not the month of the hour it corrects.
_MONTH = "CAST(BillingPeriodStart AS DATE)"
# FOCUS date-times are ISO 8601 in UTC with a Z; CSV has no types, so they are written so.
_TIME_COLUMNS = ("BillingPeriodEnd", "BillingPeriodStart", "ChargePeriodEnd", "ChargePeriodStart")


def focus_table(data_dir: str | Path, start: datetime, end: datetime) -> pa.Table:
    """FOCUS rows charged in [start, end) (aware datetimes), ordered by period, account, sub
    account and line."""
    params = [start, end]
    with finance.connect(data_dir) as latest:
        latest.execute("SET TimeZone = 'UTC'")
        closed = latest.execute(
            "SELECT month, snapshot FROM closed_months ORDER BY month"
        ).fetchall()
        numbers = latest.execute(
            "SELECT month, tenant, invoice_id FROM invoice_numbers"
        ).to_arrow_table()
        closed_months = [m for m, _ in closed]
        parts = [
            latest.execute(
                f"SELECT * FROM focus_costs WHERE {_RANGE} AND NOT list_contains(?, {_MONTH})",
                [*params, closed_months],
            ).to_arrow_table()
        ]
    for month, snapshot in closed:
        with finance.connect(data_dir, as_of=snapshot) as frozen:
            frozen.execute("SET TimeZone = 'UTC'")
            frozen.register("numbers", numbers)
            parts.append(
                frozen.execute(
                    "SELECT f.* REPLACE (n.invoice_id AS InvoiceId) FROM focus_costs f "
                    "LEFT JOIN numbers n "
                    "ON n.month = CAST(f.BillingPeriodStart AS DATE) "
                    "AND n.tenant = f.BillingAccountId "
                    f"WHERE {_RANGE} AND {_MONTH} = ?",
                    [*params, month],
                ).to_arrow_table()
            )
    schema = parts[0].schema
    table = pa.concat_tables([part.cast(schema) for part in parts])
    with duckdb.connect() as con:
        con.register("focus_rows", table)
        ordered = con.execute(
            "SELECT * FROM focus_rows ORDER BY ChargePeriodStart, BillingAccountId, SubAccountId, "
            "ResourceId, x_LineKind"
        ).to_arrow_table()
    # DuckDB names the zone Etc/UTC; FOCUS readers expect UTC.
    utc = pa.schema(
        [
            f.with_type(pa.timestamp("us", tz="UTC")) if f.name in _TIME_COLUMNS else f
            for f in schema
        ]
    )
    return ordered.cast(utc)


def _csv_text(column: str, kind: pa.DataType) -> str | None:
    """The SQL that writes a column as CSV text, or None to leave it to the CSV writer: times
    as ISO 8601 with Z; decimals as plain numbers with no exponent and no trailing zeros but
    one decimal place (Arrow writes a zero DECIMAL(38, 9) as 0E-9, which FinOps tools read as
    text; and a column of whole numbers, token counts, written without a decimal point is
    read as integers, not the decimals FOCUS requires)."""
    if column in _TIME_COLUMNS:
        return f"strftime({column}, '%Y-%m-%dT%H:%M:%SZ')"
    if pa.types.is_decimal(kind) and kind.scale > 0:
        return f"regexp_replace(CAST({column} AS VARCHAR), '(\\.[0-9]+?)0+$', '\\1')"
    return None


def write_focus(table: pa.Table, out: Path, fmt: str) -> None:
    """Write the rows: Parquet keeps the types (decimals, UTC timestamps); CSV writes times
    as ISO 8601 with Z and decimals as plain numbers (0.0, 2.5, 0.000000005)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    if fmt == "parquet":
        pq.write_table(table, partial)
    elif fmt == "csv":
        texts = {f.name: _csv_text(f.name, f.type) for f in table.schema}
        replaced = ", ".join(f"{sql} AS {name}" for name, sql in texts.items() if sql)
        with duckdb.connect() as con:
            con.execute("SET TimeZone = 'UTC'")
            con.register("focus_rows", table)
            text = con.execute(f"SELECT * REPLACE ({replaced}) FROM focus_rows").to_arrow_table()
        pa_csv.write_csv(text, partial)
    else:
        raise ValueError(f"format {fmt!r} is not one of {FORMATS}")
    partial.replace(out)
