"""attribute_hour: one pool's hour of steps split into request costs and ledger lines.

Order of work, all vectorised over the hour:
1. each step's part inside the hour is priced from the clock (`clock.py`);
2. each slot's compute work comes from the pool's weight source, each slot's and holder's KV
   weight from its blocks (per the prefix-cache policy), blended with the period's alpha;
3. the largest-remainder allocator splits every step's integer cost among its rows, and each
   row's amount is split into compute and KV parts;
4. rows roll up to requests, joined with their gateway context: no context -> `unattributed`,
   a platform-caused retry the platform pays for -> `platform_retry`, else `usage`;
5. cache-read charges (policy `cache_read`) and their `cache_credit`, then idle/headroom
   lines, make the hour's lines sum exactly to the invoice (asserted).

Label conventions for lines that belong to no tenant feature: unattributed usage is tenant
and feature "(unattributed)"; platform-paid retries are charged to the pool's capacity owner
as feature "(platform-retry)"; idle the capacity owner pays is feature "(idle)"; headroom is
charged to the SLO owner as feature "(headroom)"; the cache credit goes to the capacity owner
as feature "(prefix-cache)". Spread idle lands on each tenant's own features.
Hours in the frames are naive datetimes holding UTC (the warehouse's TIMESTAMP).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
import polars as pl

from pipeline.ahead import ordered_ahead
from pipeline.attribution.allocations import AllocationRows, RequestSelection
from pipeline.attribution.allocator import blend_and_allocate, largest_remainder, split_compute_kv
from pipeline.attribution.clock import step_costs_in_hour
from pipeline.attribution.kv import alpha_for_period, first_writer_blocks, holder_blocks
from pipeline.attribution.layout import AttributionError, RowLayout, StepKeys, gather, lay_out_rows
from pipeline.attribution.ledger import (
    DECODE_CONTEXTS_SCHEMA,
    RESOURCE_WORK_SCHEMA,
    HourLedger,
    Invoice,
)
from pipeline.attribution.rollup import RequestTotals, largest_per_request
from pipeline.attribution.workmodel import KernelWeights, SlotBatch, WeightSource
from pricing import RESOURCES
from schemas.config import Pool
from schemas.records import SLOT_COLUMNS
from schemas.units import HOUR_NS, NS_PER_SECOND, hour_start_ns, to_warehouse

UNATTRIBUTED = "(unattributed)"
PLATFORM_RETRY_FEATURE = "(platform-retry)"
IDLE_FEATURE = "(idle)"
HEADROOM_FEATURE = "(headroom)"
CACHE_FEATURE = "(prefix-cache)"

LEDGER_LINE_SCHEMA = pl.Schema(
    {
        "hour": pl.Datetime("us"),
        "pool": pl.String(),
        "tenant": pl.String(),
        "feature": pl.String(),
        "line_kind": pl.String(),
        "amount_nano": pl.Int64(),
        "requests": pl.Int64(),
        "new_tokens": pl.Int64(),
        "cached_tokens": pl.Int64(),
        "weights_version": pl.String(),
        "policy_version": pl.String(),
    }
)
REQUEST_COST_SCHEMA = pl.Schema(
    {
        "hour": pl.Datetime("us"),
        "pool": pl.String(),
        "request_id": pl.String(),
        "tenant": pl.String(),
        "feature": pl.String(),
        "api_key_id": pl.String(),
        "compute_nano": pl.Int64(),
        "kv_nano": pl.Int64(),
        "amount_nano": pl.Int64(),
        "steps": pl.Int64(),
        "new_tokens": pl.Int64(),
        "cached_tokens": pl.Int64(),
        "prompt_tokens": pl.Int64(),
        "output_tokens": pl.Int64(),
        # The ledger line the request's charge is on: usage, unattributed or platform_retry.
        "line_kind": pl.String(),
    }
)
REPLICA_FACTS_SCHEMA = pl.Schema(
    {
        "replica": pl.String(),
        "steps": pl.Int64(),
        "first_seq": pl.Int64(),
        "last_seq": pl.Int64(),
        "busy_ns": pl.Int64(),
        "step_cost_nano": pl.Int64(),
        "idle_nano": pl.Int64(),
        "admission_blocked_steps": pl.Int64(),
    }
)
CONTEXT_COLUMNS = ("request_id", "tenant", "feature", "api_key_id", "retry_of", "retry_cause")
STEP_COLUMNS = ("pool", "replica", "seq", "start_utc_ns", "end_utc_ns", "admission_blocked")
# Slot and holder rows allocated at a time: bounds the working memory (the pricing kernel's
# per-slot terms are a few hundred bytes a row) while keeping per-batch overhead negligible.
ROWS_PER_BATCH = 1 << 20
# Each request's work on each of the kernel's resources, as RESOURCE_WORK_SCHEMA names it.
RESOURCE_COLUMNS = [f"{r}_us" for r in RESOURCES]


@dataclass(frozen=True)
class HourAttribution:
    """One pool-hour, attributed: its ledger and the facts that explain it.

    `ledger.ledger_lines` has exactly the warehouse `ledger_lines` columns and sums to
    `ledger.invoice.amount_nano`; `ledger.request_costs` has exactly the warehouse
    `request_costs` columns. `replicas` (REPLICA_FACTS_SCHEMA) and the scalar facts below are
    what the hourly reconciliation checks.
    """

    ledger: HourLedger
    replicas: pl.DataFrame
    # Per request: request_id, exact_nano (the sum of its exact real shares, beside the
    # integer amount_nano for auditing the rounding), kv_block_seconds (blocks held x time inside
    # the hour, as charged under the prefix-cache policy), kv_byte_seconds (kernel weights
    # only; else null) and cache_read_nano (its prefix-cache read charge, in its amount_nano).
    request_details: pl.DataFrame
    # The per-step allocation rows (ALLOCATION_SCHEMA) of the requests asked for.
    allocations: pl.DataFrame
    step_count: int  # steps overlapping the hour
    busy_ns: int  # step time inside the hour, summed over replicas
    alpha: float
    admission_blocked_fraction: float
    usage_nano: int  # everything charged to requests (usage + unattributed + platform_retry)
    unattributed_nano: int
    unattributed_requests: int
    platform_retry_nano: int
    cache_read_nano: int  # charged for prefix-cache hits under cache_read (credited back)
    cache_saving_nano: (
        int  # what hit tokens would have cost at the full prefill rate, minus the charge
    )
    idle_nano: int  # invoice minus usage: idle plus headroom
    headroom_nano: int
    weights_version: str
    policy_version: str

    @property
    def unattributed_fraction(self) -> float:
        """The unattributed charge as a fraction of everything charged to requests (0 if none)."""
        return self.unattributed_nano / self.usage_nano if self.usage_nano else 0.0


def _require_columns(frame: pl.DataFrame, name: str, columns: tuple[str, ...]) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise AttributionError(f"{name} table lacks column(s) {missing}; it has {frame.columns}")


def steps_in_hour(
    hour_start_utc_ns: int, pool: Pool, steps: pl.DataFrame
) -> tuple[pl.DataFrame, StepKeys]:
    """The steps overlapping the hour, validated and ordered (replica, start, seq), with the
    keys of every logged step (the hour's and its neighbours')."""
    _require_columns(steps, "steps", STEP_COLUMNS)
    for column in STEP_COLUMNS:
        missing = steps[column].null_count()
        if missing:
            raise AttributionError(f"steps: {missing} row(s) have no {column}")
    other_pools = steps.filter(pl.col("pool") != pool.name)["pool"].unique().to_list()
    if other_pools:
        raise AttributionError(
            f"steps table holds rows of pool(s) {sorted(other_pools)}, attributing pool {pool.name!r}"
        )
    replicas = sorted(r.id for r in pool.streams)
    unknown = sorted(set(steps["replica"].unique().to_list()) - set(replicas))
    if unknown:
        raise AttributionError(
            f"steps table names replica(s) {unknown} not in pool {pool.name!r} ({replicas})"
        )
    backwards = steps.filter(pl.col("end_utc_ns") < pl.col("start_utc_ns"))
    if backwards.height:
        row = backwards.row(0, named=True)
        raise AttributionError(
            f"steps: replica {row['replica']} seq {row['seq']} ends before it starts "
            f"({row['start_utc_ns']} > {row['end_utc_ns']}); {backwards.height} such step(s)"
        )
    # Only the columns attribution reads: the hour's copy stays small.
    keyed = steps.select(
        pl.col("replica")
        .replace_strict(replicas, range(len(replicas)), return_dtype=pl.Int64)
        .alias("replica_code"),
        *STEP_COLUMNS[1:],
    ).with_row_index("row")
    hour_end = hour_start_utc_ns + HOUR_NS
    # Codes follow the names' sorted order, so this is the order by replica name.
    inside = keyed.filter(
        (pl.col("start_utc_ns") < hour_end)
        & (
            (pl.col("end_utc_ns") > hour_start_utc_ns)
            | (pl.col("start_utc_ns") >= hour_start_utc_ns)
        )
    ).sort("replica_code", "start_utc_ns", "seq")
    hour_step = np.full(steps.height, -1, dtype=np.int64)
    hour_step[inside["row"].to_numpy()] = np.arange(inside.height)
    keys = StepKeys.build(
        replicas, keyed["replica_code"].to_numpy(), keyed["seq"].to_numpy(), hour_step
    )
    duplicate = keys.duplicate_in_hour()
    if duplicate:
        raise AttributionError(
            f"steps: replica {duplicate[0]} seq {duplicate[1]} appears more than once"
        )
    return inside.drop("row", "replica_code"), keys


def step_batches(
    row_offsets: np.ndarray, rows_per_batch: int, min_steps: int = 1
) -> list[tuple[int, int]]:
    """Consecutive step ranges of about `rows_per_batch` rows each (a bigger step is a batch
    alone), each of at least `min_steps` steps when the steps allow (a shorter one is merged
    with its neighbour).

    `row_offsets[s]` is the number of rows before step s."""
    cuts = np.searchsorted(
        row_offsets, np.arange(rows_per_batch, int(row_offsets[-1]), rows_per_batch)
    )
    bounds = np.unique(np.concatenate([[0], cuts, [row_offsets.shape[0] - 1]])).tolist()
    if min_steps > 1 and len(bounds) > 2:
        kept = [bounds[0]]
        for bound in bounds[1:-1]:
            if bound - kept[-1] >= min_steps and bounds[-1] - bound >= min_steps:
                kept.append(bound)
        bounds = [*kept, bounds[-1]]
    return list(itertools.pairwise(bounds))


def _slot_kv_blocks(
    pool: Pool, slots: dict[str, np.ndarray], request_hits: np.ndarray | None
) -> np.ndarray:
    """Each slot's KV weight in blocks under the pool's prefix-cache policy (`request_hits`:
    each slot's request's prefix-hit tokens, for first_writer)."""
    if request_hits is None:
        return slots["kv_blocks"].astype(np.float64)
    return first_writer_blocks(
        slots["context_tokens"].astype(np.float64),
        slots["new_tokens"].astype(np.float64),
        request_hits.astype(np.float64),
        pool.kv_block_size,
    )


@dataclass(frozen=True)
class _WeighedBatch:
    """A batch of steps first..end-1: its slot rows then its holder rows, each with its step
    in the batch and its weights; each slot's request, token columns and resource work; each
    holder's state."""

    first: int
    end: int
    slot_columns: dict[str, np.ndarray]
    slot_request: np.ndarray
    holder_state: np.ndarray
    row_step: np.ndarray
    compute_work: np.ndarray
    kv_weight: np.ndarray
    resource_work: np.ndarray | None


