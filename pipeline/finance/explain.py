"""Why one request cost what it cost: its steps read back from the lake and split again
exactly as the hour's attribution split them (`stepledger explain REQUEST_ID`).

For every pool-hour the warehouse charged the request in, the hour's committed steps are read
from the lake with the inputs its attribution used; each step the request took part in is
split among all its rows (slots, then holders) with the pool's weights, prefix-cache policy
and the hour's alpha. The request's shares of those steps, plus any prefix-cache read charge,
must sum to its published charge: `Explanation.reproduced` says whether they do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np
import polars as pl

from pipeline import finance
from pipeline.attribution.allocator import blend_and_allocate, largest_remainder, split_compute_kv
from pipeline.attribution.clock import step_costs_in_hour
from pipeline.attribution.hour import steps_in_hour
from pipeline.attribution.kv import alpha_for_period, first_writer_blocks, holder_blocks
from pipeline.attribution.weights import SavedInputsMissing, saved_inputs
from pipeline.attribution.workmodel import SlotBatch
from pipeline.datadir import DataDir
from pipeline.storage.lake import load_hour, load_ledger
from pricing import RESOURCES
from schemas.config import Pool, load_pools
from schemas.errors import InputError
from schemas.units import from_warehouse, hour_key, hour_start_ns

_STEP_KEY = ["replica", "seq"]


class ExplainError(InputError):
    """The request cannot be explained; the message says what is missing and where."""


@dataclass(frozen=True)
class RequestHour:
    """The request in one pool-hour: its charge, and the steps that make it."""

    hour: datetime
    pool: str
    published: bool
    tenant: str | None
    feature: str | None
    line_kind: str | None
    paid_by: str | None
    amount_nano: int
    compute_nano: int
    kv_nano: int
    weights_version: str
    policy_version: str
    policies: dict[str, object]
    alpha: float
    retry_of: str | None
    retry_cause: str | None
    retry_handling: str
    cached_tokens: int
    prefix_cache: str
    # What the request paid for reading the prefix cache (policy cache_read); the capacity
    # owner's cache_credit line gives it back to the pool.
    cache_read_nano: int
    # Per step: replica, seq, role (slot or holder state), cost_nano, busy_ns, share_nano,
    # compute_nano, kv_nano, work (the request's compute work), step_work, kv_blocks,
    # step_kv_blocks, kv_block_seconds.
    steps: pl.DataFrame
    # The compute charge split over the pricing kernel's resources: resource -> nano-dollars.
    resources: dict[str, int] = field(default_factory=dict)

    @property
    def reproduced(self) -> bool:
        return int(self.steps["share_nano"].sum()) + self.cache_read_nano == self.amount_nano


@dataclass(frozen=True)
class Explanation:
    request_id: str
    hours: list[RequestHour]

    @property
    def amount_nano(self) -> int:
        return sum(h.amount_nano for h in self.hours)

    @property
    def reproduced(self) -> bool:
        return all(h.reproduced for h in self.hours)

    def as_json(self) -> dict[str, object]:
        return {
            "request_id": self.request_id,
            "amount_nano": self.amount_nano,
            "reproduced": self.reproduced,
            "hours": [
                {
                    "hour": hour_key(h.hour),
                    **{
                        name: getattr(h, name)
                        for name in RequestHour.__dataclass_fields__
                        if name not in ("hour", "steps")
                    },
                    "reproduced": h.reproduced,
                    "steps": h.steps.to_dicts(),
                }
                for h in self.hours
            ],
        }


_CHARGES = """
SELECT c.hour, c.pool, c.tenant, c.feature, c.line_kind, c.amount_nano, c.compute_nano,
       c.kv_nano, c.cached_tokens,
       EXISTS (SELECT 1 FROM published_hours p WHERE p.hour = c.hour AND p.pool = c.pool)
           AS published,
       (SELECT first(weights_version) FROM ledger_lines l
         WHERE l.hour = c.hour AND l.pool = c.pool) AS weights_version,
       (SELECT first(policy_version) FROM ledger_lines l
         WHERE l.hour = c.hour AND l.pool = c.pool) AS policy_version
