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

from pipeline.attribution.hour import ROWS_PER_BATCH, attribute_hour, step_batches
from pipeline.attribution.layout import StepKeys, gather, lay_out_rows
from pipeline.attribution.workmodel import TOKEN_COLUMNS, SlotBatch, WeightSource, split_fixed
from pipeline.gateway import context_for_requests
from pipeline.hours import hour_key, to_warehouse, utc_hour
from pipeline.ingest import committed_batches
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
    lake: Path, pool: Pool, inputs: AttributionInputs, weights: WeightSource
) -> HourLedger:
    """Attribute one pool-hour: the hour's steps of the committed batches, their requests'
    context, the pool's policies. Reads only the lake."""
    if inputs.pool != pool.name:
        raise ValueError(f"attribution inputs of pool {inputs.pool!r} given for pool {pool.name!r}")
    loaded = load_hour(lake, pool.name, inputs.hour, inputs.batches, hashes=inputs.lake_hashes)
    # Every row is of this pool: without the constant column the attribution's joins copy less
    # and the hour's slots hold 16 bytes a row less (0.3 GiB in a busy hour).
    data = HourInput(loaded.steps, loaded.slots.drop("pool"), loaded.holders.drop("pool"))
    del loaded
    attribution = attribute_hour(
        inputs.hour, pool, data.steps, data.slots, data.holders, inputs.context, weights
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


def resource_parts(
    pool: Pool, data: HourInput, rows_per_batch: int = ROWS_PER_BATCH
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Per request, the kernel's work on each resource (us, `pipeline.ledger.RESOURCE_WORK_SCHEMA`),
    and how many decode slots ran at each context length (`DECODE_CONTEXTS_SCHEMA`).

    A slot's work on a resource is its own part plus its share of the step's fixed part under
    the pool's fixed-cost policy, as the kernel weights weigh it. Kept with the ledger so that
    the report splits each request's compute charge over the resources without pricing the
    hour again; computed with the kernel whatever the pool's weights, since only the kernel
    knows resources.

    The kernel's per-slot terms take a few hundred bytes a slot, gigabytes for a busy hour, so
    the slots are priced `rows_per_batch` at a time, in batches of whole steps, and only each
    slot's five figures are kept for the per-request sums, which run over the whole hour in one
    order. A batch holds at least two steps: the kernel sums a lone step's slots in another
    order than several steps' (`slot_work_many`). For a dense model the figures are then those
    of pricing the hour at once, bit for bit; the kernel's matrix products over layer kinds
    (MoE models) may round the last bit differently with the batch's width, as in the
    attribution's own batches."""
    steps, slots = data.steps, data.slots
    replicas = sorted(steps["replica"].unique().to_list())
    replica_code = steps["replica"].replace_strict(
        replicas, range(len(replicas)), return_dtype=pl.Int64
    )
    # Each slot's step is its step's row in `steps`: the slots are priced in that order.
    keys = StepKeys.build(
        replicas, replica_code.to_numpy(), steps["seq"].to_numpy(), np.arange(steps.height)
    )
    requests = slots["request_id"].unique(maintain_order=True)
    layout = lay_out_rows(slots, "slots", "slot_index", keys, steps.height, requests)
    kernel = kernel_weights(pool).kernel
    work = np.empty((len(RESOURCES), int(layout.offsets[-1])))
    for first, end in step_batches(layout.offsets, rows_per_batch, min_steps=2):
        rows = layout.rows(first, end)
        batch = SlotBatch.of_slots(
            layout.step[rows] - first, end - first, gather(slots, list(TOKEN_COLUMNS), rows)
        )
        fixed_us, slot_us = kernel.slot_work_many(batch.kernel_slots, batch.n_steps)
        done = slice(int(layout.offsets[first]), int(layout.offsets[end]))
        for r in range(len(RESOURCES)):
            work[r, done] = (
                split_fixed(fixed_us[:, r], batch, pool.policies.fixed_cost) + slot_us[:, r]
            )
    request = layout.request if layout.order is None else layout.request[layout.order]
    totals = (
        pl.DataFrame({"request": request, **{f"{r}_us": work[i] for i, r in enumerate(RESOURCES)}})
        # Ordered groups keep float sums in one order, so the same data gives the same figures.
        .group_by("request", maintain_order=True)
        .agg(pl.col(f"{r}_us").sum() for r in RESOURCES)
    )
    resource_work = totals.select(
        requests.gather(totals["request"]).alias("request_id"), *(f"{r}_us" for r in RESOURCES)
    ).cast(RESOURCE_WORK_SCHEMA)
    decode_contexts = (
        slots.lazy()
        .filter(
            (pl.col("context_tokens") >= pl.col("prompt_tokens"))
            & (pl.col("new_tokens") <= pool.engine.decode_threshold)
        )
        .group_by("context_tokens")
        .agg(pl.len().alias("slots"))
        .sort("context_tokens")
        .collect()
        .cast(DECODE_CONTEXTS_SCHEMA)
    )
    return resource_work, decode_contexts