@dataclass(frozen=True)
class _BatchWeigher:
    """Weighs the hour's rows a batch of steps at a time, from their layouts in the hour."""

    pool: Pool
    slots: pl.DataFrame
    holders: pl.DataFrame
    slot_layout: RowLayout
    holder_layout: RowLayout
    weights: WeightSource
    resource_weights: KernelWeights | None
    # Each request's largest prefix-hit tokens of the hour (policy first_writer), else None.
    prefix_hits: np.ndarray | None

    def weigh(self, first: int, end: int) -> _WeighedBatch:
        """The batch's rows with their compute and KV weights (and resource work)."""
        fixed_cost = self.pool.policies.fixed_cost
        slot_rows = self.slot_layout.rows(first, end)
        holder_rows = self.holder_layout.rows(first, end)
        slot_columns = gather(self.slots, list(SLOT_COLUMNS), slot_rows)
        holder_columns = gather(self.holders, ["kv_blocks", "state"], holder_rows)
        slot_step = self.slot_layout.step[slot_rows] - first
        slot_request = self.slot_layout.request[slot_rows]
        batch = SlotBatch.of_slots(slot_step, end - first, slot_columns)
        priced = None if self.resource_weights is None else self.resource_weights.price(batch)
        return _WeighedBatch(
            first=first,
            end=end,
            slot_columns=slot_columns,
            slot_request=slot_request,
            holder_state=holder_columns["state"],
            row_step=np.concatenate([slot_step, self.holder_layout.step[holder_rows] - first]),
            compute_work=np.concatenate(
                [
                    self.weights.compute_work(batch, fixed_cost, priced),
                    np.zeros(holder_columns["kv_blocks"].shape[0]),
                ]
            ),
            kv_weight=np.concatenate(
                [
                    _slot_kv_blocks(
                        self.pool,
                        slot_columns,
                        None if self.prefix_hits is None else self.prefix_hits[slot_request],
                    ),
                    holder_blocks(holder_columns["kv_blocks"], holder_columns["state"]),
                ]
            ),
            resource_work=None if priced is None else priced.resource_work_us(batch, fixed_cost),
        )