FROM request_costs c WHERE c.request_id = ? ORDER BY c.hour, c.pool
"""


def explain_request(data_dir: Path, request_id: str) -> Explanation:
    """The request's charge in every pool-hour the warehouse of `data_dir` holds it in."""
    with finance.connect(data_dir) as con:
        charges = con.execute(_CHARGES, [request_id]).pl()
    if not charges.height:
        raise ExplainError(f"request {request_id!r}: not charged in the warehouse of {data_dir}")
    pools_path = DataDir(data_dir).pools_file
    pools = load_pools(pools_path)
    known = {p.name: p for p in pools.pools}
    hours = []
    for charge in charges.iter_rows(named=True):
        pool = known.get(charge["pool"])
        if pool is None:
            raise ExplainError(
                f"request {request_id!r}: pool {charge['pool']!r} is not in {pools_path}"
            )
        hours.append(_explain_hour(data_dir, pool, request_id, charge))
    return Explanation(request_id, hours)


def _explain_hour(
    data_dir: Path, pool: Pool, request_id: str, charge: dict[str, object]
) -> RequestHour:
    stored_hour = charge["hour"]
    assert isinstance(stored_hour, datetime)
    hour = from_warehouse(stored_hour)
    lake = DataDir(data_dir).lake
    try:
        inputs, weights = saved_inputs(data_dir, pool, hour)
    except SavedInputsMissing as err:
        raise ExplainError(str(err)) from err
    data = load_hour(lake, pool.name, hour, inputs.batches)
    hour_steps, _ = steps_in_hour(hour_start_ns(hour), pool, data.steps)
    price = pool.gpus_per_replica * pool.nano_per_gpu_hour
    cost, busy = step_costs_in_hour(
        hour_steps["start_utc_ns"].to_numpy(),
        hour_steps["end_utc_ns"].to_numpy(),
        hour_start_ns(hour),
        price,
    )
    alpha, _ = alpha_for_period(pool.policies, hour_steps["admission_blocked"].to_numpy())
    numbered = hour_steps.select(_STEP_KEY).with_columns(
        pl.Series("cost_nano", cost),
        pl.Series("busy_ns", busy),
        step=pl.int_range(pl.len(), dtype=pl.Int64),
    )
    slots = data.slots.drop("pool").join(numbered, on=_STEP_KEY, how="inner")
    holders = data.holders.drop("pool").join(numbered, on=_STEP_KEY, how="inner")
    # The request's steps, numbered 0.. in the hour's order.
    mine = (
        pl.concat(
            [
                slots.filter(pl.col("request_id") == request_id).select("step"),
                holders.filter(pl.col("request_id") == request_id).select("step"),
            ]
        )
        .unique()
        .sort("step")
        .with_row_index("local")
        .with_columns(pl.col("local").cast(pl.Int64))
    )
    # A request's prefix hits are its largest over the hour (policy first_writer), as the
    # hour's attribution takes them.
    hits = slots.group_by("request_id").agg(pl.col("prefix_hit_tokens").max().alias("hits"))
    step_slots = slots.join(mine, on="step").join(hits, on="request_id").sort("step", "slot_index")
    step_holders = holders.join(mine, on="step").sort("step", "holder_index")
    batch = SlotBatch.of_slots(step_slots["local"].to_numpy(), mine.height, step_slots)
    slot_blocks = step_slots["kv_blocks"].to_numpy().astype(np.float64)
    if pool.policies.prefix_cache == "first_writer":
        slot_blocks = first_writer_blocks(
            step_slots["context_tokens"].to_numpy().astype(np.float64),
            step_slots["new_tokens"].to_numpy().astype(np.float64),
            step_slots["hits"].to_numpy().astype(np.float64),
            pool.kv_block_size,
        )
    work = np.concatenate(
        [weights.compute_work(batch, pool.policies.fixed_cost), np.zeros(step_holders.height)]
    )
    kv_weight = np.concatenate(
        [
            slot_blocks,
            holder_blocks(step_holders["kv_blocks"].to_numpy(), step_holders["state"].to_numpy()),
        ]
    )
    rows = pl.concat(
        [
            step_slots.select("local", "request_id", "cost_nano", "busy_ns", role=pl.lit("slot")),
            step_holders.select(
                "local", "request_id", "cost_nano", "busy_ns", role=pl.col("state").cast(pl.String)
            ),
        ]
    )
    row_step = rows["local"].to_numpy()
    step_cost = mine.join(numbered, on="step").sort("local")["cost_nano"].to_numpy()
    step_work = np.bincount(row_step, weights=work, minlength=mine.height)
    step_kv = np.bincount(row_step, weights=kv_weight, minlength=mine.height)
    # A step with nobody to carry it is idle time, as in the hour's attribution.
    carried = (step_work > 0) | (step_kv > 0)
    split = blend_and_allocate(np.where(carried, step_cost, 0), row_step, work, kv_weight, alpha)
    compute_nano, kv_nano = split_compute_kv(split.shares, *split.parts())
    explained = (
        rows.with_columns(
            pl.Series("share_nano", split.shares),
            pl.Series("compute_nano", compute_nano),
            pl.Series("kv_nano", kv_nano),
            pl.Series("work", work),
            pl.Series("step_work", step_work[row_step]),
            pl.Series("kv_blocks", kv_weight),
            pl.Series("step_kv_blocks", step_kv[row_step]),
        )
        .filter(pl.col("request_id") == request_id)
        .join(mine.join(numbered, on="step").select("local", *_STEP_KEY), on="local")
        .sort("local", "role")
        .select(
            *_STEP_KEY,
            "role",
            "cost_nano",
            "busy_ns",
            "share_nano",
            "compute_nano",
            "kv_nano",
            "work",
            "step_work",
            "kv_blocks",
            "step_kv_blocks",
            (pl.col("kv_blocks") * pl.col("busy_ns") / 1e9).alias("kv_block_seconds"),
        )
    )
    amount = int(charge["amount_nano"])  # type: ignore[call-overload]
    compute_total = int(charge["compute_nano"])  # type: ignore[call-overload]
    cache_read = (
        amount - int(explained["share_nano"].sum())
        if pool.policies.prefix_cache == "cache_read"
        else 0
    )
    context = inputs.context.filter(pl.col("request_id") == request_id)
    retry_of = context["retry_of"][0] if context.height else None
    retry_cause = context["retry_cause"][0] if context.height else None
    return RequestHour(
        hour=hour,
        pool=pool.name,
        published=bool(charge["published"]),
        tenant=charge["tenant"],  # type: ignore[arg-type]
        feature=charge["feature"],  # type: ignore[arg-type]
        line_kind=charge["line_kind"],  # type: ignore[arg-type]
        paid_by=_paid_by(charge["line_kind"]),
        amount_nano=amount,
        compute_nano=compute_total,
        kv_nano=int(charge["kv_nano"]),  # type: ignore[call-overload]
        weights_version=str(charge["weights_version"]),
        policy_version=str(charge["policy_version"]),
        policies=pool.policies.model_dump(mode="json"),
        alpha=alpha,
        retry_of=retry_of,
        retry_cause=retry_cause,
        retry_handling=_retry_handling(pool, charge["line_kind"], retry_of, retry_cause),
        cached_tokens=int(charge["cached_tokens"]),  # type: ignore[call-overload]
        prefix_cache=pool.policies.prefix_cache,
        cache_read_nano=cache_read,
        steps=explained,
        resources=_resource_parts(lake, pool, hour, request_id, compute_total),
    )


