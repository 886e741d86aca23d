"""Publishing a pool-hour: its ledger into the warehouse, replacing the hour exactly."""

from __future__ import annotations

import duckdb

from pipeline.attribution.ledger import HourLedger
from pipeline.storage.warehouse import replace_hour


def publish_hour(con: duckdb.DuckDBPyConnection, ledger: HourLedger) -> None:
    """Replace the hour's invoice, ledger lines and request costs in one transaction.

    Lines that do not add up to the invoice are still written: the money check then fails and
    holds the hour back from the finance views, with the difference in its detail.
    """
    replace_hour(con, ledger.hour, ledger.pool, ledger.published_tables())