@dataclass(frozen=True)
class _AllocatedBatch:
    """A weighed batch's rows split: each row's integer share, its compute and KV parts and
    exact share, its KV block-seconds, and its step's total compute and KV weights."""

    shares: np.ndarray
    compute_nano: np.ndarray
    kv_nano: np.ndarray
    exact: np.ndarray
    block_seconds: np.ndarray
    step_work: np.ndarray
    step_kv_blocks: np.ndarray


def _allocate(
    weighed: _WeighedBatch, cost: np.ndarray, busy: np.ndarray, alpha: float
) -> _AllocatedBatch:
    """Split each step of the batch (`cost`, `busy`: the hour's steps) among its rows."""
    first, end, row_step = weighed.first, weighed.end, weighed.row_step
    step_work = np.bincount(row_step, weights=weighed.compute_work, minlength=end - first)
    step_kv_blocks = np.bincount(row_step, weights=weighed.kv_weight, minlength=end - first)
    # A step with nobody to carry it (no slot work, no blocks held) is idle time.
    carried = (step_work > 0) | (step_kv_blocks > 0)
    split = blend_and_allocate(
        np.where(carried, cost[first:end], 0),
        row_step,
        weighed.compute_work,
        weighed.kv_weight,
        alpha,
    )
    compute_nano, kv_nano = split_compute_kv(split.shares, *split.parts())
    return _AllocatedBatch(
        shares=split.shares,
        compute_nano=compute_nano,
        kv_nano=kv_nano,
        exact=split.exact,
        block_seconds=weighed.kv_weight * busy[first:end][row_step] / NS_PER_SECOND,
        step_work=step_work,
        step_kv_blocks=step_kv_blocks,
    )