def _paid_by(line_kind: object) -> str | None:
    if line_kind is None:
        return None
    return "platform" if line_kind == "platform_retry" else "tenant"


def _retry_handling(
    pool: Pool, line_kind: object, retry_of: str | None, retry_cause: str | None
) -> str:
    if retry_of is None:
        return "not a retry"
    if line_kind == "platform_retry":
        return (
            f"retry of {retry_of} after a platform timeout: charged to the capacity owner "
            f"{pool.capacity_owner} (policy platform_pays_platform_retries)"
        )
    if retry_cause == "platform_timeout":
        return (
            f"retry of {retry_of} after a platform timeout: the tenant pays "
            "(platform_pays_platform_retries is off)"
        )
    return f"retry of {retry_of} ({retry_cause or 'cause unknown'}): the tenant pays"


def _resource_parts(
    lake: Path, pool: Pool, hour: datetime, request_id: str, compute_nano: int
) -> dict[str, int]:
    """The request's compute charge split over the kernel's resources by its stored work on
    each (largest remainder, so the parts sum to the charge); empty without stored work."""
    try:
        work = load_ledger(lake, pool.name, hour).resource_work
    except FileNotFoundError:
        return {}
    row = work.filter(pl.col("request_id") == request_id)
    if not row.height:
        return {}
    us = row.select(f"{r}_us" for r in RESOURCES).to_numpy()[0]
    if us.sum() <= 0:
        return {}
    parts, _ = largest_remainder(
        np.array([compute_nano]), np.zeros(len(RESOURCES), dtype=np.int64), us
    )
    return dict(zip(RESOURCES, (int(p) for p in parts), strict=True))
