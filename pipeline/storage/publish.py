"""Publishing a pool-hour: its ledger into the warehouse, replacing the hour exactly."""

from __future__ import annotations

import duckdb

from pipeline.attribution.ledger import HourLedger
from pipeline.storage.integrity import record_published_hour, verify_published_hour
from pipeline.storage.warehouse import data_files, replace_hour


def publish_hour(con: duckdb.DuckDBPyConnection, ledger: HourLedger) -> None:
    """Replace the hour's invoice, ledger lines and request costs in one transaction, with
    their digest (pipeline.storage.integrity). An hour published before is verified first: if
    what was published has changed since, it is refused (IntegrityError), not overwritten.

    Lines that do not add up to the invoice are still written: the money check then fails and
    holds the hour back from the finance views, with the difference in its detail.
    """
    data = data_files(con)
    verify_published_hour(con, data, ledger.hour, ledger.pool)
    replace_hour(
        con,
        ledger.hour,
        ledger.pool,
        ledger.published_tables(),
        then=lambda writing: record_published_hour(writing, data, ledger.hour, ledger.pool),
    )