def _keep_allocations(
    allocations: AllocationRows,
    weighed: _WeighedBatch,
    holder_request: np.ndarray,
    allocated: _AllocatedBatch,
    cost: np.ndarray,
    busy: np.ndarray,
) -> None:
    """Hand the batch's rows, as allocated, to `allocations`."""
    n_slots, row_step = weighed.slot_request.shape[0], weighed.row_step
    hour_step = weighed.first + row_step
    allocations.add(
        np.concatenate([weighed.slot_request, holder_request]),
        {
            "step": hour_step,
            "role": np.concatenate(
                [np.full(n_slots, "slot", dtype=object), weighed.holder_state.astype(object)]
            ),
            "cost_nano": cost[hour_step],
            "busy_ns": busy[hour_step],
            "share_nano": allocated.shares,
            "compute_nano": allocated.compute_nano,
            "kv_nano": allocated.kv_nano,
            "work": weighed.compute_work,
            "step_work": allocated.step_work[row_step],
            "kv_blocks": weighed.kv_weight,
            "step_kv_blocks": allocated.step_kv_blocks[row_step],
            "kv_block_seconds": allocated.block_seconds,
        },
    )


def _attribute_rows(
    pool: Pool,
    hour_steps: pl.DataFrame,
    keys: StepKeys,
    slots: pl.DataFrame,
    holders: pl.DataFrame,
    weights: WeightSource,
    resource_weights: KernelWeights | None,
    alpha: float,
    rows_per_batch: int,
    allocations_of: RequestSelection,
) -> tuple[pl.DataFrame, pl.DataFrame | None, pl.DataFrame]:
    """Split every step's cost among its slots and holders and total the rows per request.

    Steps are independent, so the hour is processed a batch of steps at a time: memory stays
    bounded by the batch, not the hour's tens of millions of rows. Within a step slots come
    first, then holders (the allocator's tie-break by position). A batch holds at least two
    steps when the hour has them: the kernel sums a lone step's slots in another order than
    several steps' (`slot_work_many`), so its figures would depend on where the batches fall.
    Returns one row per request: request_id, rollup.INTEGER_TOTALS but `rows`, rollup.REAL_TOTALS;
    with `resource_weights`, one row per request with slots: request_id and its slots'
    work on each of the kernel's RESOURCES (`<resource>_us`, as `PricedBatch.resource_work_us`);
    and the allocation rows (ALLOCATION_SCHEMA) of the requests `allocations_of` chooses.
    """
    n_steps = hour_steps.height
    request_ids = pl.concat(
        [slots["request_id"].cast(pl.String), holders["request_id"].cast(pl.String)]
    ).unique(maintain_order=True)
    slot_layout = lay_out_rows(slots, "slots", "slot_index", keys, n_steps, request_ids)
    holder_layout = lay_out_rows(holders, "holders", "holder_index", keys, n_steps, request_ids)
    prefix_hits = _prefix_hits(pool, slots, slot_layout, len(request_ids))
    weigher = _BatchWeigher(
        pool, slots, holders, slot_layout, holder_layout, weights, resource_weights, prefix_hits
    )
    cost = hour_steps["cost_nano"].to_numpy()
    busy = hour_steps["busy_ns"].to_numpy()
    totals = RequestTotals(len(request_ids), 0 if resource_weights is None else len(RESOURCES))
    allocations = AllocationRows(allocations_of, request_ids)
    # Holder rows are totalled after every slot row, as the rows of the whole hour are ordered.
    n_holders = int(holder_layout.offsets[-1])
    held = {
        "amount": np.empty(n_holders, dtype=np.int64),
        "compute": np.empty(n_holders, dtype=np.int64),
        "exact": np.empty(n_holders),
        "block_seconds": np.empty(n_holders),
    }
    batches = step_batches(slot_layout.offsets + holder_layout.offsets, rows_per_batch, min_steps=2)
    # Pricing, mostly numpy without the GIL, runs ahead of the allocation, which is in order.
    for weighed in ordered_ahead(lambda bounds: weigher.weigh(*bounds), batches):
        allocated = _allocate(weighed, cost, busy, alpha)
        slot_request = weighed.slot_request
        n_slots = slot_request.shape[0]
        if weighed.resource_work is not None:
            totals.add_slot_work(slot_request, weighed.resource_work)
        row_values = (
            allocated.shares,
            allocated.compute_nano,
            allocated.exact,
            allocated.block_seconds,
        )
        totals.add_rows(slot_request, *(values[:n_slots] for values in row_values))
        totals.add_slot_tokens(slot_request, allocated.compute_nano[:n_slots], weighed.slot_columns)
        held_rows = slice(
            int(holder_layout.offsets[weighed.first]), int(holder_layout.offsets[weighed.end])
        )
        for name, values in zip(held, row_values, strict=True):
            held[name][held_rows] = values[n_slots:]
        if allocations.wanted:
            holder_request = holder_layout.request[holder_layout.rows(weighed.first, weighed.end)]
            _keep_allocations(allocations, weighed, holder_request, allocated, cost, busy)
    holder_request = holder_layout.request[holder_layout.rows(0, n_steps)]
    totals.add_rows(
        holder_request, held["amount"], held["compute"], held["exact"], held["block_seconds"]
    )
    work = None if resource_weights is None else totals.work_frame(request_ids, RESOURCE_COLUMNS)
    return totals.frame(request_ids), work, allocations.frame(hour_steps)


