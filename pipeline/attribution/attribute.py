"""Attributing one pool-hour, from the lake to its `HourAttribution` and `HourLedger`.

gather_inputs        what the attribution needs from the warehouse (committed batches, the
                     context of the hour's requests, the engine version), taken in one
                     short step; `pipeline.storage.lake.save_inputs` keeps it for the next
attribute_pool_hour  the hour's steps of the committed batches, their requests' context
                     and the pool's policies -> the hour's attribution and its ledger;
                     reads only the lake
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

import duckdb
import polars as pl

from pipeline.attribution.allocations import RequestSelection
from pipeline.attribution.hour import HourAttribution, attribute_hour
from pipeline.attribution.weights import kernel_weights
from pipeline.attribution.workmodel import WeightSource
from pipeline.ingestion.gateway import context_for_requests
from pipeline.ingestion.ingest import committed_batches
from pipeline.storage.lake import AttributionInputs, HourInput, load_hour
from schemas.config import Pool
from schemas.units import hour_key, utc_hour


def lake_hashes(con: duckdb.DuckDBPyConnection, pool: str, hour: datetime) -> dict[str, str]:
    """The recorded sha256 of the pool's lake files of `hour` and the hour before (which holds
    the steps straddling into it)."""
    partitions = [f"%/pool={pool}/hour={hour_key(h)}/%" for h in (hour, hour - timedelta(hours=1))]
    return dict(
        con.execute(
            "SELECT path, sha256 FROM lake_files WHERE path LIKE ? OR path LIKE ?", partitions
        ).fetchall()
    )


def gather_inputs(
    con: duckdb.DuckDBPyConnection, lake: Path, pool: Pool, hour: datetime
) -> AttributionInputs:
    """The hour's attribution inputs, read from the warehouse and the lake."""
    hour = utc_hour(hour)
    batches = committed_batches(con)
    requests = load_hour(lake, pool.name, hour, batches, columns=["request_id"])
    request_ids = pl.concat([requests.slots["request_id"], requests.holders["request_id"]]).unique()
    # fetchall, not fetchone: a result left unfinished blocks the connection's next query.
    logged = con.execute(
        "SELECT engine_version, driver_version FROM segments WHERE pool = ? "
        "GROUP BY ALL ORDER BY sum(steps) DESC, engine_version, driver_version LIMIT 1",
        [pool.name],
    ).fetchall()
    return AttributionInputs(
        hour,
        pool.name,
        frozenset(batches),
        context_for_requests(con, request_ids),
        (str(logged[0][0]), str(logged[0][1])) if logged else None,
        lake_hashes(con, pool.name, hour),
    )


def attribute_pool_hour(
    lake: Path,
    pool: Pool,
    inputs: AttributionInputs,
    weights: WeightSource,
    *,
    allocations_of: RequestSelection = (),
) -> HourAttribution:
    """Attribute one pool-hour: the hour's steps of the committed batches, their requests'
    context, the pool's policies. Reads only the lake. `allocations_of`: the requests (or
    "all") whose per-step allocation rows to keep (`attribute_hour`).

    Whatever the pool's weights, each request's work on each resource is totalled with the
    kernel (only the kernel knows resources) and kept with the ledger, so that the report
    splits each request's compute charge over the resources without pricing the hour again."""
    if inputs.pool != pool.name:
        raise ValueError(f"attribution inputs of pool {inputs.pool!r} given for pool {pool.name!r}")
    loaded = load_hour(lake, pool.name, inputs.hour, inputs.batches, hashes=inputs.lake_hashes)
    # Every row is of this pool: without the constant column the attribution's joins copy less
    # and the hour's slots hold 16 bytes a row less (0.3 GiB in a busy hour).
    data = HourInput(loaded.steps, loaded.slots.drop("pool"), loaded.holders.drop("pool"))
    del loaded
    return attribute_hour(
        inputs.hour,
        pool,
        data.steps,
        data.slots,
        data.holders,
        inputs.context,
        weights,
        resource_weights=kernel_weights(pool),
        allocations_of=allocations_of,
    )
