"""The ledger of one pool-hour: what it costs, line by line, as attribution leaves it and the
warehouse publishes it.

`HourLedger` is the one name for it: attribution (`pipeline.attribution.hour`) makes it, the lake
(`pipeline.storage.lake`) stores it, `pipeline.storage.publish` writes its tables into the warehouse, and the
report and `stepledger explain` read its per-request resource work.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import numpy as np
import polars as pl

from pipeline.attribution.allocator import largest_remainder
from pipeline.storage.warehouse import HOUR_TABLES
from pricing import RESOURCES

# Every kind of ledger line, in the order reports list them (sql/schema.sql checks the same set).
LINE_KINDS = ("usage", "idle", "headroom", "unattributed", "platform_retry", "cache_credit")
# The warehouse's invoices table (sql/schema.sql), one row an hour.
INVOICE_SCHEMA = pl.Schema(
    {
        "hour": pl.Datetime("us"),
        "pool": pl.String(),
        "gpus": pl.Int64(),
        "usd_per_gpu_hour": pl.Float64(),
        "amount_nano": pl.Int64(),
    }
)
# Stored with the ledger in the lake for the report: per request the kernel's work on each
# resource (`<resource>_us`), and the decode slots' context lengths (`context_tokens`, `slots`).
RESOURCE_WORK_SCHEMA = pl.Schema(
    {"request_id": pl.String} | {f"{r}_us": pl.Float64 for r in RESOURCES}
)
DECODE_CONTEXTS_SCHEMA = pl.Schema({"context_tokens": pl.Int64, "slots": pl.Int64})
STORED_TABLES = (*HOUR_TABLES, "resource_work", "decode_contexts")


@dataclass(frozen=True)
class Invoice:
    """What the pool-hour costs: all its GPUs for the hour at the pool's price."""

    hour: datetime  # naive, holding UTC (the warehouse's TIMESTAMP)
    pool: str
    gpus: int
    usd_per_gpu_hour: float
    amount_nano: int

    def frame(self) -> pl.DataFrame:
        """The invoice as the warehouse's one-row `invoices` table (INVOICE_SCHEMA)."""
        return pl.DataFrame([vars(self)], schema=INVOICE_SCHEMA)

    @classmethod
    def from_frame(cls, invoices: pl.DataFrame) -> Invoice:
        """The invoice of a one-row `invoices` table."""
        if invoices.height != 1:
            raise ValueError(f"an hour has one invoice; the table holds {invoices.height} rows")
        row = invoices.row(0, named=True)
        return cls(**{name: row[name] for name in INVOICE_SCHEMA})


@dataclass(frozen=True)
class HourLedger:
    """One pool-hour's invoice, ledger lines and request costs, each row stamped with its hour
    and pool, ready for the warehouse tables of the same names; and the per-request resource
    work (RESOURCE_WORK_SCHEMA, empty unless priced with the pool's kernel) and decode
    contexts (DECODE_CONTEXTS_SCHEMA) the report reads."""

    hour: datetime
    pool: str
    invoice: Invoice
    ledger_lines: pl.DataFrame
    request_costs: pl.DataFrame
    resource_work: pl.DataFrame
    decode_contexts: pl.DataFrame

    @property
    def invoices(self) -> pl.DataFrame:
        """The invoice as its one-row table."""
        return self.invoice.frame()

    @property
    def amount_nano(self) -> int:
        """The hour's invoiced amount in nano-dollars."""
        return self.invoice.amount_nano

    def published_tables(self) -> dict[str, pl.DataFrame]:
        """The tables published to the warehouse, by table name."""
        return {name: getattr(self, name) for name in HOUR_TABLES}

    def resource_parts(self, request_id: str, compute_nano: int) -> dict[str, int]:
        """The request's compute charge split over the kernel's resources by its work on each
        (largest remainder, so the parts sum to the charge); empty without stored work."""
        row = self.resource_work.filter(pl.col("request_id") == request_id)
        if not row.height:
            return {}
        work_us = row.select(f"{r}_us" for r in RESOURCES).to_numpy()
        if work_us.sum() <= 0:
            return {}
        parts = split_by_resource(np.array([compute_nano]), work_us)[0]
        return dict(zip(RESOURCES, (int(p) for p in parts), strict=True))


def split_by_resource(compute_nano: np.ndarray, work_us: np.ndarray) -> np.ndarray:
    """Each row's compute charge split over RESOURCES in proportion to its work on each
    (`work_us`: one row per charge, one column per resource), largest remainder per row."""
    n_rows, n_resources = work_us.shape
    shares, _ = largest_remainder(
        compute_nano, np.repeat(np.arange(n_rows), n_resources), work_us.reshape(-1)
    )
    return shares.reshape(n_rows, n_resources)