def _prefix_hits(
    pool: Pool, slots: pl.DataFrame, slot_layout: RowLayout, n_requests: int
) -> np.ndarray | None:
    """Each request's largest prefix-hit tokens of the hour (policy first_writer), else None."""
    if pool.policies.prefix_cache != "first_writer":
        return None
    return largest_per_request(slot_layout, slots["prefix_hit_tokens"].to_numpy(), n_requests)


def _cache_read_charges(requests: pl.DataFrame, fraction: float) -> tuple[pl.DataFrame, int]:
    """Charge hit tokens at `fraction` of the hour's prefill rate; returns (requests, saving)."""
    prefill_tokens = int(requests["prefill_tokens"].sum())
    rate = int(requests["prefill_compute_nano"].sum()) / prefill_tokens if prefill_tokens else 0.0
    hits = requests["cached_tokens"].to_numpy().astype(np.float64)
    charge = np.floor(hits * rate * fraction + 0.5).astype(np.int64)
    full_price = np.floor(hits * rate + 0.5).astype(np.int64)
    charged = requests.with_columns(
        (pl.col("compute_nano") + charge).alias("compute_nano"),
        (pl.col("amount_nano") + charge).alias("amount_nano"),
        pl.Series("cache_read_nano", charge),
    )
    return charged, int((full_price - charge).sum())


def _classify(requests: pl.DataFrame, context: pl.DataFrame, pool: Pool) -> pl.DataFrame:
    """Join gateway context and decide each request's line kind."""
    _require_columns(context, "context", CONTEXT_COLUMNS)
    duplicated = context.filter(pl.col("request_id").is_duplicated())
    if duplicated.height:
        raise AttributionError(
            f"context: request_id {duplicated['request_id'][0]!r} appears more than once"
        )
    joined = requests.join(
        context.select(*(pl.col(c).cast(pl.String) for c in CONTEXT_COLUMNS)),
        on="request_id",
        how="left",
    )
    platform_pays = pool.policies.platform_pays_platform_retries
    kind = (
        pl.when(pl.col("tenant").is_null())
        .then(pl.lit("unattributed"))
        .when(pl.lit(platform_pays) & (pl.col("retry_cause") == "platform_timeout"))
        .then(pl.lit("platform_retry"))
        .otherwise(pl.lit("usage"))
    )
    return joined.with_columns(kind.alias("line_kind"))


