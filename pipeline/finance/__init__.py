"""Finance's one read path: `connect(data_dir)`.

    import pipeline.finance
    con = pipeline.finance.connect("demo-run")
    con.sql("SELECT * FROM tenant_costs_daily").show()

The connection is read-only, in memory, with the DuckLake warehouse attached as `ledger` and
every finance view (sql/views.sql) defined. It reads a snapshot per query and never holds a
lock the pipeline needs, so it may stay open all day while hours are billed and re-billed;
each query sees the latest committed snapshot, or the one of `as_of`.
"""

from __future__ import annotations

from datetime import date, datetime
from pathlib import Path

import duckdb

from pipeline.storage.warehouse import (
    SnapshotReader,
    WarehouseError,
    commit_message,
    current_snapshot,
    has_catalog,
    ledger_writer,
    read_connection,
    transaction,
    warehouse_dir,
)


def connect(
    data_dir: str | Path, *, as_of: datetime | int | None = None
) -> duckdb.DuckDBPyConnection:
    """A read-only connection to the warehouse of `data_dir` (or to the warehouse directory
    itself): the latest snapshot, or `as_of` a time (aware) or snapshot id."""
    return read_connection(_warehouse_of(data_dir), as_of=as_of)


def snapshot_reader(data_dir: str | Path) -> SnapshotReader:
    """A read-only connection to the warehouse of `data_dir` for a server to keep open: each of
    its reads is of one snapshot, that snapshot's published files verified."""
    return SnapshotReader(_warehouse_of(data_dir))


def _warehouse_of(data_dir: str | Path) -> Path:
    directory = Path(data_dir)
    return directory if has_catalog(directory) else warehouse_dir(directory)


def close_month(data_dir: str | Path, month: date) -> list[tuple[str, str, int]]:
    """Close a UTC month: number one invoice per tenant with published charges in it, and
    freeze the snapshot they were computed from (`closed_months.snapshot`), so its FOCUS
    export stays what was invoiced even after an hour of it is re-billed. Refused if the
    month is closed already, has hours held back, or has no published hour. Each tenant's
    invoice adds the adjustments carried on it (`invoice_adjustments`). Returns
    (invoice id, tenant, amount in nano-dollars) per invoice."""
    month = month.replace(day=1)
    label = month.strftime("%Y-%m")
    con = ledger_writer(_warehouse_of(data_dir))
    try:
        in_month = "date_trunc('month', hour) = ?"
        if con.execute("SELECT count(*) FROM closed_months WHERE month = ?", [month]).fetchall()[0][
            0
        ]:
            raise WarehouseError(f"{label} is closed already")
        held = con.execute(
            f"SELECT hour, pool, reason FROM held_back_hours WHERE {in_month} ORDER BY ALL", [month]
        ).fetchall()
        if held:
            listed = "; ".join(f"{h:%Y-%m-%dT%H} {p}: {r}" for h, p, r in held)
            raise WarehouseError(
                f"{label} has hours held back from finance ({listed}); re-run them until they "
                "reconcile before closing the month"
            )
        frozen = current_snapshot(con)
        # The month's charges, and the corrections of closed months carried on its invoices.
        totals = con.execute(
            "SELECT tenant, sum(amount_nano)::BIGINT FROM ("
            f"SELECT tenant, amount_nano FROM published_ledger_lines WHERE {in_month} "
            "UNION ALL SELECT tenant, amount_nano FROM invoice_adjustments WHERE invoice_month = ?"
            ") GROUP BY tenant ORDER BY tenant",
            [month, month],
        ).fetchall()
        if not totals:
            raise WarehouseError(f"{label}: no published hours to invoice")
        invoices = [
            (f"SL-{month:%Y%m}-{number:04d}", tenant, amount)
            for number, (tenant, amount) in enumerate(totals, start=1)
        ]
        with transaction(con):
            con.executemany(
                "INSERT INTO invoice_numbers VALUES (?, ?, ?, ?)",
                [[month, tenant, invoice_id, amount] for invoice_id, tenant, amount in invoices],
            )
            con.execute("INSERT INTO closed_months VALUES (?, ?, now())", [month, frozen])
            commit_message(con, f"close {label}", month=label, snapshot=frozen)
    finally:
        con.close()
    return invoices
