"""Attributing one pool-hour, from the lake to its `HourLedger`.

gather_inputs        what the attribution needs from the warehouse (committed batches, the
                     context of the hour's requests, the engine version), taken in one
                     short step; `pipeline.lake.save_inputs` keeps it for the next
attribute_pool_hour  the hour's steps of the committed batches, their requests' context
                     and the pool's policies -> the hour's ledger; reads only the lake
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

import duckdb
import numpy as np
import polars as pl

from pipeline.attribution.hour import attribute_hour
from pipeline.attribution.workmodel import SlotBatch, WeightSource, split_fixed
from pipeline.gateway import context_for_requests
from pipeline.hours import hour_key, to_warehouse, utc_hour
from pipeline.ingest import STEP_KEY, committed_batches
from pipeline.lake import AttributionInputs, HourInput, load_hour
from pipeline.ledger import DECODE_CONTEXTS_SCHEMA, RESOURCE_WORK_SCHEMA, RESOURCES, HourLedger
from pipeline.weights import kernel_weights
from schemas.config import Pool


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
    keys = [*STEP_KEY, "request_id"]
    requests = load_hour(lake, pool.name, hour, batches, columns=keys)
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
    lake: Path, pool: Pool, inputs: AttributionInputs, weights: WeightSource
) -> HourLedger:
    """Attribute one pool-hour: the hour's steps of the committed batches, their requests'
    context, the pool's policies. Reads only the lake."""
    if inputs.pool != pool.name:
        raise ValueError(f"attribution inputs of pool {inputs.pool!r} given for pool {pool.name!r}")
    data = load_hour(lake, pool.name, inputs.hour, inputs.batches, hashes=inputs.lake_hashes)
    # Every row is of this pool: without the constant column the attribution's joins copy less.
    slots, holders = data.slots.drop("pool"), data.holders.drop("pool")
    attribution = attribute_hour(
        inputs.hour, pool, data.steps, slots, holders, inputs.context, weights
    )
    resource_work, decode_contexts = resource_parts(pool, data)
    stamp = [
        pl.lit(to_warehouse(inputs.hour)).cast(pl.Datetime("us")).alias("hour"),
        pl.lit(pool.name).alias("pool"),
    ]
    return HourLedger(
        hour=inputs.hour,
        pool=pool.name,
        invoices=pl.DataFrame([attribution.invoice]).with_columns(stamp),
        ledger_lines=attribution.ledger_lines.with_columns(stamp),
        request_costs=attribution.request_costs.with_columns(stamp),
        resource_work=resource_work,
        decode_contexts=decode_contexts,
    )


def resource_parts(pool: Pool, data: HourInput) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Per request, the kernel's work on each resource (us, `pipeline.ledger.RESOURCE_WORK_SCHEMA`),
    and how many decode slots ran at each context length (`DECODE_CONTEXTS_SCHEMA`).

    A slot's work on a resource is its own part plus its share of the step's fixed part under
    the pool's fixed-cost policy, as the kernel weights weigh it. Kept with the ledger so that
    the report splits each request's compute charge over the resources without pricing the
    hour again; computed with the kernel whatever the pool's weights, since only the kernel
    knows resources."""
    steps = data.steps.with_row_index("step").select(
        "replica", "seq", pl.col("step").cast(pl.Int64)
    )
    slots = data.slots.join(steps, on=["replica", "seq"], how="inner").sort("step", "slot_index")
    batch = SlotBatch.of_slots(slots["step"].to_numpy(), steps.height, slots)
    fixed_us, slot_us = kernel_weights(pool).kernel.slot_work_many(
        batch.kernel_slots, batch.n_steps
    )
    fixed_split = np.column_stack(
        [
            split_fixed(fixed_us[:, r], batch, pool.policies.fixed_cost)
            for r in range(len(RESOURCES))
        ]
    )
    work = fixed_split + slot_us
    resource_work = (
        slots.select("request_id")
        .with_columns(pl.Series(f"{r}_us", work[:, i]) for i, r in enumerate(RESOURCES))
        # Ordered groups keep float sums in one order, so the same data gives the same figures.
        .group_by("request_id", maintain_order=True)
        .agg(pl.col(f"{r}_us").sum() for r in RESOURCES)
        .cast(RESOURCE_WORK_SCHEMA)
    )
    decode = (slots["context_tokens"] >= slots["prompt_tokens"]) & (
        slots["new_tokens"] <= pool.engine.decode_threshold
    )
    decode_contexts = (
        slots.filter(decode)
        .group_by("context_tokens")
        .agg(pl.len().alias("slots"))
        .sort("context_tokens")
        .cast(DECODE_CONTEXTS_SCHEMA)
    )
    return resource_work, decode_contexts