def _usage_lines(requests: pl.DataFrame, pool: Pool) -> pl.DataFrame:
    tenant = (
        pl.when(pl.col("line_kind") == "unattributed")
        .then(pl.lit(UNATTRIBUTED))
        .when(pl.col("line_kind") == "platform_retry")
        .then(pl.lit(pool.capacity_owner))
        .otherwise(pl.col("tenant"))
    )
    feature = (
        pl.when(pl.col("line_kind") == "unattributed")
        .then(pl.lit(UNATTRIBUTED))
        .when(pl.col("line_kind") == "platform_retry")
        .then(pl.lit(PLATFORM_RETRY_FEATURE))
        .otherwise(pl.col("feature").fill_null(UNATTRIBUTED))
    )
    return (
        requests.with_columns(tenant.alias("line_tenant"), feature.alias("line_feature"))
        .group_by("line_tenant", "line_feature", "line_kind")
        .agg(
            pl.col("amount_nano").sum(),
            pl.len().cast(pl.Int64).alias("requests"),
            pl.col("new_tokens").sum(),
            pl.col("cached_tokens").sum(),
        )
        .rename({"line_tenant": "tenant", "line_feature": "feature"})
        .sort("line_kind", "tenant", "feature")
    )


def _line(
    tenant: str, feature: str, kind: str, amount: int, requests: int = 0, cached: int = 0
) -> dict[str, Any]:
    return {
        "tenant": tenant,
        "feature": feature,
        "line_kind": kind,
        "amount_nano": amount,
        "requests": requests,
        "new_tokens": 0,
        "cached_tokens": cached,
    }


def idle_lines(
    pool: Pool, invoice_nano: int, idle_nano: int, usage: pl.DataFrame
) -> list[dict[str, Any]]:
    """Label the hour's idle per the pool's policy.

    spread: to tenants' features in proportion to their usage (largest remainder);
    capacity_owner: all to the capacity owner; spread_then_headroom: idle up to
    (1 - target_utilization) of the invoice is spread, the rest is headroom charged to the SLO
    owner. With no tenant usage to spread over, spread idle goes to the capacity owner. Negative idle (overlapping steps,
    which the time check reports) is one line at the capacity owner, never spread.
    """
    if idle_nano == 0:
        return []
    policy = pool.policies.idle
    if idle_nano < 0 or policy == "capacity_owner":
        return [_line(pool.capacity_owner, IDLE_FEATURE, "idle", idle_nano)]
    headroom = 0
    if policy == "spread_then_headroom":
        spread_cap = math.floor(invoice_nano * (1.0 - pool.target_utilization))
        headroom = max(idle_nano - spread_cap, 0)
    spread = idle_nano - headroom
    lines = [_line(pool.slo_owner, HEADROOM_FEATURE, "headroom", headroom)] if headroom else []
    base = usage.filter((pl.col("line_kind") == "usage") & (pl.col("amount_nano") > 0))
    if spread and base.height:
        shares, _ = largest_remainder(
            np.array([spread]),
            np.zeros(base.height, dtype=np.int64),
            base["amount_nano"].to_numpy().astype(np.float64),
        )
        lines += [
            _line(tenant, feature, "idle", int(share))
            for tenant, feature, share in zip(base["tenant"], base["feature"], shares, strict=False)
            if share
        ]
    elif spread:
        lines.append(_line(pool.capacity_owner, IDLE_FEATURE, "idle", spread))
    return lines


