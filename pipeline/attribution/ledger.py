"""The ledger of one pool-hour: what it costs, line by line, as attribution leaves it and the
warehouse publishes it.

`HourLedger` is the one name for it: attribution (`pipeline.attribution.attribute`) makes it, the lake
(`pipeline.storage.lake`) stores it, `pipeline.storage.publish` writes its tables into the warehouse, and the
report reads its per-request resource work back from the lake.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import polars as pl

from pipeline.storage.warehouse import HOUR_TABLES
from pricing import RESOURCES

# Every kind of ledger line, in the order reports list them (sql/schema.sql checks the same set).
LINE_KINDS = ("usage", "idle", "headroom", "unattributed", "platform_retry", "cache_credit")
# Stored with the ledger in the lake for the report: per request the kernel's work on each
# resource (`<resource>_us`), and the decode slots' context lengths (`context_tokens`, `slots`).
RESOURCE_WORK_SCHEMA = pl.Schema(
    {"request_id": pl.String} | {f"{r}_us": pl.Float64 for r in RESOURCES}
)
DECODE_CONTEXTS_SCHEMA = pl.Schema({"context_tokens": pl.Int64, "slots": pl.Int64})
STORED_TABLES = (*HOUR_TABLES, "resource_work", "decode_contexts")


@dataclass(frozen=True)
class HourLedger:
    """One pool-hour's invoice (one row), ledger lines and request costs, each row stamped
    with its hour and pool, ready for the warehouse tables of the same names; and the
    per-request resource work and decode contexts the report reads."""

    hour: datetime
    pool: str
    invoices: pl.DataFrame
    ledger_lines: pl.DataFrame
    request_costs: pl.DataFrame
    resource_work: pl.DataFrame
    decode_contexts: pl.DataFrame

    @property
    def amount_nano(self) -> int:
        return int(self.invoices["amount_nano"][0])

    def published_tables(self) -> dict[str, pl.DataFrame]:
        return {name: getattr(self, name) for name in HOUR_TABLES}
