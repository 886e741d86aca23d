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
from pipeline.attribution.allocator import blend_and_allocate, largest_remainder, split_compute_kv
from pipeline.attribution.clock import step_costs_in_hour
from pipeline.attribution.kv import alpha_for_period, first_writer_blocks, holder_blocks
from pipeline.attribution.layout import AttributionError, StepKeys, gather, lay_out_rows
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


@dataclass(frozen=True)
class HourAttribution:
    """One pool-hour, attributed: its ledger rows and the facts that explain them.

    `ledger_lines` has exactly the warehouse `ledger_lines` columns and sums to
    `invoice["amount_nano"]`; `request_costs` has exactly the warehouse `request_costs`
    columns. `replicas` (REPLICA_FACTS_SCHEMA) and the scalar facts below are what the
    hourly reconciliation checks.
    """

    invoice: dict[str, Any]
    request_costs: pl.DataFrame
    ledger_lines: pl.DataFrame
    replicas: pl.DataFrame
    # Per request: request_id, exact_nano (the sum of its exact real shares, beside the
    # integer amount_nano for auditing the rounding), kv_block_seconds (blocks held x time inside
    # the hour, as charged under the prefix-cache policy) and kv_byte_seconds (kernel weights
    # only; else null).
    request_details: pl.DataFrame
    # With resource weights: per request with slots in the hour, its slots' kernel work on
    # each resource (request_id, `<resource>_us`); else None.
    resource_work: pl.DataFrame | None
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
    replicas = sorted(r.id for r in pool.replicas)
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
    in the batch and its weights; each slot's request, token columns and resource work."""

    first: int
    end: int
    slot_columns: dict[str, np.ndarray]
    slot_request: np.ndarray
    row_step: np.ndarray
    compute_work: np.ndarray
    kv_weight: np.ndarray
    resource_work: np.ndarray | None


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
) -> tuple[pl.DataFrame, pl.DataFrame | None]:
    """Split every step's cost among its slots and holders and total the rows per request.

    Steps are independent, so the hour is processed a batch of steps at a time: memory stays
    bounded by the batch, not the hour's tens of millions of rows. Within a step slots come
    first, then holders (the allocator's tie-break by position). A batch holds at least two
    steps when the hour has them: the kernel sums a lone step's slots in another order than
    several steps' (`slot_work_many`), so its figures would depend on where the batches fall.
    Returns one row per request: request_id, rollup.INTEGER_TOTALS but `rows`, rollup.REAL_TOTALS;
    and, with `resource_weights`, one row per request with slots: request_id and its slots'
    work on each of the kernel's RESOURCES (`<resource>_us`, as `PricedBatch.resource_work_us`).
    """
    n_steps = hour_steps.height
    request_ids = pl.concat(
        [slots["request_id"].cast(pl.String), holders["request_id"].cast(pl.String)]
    ).unique(maintain_order=True)
    slot_layout = lay_out_rows(slots, "slots", "slot_index", keys, n_steps, request_ids)
    holder_layout = lay_out_rows(holders, "holders", "holder_index", keys, n_steps, request_ids)
    prefix_hits = None
    if pool.policies.prefix_cache == "first_writer":
        prefix_hits = largest_per_request(
            slot_layout, slots["prefix_hit_tokens"].to_numpy(), len(request_ids)
        )
    cost = hour_steps["cost_nano"].to_numpy()
    busy = hour_steps["busy_ns"].to_numpy()
    totals = RequestTotals(len(request_ids), 0 if resource_weights is None else len(RESOURCES))
    # Holder rows are totalled after every slot row, as the rows of the whole hour are ordered.
    n_holders = int(holder_layout.offsets[-1])
    held = {
        "amount": np.empty(n_holders, dtype=np.int64),
        "compute": np.empty(n_holders, dtype=np.int64),
        "exact": np.empty(n_holders),
        "block_seconds": np.empty(n_holders),
    }

    def weigh(first: int, end: int) -> _WeighedBatch:
        """The batch's rows with their compute and KV weights (and resource work)."""
        slot_rows, holder_rows = slot_layout.rows(first, end), holder_layout.rows(first, end)
        slot_columns = gather(slots, list(SLOT_COLUMNS), slot_rows)
        holder_columns = gather(holders, ["kv_blocks", "state"], holder_rows)
        slot_step = slot_layout.step[slot_rows] - first
        slot_request = slot_layout.request[slot_rows]
        batch = SlotBatch.of_slots(slot_step, end - first, slot_columns)
        priced = None if resource_weights is None else resource_weights.price(batch)
        return _WeighedBatch(
            first=first,
            end=end,
            slot_columns=slot_columns,
            slot_request=slot_request,
            row_step=np.concatenate([slot_step, holder_layout.step[holder_rows] - first]),
            compute_work=np.concatenate(
                [
                    weights.compute_work(batch, pool.policies.fixed_cost, priced),
                    np.zeros(holder_columns["kv_blocks"].shape[0]),
                ]
            ),
            kv_weight=np.concatenate(
                [
                    _slot_kv_blocks(
                        pool,
                        slot_columns,
                        None if prefix_hits is None else prefix_hits[slot_request],
                    ),
                    holder_blocks(holder_columns["kv_blocks"], holder_columns["state"]),
                ]
            ),
            resource_work=(
                None if priced is None else priced.resource_work_us(batch, pool.policies.fixed_cost)
            ),
        )

    batches = step_batches(slot_layout.offsets + holder_layout.offsets, rows_per_batch, min_steps=2)
    # Pricing, mostly numpy without the GIL, runs ahead of the allocation, which is in order.
    for weighed in ordered_ahead(lambda bounds: weigh(*bounds), batches):
        first, end, slot_request = weighed.first, weighed.end, weighed.slot_request
        n_slots, row_step = slot_request.shape[0], weighed.row_step
        compute_work, kv_weight = weighed.compute_work, weighed.kv_weight
        if weighed.resource_work is not None:
            totals.add_slot_work(slot_request, weighed.resource_work)
        # A step with nobody to carry it (no slot work, no blocks held) is idle time.
        carried = (np.bincount(row_step, weights=compute_work, minlength=end - first) > 0) | (
            np.bincount(row_step, weights=kv_weight, minlength=end - first) > 0
        )
        split = blend_and_allocate(
            np.where(carried, cost[first:end], 0), row_step, compute_work, kv_weight, alpha
        )
        compute_nano, _ = split_compute_kv(split.shares, *split.parts())
        block_seconds = kv_weight * busy[first:end][row_step] / NS_PER_SECOND
        totals.add_rows(
            slot_request,
            split.shares[:n_slots],
            compute_nano[:n_slots],
            split.exact[:n_slots],
            block_seconds[:n_slots],
        )
        totals.add_slot_tokens(slot_request, compute_nano[:n_slots], weighed.slot_columns)
        held_rows = slice(int(holder_layout.offsets[first]), int(holder_layout.offsets[end]))
        for name, values in zip(
            held, (split.shares, compute_nano, split.exact, block_seconds), strict=False
        ):
            held[name][held_rows] = values[n_slots:]
    holder_request = holder_layout.request[holder_layout.rows(0, n_steps)]
    totals.add_rows(
        holder_request, held["amount"], held["compute"], held["exact"], held["block_seconds"]
    )
    resource_work = (
        None
        if resource_weights is None
        else totals.work_frame(request_ids, [f"{r}_us" for r in RESOURCES])
    )
    return totals.frame(request_ids), resource_work


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
) -> HourAttribution:
    """Attribute one pool-hour.

    `steps`, `slots`, `holders` follow schemas.tables STEPS/SLOTS/HOLDERS (as polars frames) and
    may include steps of neighbouring hours: only steps overlapping the hour count, and a
    step crossing the boundary contributes the part inside it. `context` has columns
    request_id, tenant, feature, api_key_id, retry_of, retry_cause and may lack requests.
    `resource_weights`: the pool's kernel, to total each request's work per resource (priced
    once with the weights when they are this kernel). `rows_per_batch`: slot and holder rows
    allocated at a time (a step is never split).
    """
    start_ns = hour_start_ns(hour_start)
    hour_value = to_warehouse(hour_start)
    _require_columns(slots, "slots", ("replica", "seq", "slot_index", "request_id", *SLOT_COLUMNS))
    _require_columns(
        holders, "holders", ("replica", "seq", "holder_index", "request_id", "kv_blocks", "state")
    )
    replica_price = pool.gpus_per_replica * pool.nano_per_gpu_hour
    invoice_nano = replica_price * len(pool.replicas)
    policy_version = pool.policies.version()

    hour_steps, keys = steps_in_hour(start_ns, pool, steps)
    cost, busy = step_costs_in_hour(
        hour_steps["start_utc_ns"].to_numpy(),
        hour_steps["end_utc_ns"].to_numpy(),
        start_ns,
        replica_price,
    )
    hour_steps = hour_steps.with_columns(pl.Series("cost_nano", cost), pl.Series("busy_ns", busy))
    alpha, blocked_fraction = alpha_for_period(
        pool.policies, hour_steps["admission_blocked"].to_numpy()
    )
    requests, resource_work = _attribute_rows(
        pool, hour_steps, keys, slots, holders, weights, resource_weights, alpha, rows_per_batch
    )
    cache_saving = 0
    if pool.policies.prefix_cache == "cache_read":
        requests, cache_saving = _cache_read_charges(requests, pool.policies.cache_read_fraction)
    else:
        requests = requests.with_columns(pl.lit(0, dtype=pl.Int64).alias("cache_read_nano"))
    requests = _classify(requests, context, pool)
    usage = _usage_lines(requests, pool)
    cache_read_nano = int(requests["cache_read_nano"].sum())
    usage_nano = int(requests["amount_nano"].sum())
    idle_nano = invoice_nano - (usage_nano - cache_read_nano)

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
    extra += idle_lines(pool, invoice_nano, idle_nano, usage)
    line_columns = pl.Schema({c: LEDGER_LINE_SCHEMA[c] for c in usage.columns})
    lines = (
        pl.concat([usage.cast(line_columns), pl.DataFrame(extra, schema=line_columns)])
        .with_columns(
            pl.lit(hour_value, dtype=pl.Datetime("us")).alias("hour"),
            pl.lit(pool.name).alias("pool"),
            pl.lit(weights.version).alias("weights_version"),
            pl.lit(policy_version).alias("policy_version"),
        )
        .select(*(pl.col(c).cast(t) for c, t in LEDGER_LINE_SCHEMA.items()))
    )
    if int(lines["amount_nano"].sum()) != invoice_nano:
        raise AssertionError(
            f"pool {pool.name} hour {hour_value}: ledger lines sum to {int(lines['amount_nano'].sum())}, invoice {invoice_nano}"
        )

    request_costs = (
        requests.with_columns(
            pl.lit(hour_value, dtype=pl.Datetime("us")).alias("hour"),
            pl.lit(pool.name).alias("pool"),
        )
        .select(*(pl.col(c).cast(t) for c, t in REQUEST_COST_SCHEMA.items()))
        .sort("request_id")
    )

    replica_facts = _replica_facts(pool, hour_steps, replica_price)
    bytes_per_token = weights.kv_bytes_per_token()
    bytes_per_block = None if bytes_per_token is None else bytes_per_token * pool.kv_block_size
    request_details = requests.select(
        "request_id",
        "exact_nano",
        "kv_block_seconds",
        (
            pl.col("kv_block_seconds") * bytes_per_block
            if bytes_per_block
            else pl.lit(None, dtype=pl.Float64)
        ).alias("kv_byte_seconds"),
    ).sort("request_id")
    headroom = int(lines.filter(pl.col("line_kind") == "headroom")["amount_nano"].sum())
    by_kind = requests.group_by("line_kind").agg(pl.col("amount_nano").sum(), pl.len())
    kind_amount = dict(zip(by_kind["line_kind"], by_kind["amount_nano"], strict=False))
    kind_count = dict(zip(by_kind["line_kind"], by_kind["len"], strict=False))
    return HourAttribution(
        invoice={
            "hour": hour_value,
            "pool": pool.name,
            "gpus": pool.gpus_per_replica * len(pool.replicas),
            "usd_per_gpu_hour": pool.usd_per_gpu_hour,
            "amount_nano": invoice_nano,
        },
        request_costs=request_costs,
        ledger_lines=lines,
        replicas=replica_facts,
        request_details=request_details,
        resource_work=resource_work,
        step_count=hour_steps.height,
        busy_ns=int(busy.sum()),
        alpha=alpha,
        admission_blocked_fraction=blocked_fraction,
        usage_nano=usage_nano,
        unattributed_nano=int(kind_amount.get("unattributed", 0)),
        unattributed_requests=int(kind_count.get("unattributed", 0)),
        platform_retry_nano=int(kind_amount.get("platform_retry", 0)),
        cache_read_nano=cache_read_nano,
        cache_saving_nano=cache_saving,
        idle_nano=idle_nano,
        headroom_nano=headroom,
        weights_version=weights.version,
        policy_version=policy_version,
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
    every = pl.DataFrame({"replica": [r.id for r in pool.replicas]})
    return (
        every.join(per_replica, on="replica", how="left")
        .with_columns(
            pl.col("steps", "busy_ns", "step_cost_nano", "admission_blocked_steps").fill_null(0),
        )
        .with_columns((pl.lit(replica_price) - pl.col("step_cost_nano")).alias("idle_nano"))
        .select(*(pl.col(c).cast(t) for c, t in REPLICA_FACTS_SCHEMA.items()))
    )