def attribute_hour(
    hour_start: datetime,
    pool: Pool,
    steps: pl.DataFrame,
    slots: pl.DataFrame,
    holders: pl.DataFrame,
    context: pl.DataFrame,
    weights: WeightSource,
    *,
    resource_weights: KernelWeights | None = None,
    rows_per_batch: int = ROWS_PER_BATCH,
    allocations_of: RequestSelection = (),
) -> HourAttribution:
    """Attribute one pool-hour.

    `steps`, `slots`, `holders` follow schemas.tables STEPS/SLOTS/HOLDERS (as polars frames) and
    may include steps of neighbouring hours: only steps overlapping the hour count, and a
    step crossing the boundary contributes the part inside it. `context` has columns
    request_id, tenant, feature, api_key_id, retry_of, retry_cause and may lack requests.
    `resource_weights`: the pool's kernel, to total each request's work per resource (priced
    once with the weights when they are this kernel). `rows_per_batch`: slot and holder rows
    allocated at a time (a step is never split). `allocations_of`: the request ids (or "all")
    whose per-step allocation rows to keep, as billed; none by default.
    """
    start_ns = hour_start_ns(hour_start)
    hour_value = to_warehouse(hour_start)
    _require_columns(slots, "slots", ("replica", "seq", "slot_index", "request_id", *SLOT_COLUMNS))
    _require_columns(
        holders, "holders", ("replica", "seq", "holder_index", "request_id", "kv_blocks", "state")
    )
    replica_price = pool.gpus_per_stream * pool.nano_per_gpu_hour
    invoice = Invoice(
        hour=hour_value,
        pool=pool.name,
        gpus=pool.gpus_per_stream * len(pool.streams),
        usd_per_gpu_hour=pool.usd_per_gpu_hour,
        amount_nano=replica_price * len(pool.streams),
    )

    hour_steps, keys = _priced_steps(pool, start_ns, steps, replica_price)
    alpha, blocked_fraction = alpha_for_period(
        pool.policies, hour_steps["admission_blocked"].to_numpy()
    )
    requests, resource_work, allocations = _attribute_rows(
        pool,
        hour_steps,
        keys,
        slots,
        holders,
        weights,
        resource_weights,
        alpha,
        rows_per_batch,
        allocations_of,
    )
    requests, cache_saving = _charged_requests(pool, requests, context)
    lines = _ledger_lines(pool, invoice, requests, weights.version)
    kind_amount, kind_count = _by_line_kind(requests)
    usage_nano = int(requests["amount_nano"].sum())
    cache_read_nano = int(requests["cache_read_nano"].sum())
    return HourAttribution(
        ledger=_hour_ledger(hour_start, pool, invoice, lines, requests, resource_work, slots),
        replicas=_replica_facts(pool, hour_steps, replica_price),
        request_details=_request_details(pool, requests, weights),
        allocations=allocations,
        step_count=hour_steps.height,
        busy_ns=int(hour_steps["busy_ns"].sum()),
        alpha=alpha,
        admission_blocked_fraction=blocked_fraction,
        usage_nano=usage_nano,
        unattributed_nano=int(kind_amount.get("unattributed", 0)),
        unattributed_requests=int(kind_count.get("unattributed", 0)),
        platform_retry_nano=int(kind_amount.get("platform_retry", 0)),
        cache_read_nano=cache_read_nano,
        cache_saving_nano=cache_saving,
        idle_nano=invoice.amount_nano - (usage_nano - cache_read_nano),
        headroom_nano=int(lines.filter(pl.col("line_kind") == "headroom")["amount_nano"].sum()),
        weights_version=weights.version,
        policy_version=pool.policies.version(),
    )


def _priced_steps(
    pool: Pool, start_ns: int, steps: pl.DataFrame, replica_price: int
) -> tuple[pl.DataFrame, StepKeys]:
    """The steps overlapping the hour (`steps_in_hour`), each with its cost and busy time
    inside the hour from the clock (`cost_nano`, `busy_ns`), and the keys of every step."""
    hour_steps, keys = steps_in_hour(start_ns, pool, steps)
    cost, busy = step_costs_in_hour(
        hour_steps["start_utc_ns"].to_numpy(),
        hour_steps["end_utc_ns"].to_numpy(),
        start_ns,
        replica_price,
    )
    return hour_steps.with_columns(pl.Series("cost_nano", cost), pl.Series("busy_ns", busy)), keys


def _charged_requests(
    pool: Pool, requests: pl.DataFrame, context: pl.DataFrame
) -> tuple[pl.DataFrame, int]:
    """The requests' totals with their prefix-cache read charges (`cache_read_nano`, zero
    unless policy cache_read) and line kinds; and what the hit tokens saved."""
    cache_saving = 0
    if pool.policies.prefix_cache == "cache_read":
        requests, cache_saving = _cache_read_charges(requests, pool.policies.cache_read_fraction)
    else:
        requests = requests.with_columns(pl.lit(0, dtype=pl.Int64).alias("cache_read_nano"))
    return _classify(requests, context, pool), cache_saving


def _by_line_kind(requests: pl.DataFrame) -> tuple[dict[str, int], dict[str, int]]:
    """The requests' amount and number on each line kind."""
    by_kind = requests.group_by("line_kind").agg(pl.col("amount_nano").sum(), pl.len())
    kinds = by_kind["line_kind"].to_list()
    return (
        dict(zip(kinds, by_kind["amount_nano"].to_list(), strict=True)),
        dict(zip(kinds, by_kind["len"].to_list(), strict=True)),
    )


def _hour_ledger(
    hour_start: datetime,
    pool: Pool,
    invoice: Invoice,
    lines: pl.DataFrame,
    requests: pl.DataFrame,
    resource_work: pl.DataFrame | None,
    slots: pl.DataFrame,
) -> HourLedger:
    """The hour's ledger: its invoice, lines, request costs, resource work and decode contexts."""
    return HourLedger(
        hour=hour_start,
        pool=pool.name,
        invoice=invoice,
        ledger_lines=lines,
        request_costs=_stamped(requests, invoice, REQUEST_COST_SCHEMA).sort("request_id"),
        resource_work=(
            pl.DataFrame(schema=RESOURCE_WORK_SCHEMA)
            if resource_work is None
            else resource_work.cast(RESOURCE_WORK_SCHEMA)
        ),
        decode_contexts=decode_contexts(pool, slots),
    )


def _stamped(frame: pl.DataFrame, invoice: Invoice, schema: pl.Schema) -> pl.DataFrame:
    """The frame with the invoice's hour and pool, as the columns of `schema`."""
    return frame.with_columns(
        pl.lit(invoice.hour, dtype=pl.Datetime("us")).alias("hour"),
        pl.lit(invoice.pool).alias("pool"),
    ).select(*(pl.col(c).cast(t) for c, t in schema.items()))


def _ledger_lines(
    pool: Pool, invoice: Invoice, requests: pl.DataFrame, weights_version: str
) -> pl.DataFrame:
    """The hour's ledger lines (LEDGER_LINE_SCHEMA): the requests' usage lines, the cache
    credit, then idle and headroom, summing exactly to the invoice (asserted)."""
    usage = _usage_lines(requests, pool)
    cache_read_nano = int(requests["cache_read_nano"].sum())
    idle_nano = invoice.amount_nano - (int(requests["amount_nano"].sum()) - cache_read_nano)
    extra = []
    if cache_read_nano:
        readers = requests.filter(pl.col("cache_read_nano") > 0)
        extra.append(
            _line(
                pool.capacity_owner,
                CACHE_FEATURE,
                "cache_credit",
                -cache_read_nano,
                readers.height,
                int(readers["cached_tokens"].sum()),
            )
        )
    extra += idle_lines(pool, invoice.amount_nano, idle_nano, usage)
    line_columns = pl.Schema({c: LEDGER_LINE_SCHEMA[c] for c in usage.columns})
    lines = _stamped(
        pl.concat(
            [usage.cast(line_columns), pl.DataFrame(extra, schema=line_columns)]
        ).with_columns(
            pl.lit(weights_version).alias("weights_version"),
            pl.lit(pool.policies.version()).alias("policy_version"),
        ),
        invoice,
        LEDGER_LINE_SCHEMA,
    )
    if int(lines["amount_nano"].sum()) != invoice.amount_nano:
        raise AssertionError(
            f"pool {pool.name} hour {invoice.hour}: ledger lines sum to {int(lines['amount_nano'].sum())}, invoice {invoice.amount_nano}"
        )
    return lines


def _request_details(pool: Pool, requests: pl.DataFrame, weights: WeightSource) -> pl.DataFrame:
    """Per request the facts beside its cost (`HourAttribution.request_details`)."""
    bytes_per_token = weights.kv_bytes_per_token()
    bytes_per_block = None if bytes_per_token is None else bytes_per_token * pool.kv_block_size
    return requests.select(
        "request_id",
        "exact_nano",
        "kv_block_seconds",
        (
            pl.col("kv_block_seconds") * bytes_per_block
            if bytes_per_block
            else pl.lit(None, dtype=pl.Float64)
        ).alias("kv_byte_seconds"),
        "cache_read_nano",
    ).sort("request_id")


def decode_contexts(pool: Pool, slots: pl.DataFrame) -> pl.DataFrame:
    """How many decode slots ran at each context length (`DECODE_CONTEXTS_SCHEMA`)."""
    return (
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


def _replica_facts(pool: Pool, hour_steps: pl.DataFrame, replica_price: int) -> pl.DataFrame:
    """Per replica of the pool (busy or not): steps, sequence range, busy time, step cost, and
    idle = the replica's hour price minus its step cost."""
    per_replica = hour_steps.group_by("replica").agg(
        pl.len().cast(pl.Int64).alias("steps"),
        pl.col("seq").min().alias("first_seq"),
        pl.col("seq").max().alias("last_seq"),
        pl.col("busy_ns").sum(),
        pl.col("cost_nano").sum().alias("step_cost_nano"),
        pl.col("admission_blocked").sum().cast(pl.Int64).alias("admission_blocked_steps"),
    )
    every = pl.DataFrame({"replica": [r.id for r in pool.streams]})
    return (
        every.join(per_replica, on="replica", how="left")
        .with_columns(
            pl.col("steps", "busy_ns", "step_cost_nano", "admission_blocked_steps").fill_null(0),
        )
        .with_columns((pl.lit(replica_price) - pl.col("step_cost_nano")).alias("idle_nano"))
        .select(*(pl.col(c).cast(t) for c, t in REPLICA_FACTS_SCHEMA.items()))
    )
