"""Why one request cost what it cost: its steps' allocations as the hour's attribution made
them (`stepledger explain REQUEST_ID`).

For every pool-hour the warehouse charged the request in, the hour is attributed again from
the inputs its attribution saved to the lake, keeping the request's allocation rows: each step
it took part in, its share of the step's cost with the work and KV blocks that weighed it.
This module only reads and formats them; the shares come from the code that bills. The
request's shares, plus any prefix-cache read charge, must sum to its published charge:
`Explanation.reproduced` says whether they do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import polars as pl

from pipeline import finance
from pipeline.attribution.attribute import attribute_pool_hour
from pipeline.attribution.explain_step import ExplainError
from pipeline.attribution.weights import SavedInputsMissing, saved_inputs
from pipeline.datadir import DataDir
from schemas.config import Pool, load_pools
from schemas.units import from_warehouse, hour_key

# The columns of a request's step shown for each of its allocation rows.
STEP_COLUMNS = (
    "replica",
    "seq",
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
    "kv_block_seconds",
)


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


# How many of a request's steps the summary names, the most expensive first.
LARGEST_STEPS = 5


@dataclass(frozen=True)
class Summary:
    """A request's charge over all its hours in parts that add up to it exactly: `parts`
    (name -> nano-dollars: compute on its steps, KV memory-time, the prefix-cache read
    charge) sum to `amount_nano` when the charge is reproduced; `resources` splits the
    compute charge (steps and cache read) over the kernel's resources; `largest` are its
    most expensive steps (hour, pool and the step columns)."""

    amount_nano: int
    parts: dict[str, int]
    resources: dict[str, int]
    steps: int
    largest: pl.DataFrame


@dataclass(frozen=True)
class Explanation:
    request_id: str
    hours: list[RequestHour]

    def summary(self, largest: int = LARGEST_STEPS) -> Summary:
        steps = [
            h.steps.with_columns(hour=pl.lit(hour_key(h.hour)), pool=pl.lit(h.pool))
            for h in self.hours
        ]
        every = pl.concat(steps) if steps else pl.DataFrame()
        resources: dict[str, int] = {}
        for h in self.hours:
            for resource, nano in h.resources.items():
                resources[resource] = resources.get(resource, 0) + nano
        parts = {
            "compute": sum(int(h.steps["compute_nano"].sum()) for h in self.hours),
            "kv_memory_time": sum(int(h.steps["kv_nano"].sum()) for h in self.hours),
            "cache_read": sum(h.cache_read_nano for h in self.hours),
        }
        top = (
            every.sort(
                ["share_nano", "hour", "replica", "seq"], descending=[True, False, False, False]
            )
            .head(largest)
            .select("hour", "pool", *STEP_COLUMNS)
            if every.height
            else every
        )
        return Summary(self.amount_nano, parts, resources, every.height, top)

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
            "summary": _summary_json(self.summary()),
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


def _summary_json(summary: Summary) -> dict[str, object]:
    return {
        "amount_nano": summary.amount_nano,
        "parts": summary.parts,
        "resources": summary.resources,
        "steps": summary.steps,
        "largest_steps": summary.largest.to_dicts(),
    }


_CHARGES = """
SELECT c.request_id, c.hour, c.pool, c.tenant, c.feature, c.line_kind, c.amount_nano,
       c.compute_nano, c.kv_nano, c.cached_tokens,
       EXISTS (SELECT 1 FROM published_hours p WHERE p.hour = c.hour AND p.pool = c.pool)
           AS published,
       (SELECT first(weights_version) FROM ledger_lines l
         WHERE l.hour = c.hour AND l.pool = c.pool) AS weights_version,
       (SELECT first(policy_version) FROM ledger_lines l
         WHERE l.hour = c.hour AND l.pool = c.pool) AS policy_version
FROM request_costs c WHERE list_contains(?::VARCHAR[], c.request_id)
ORDER BY c.hour, c.pool, c.request_id
"""


def explain_request(data_dir: Path, request_id: str) -> Explanation:
    """The request's charge in every pool-hour the warehouse of `data_dir` holds it in."""
    (explanation,) = explain_requests(data_dir, [request_id])
    return explanation


def explain_requests(data_dir: Path, request_ids: Sequence[str]) -> list[Explanation]:
    """Each request's charge in every pool-hour the warehouse of `data_dir` holds it in, in
    the order given; each of those hours is attributed once for all of them."""
    with finance.connect(data_dir) as con:
        charges = con.execute(_CHARGES, [list(request_ids)]).pl()
    charged = set(charges["request_id"])
    missing = [r for r in request_ids if r not in charged]
    if missing:
        raise ExplainError(f"request {missing[0]!r}: not charged in the warehouse of {data_dir}")
    pools = {p.name: p for p in load_pools(DataDir(data_dir).pools_file).pools}
    hours: dict[str, list[RequestHour]] = {r: [] for r in request_ids}
    for (_, pool_name), hour_charges in charges.group_by("hour", "pool", maintain_order=True):
        pool = pools.get(str(pool_name))
        if pool is None:
            raise ExplainError(
                f"request {hour_charges['request_id'][0]!r}: pool {pool_name!r} is not in "
                f"{DataDir(data_dir).pools_file}"
            )
        for request_id, request_hour in _explain_hour(data_dir, pool, hour_charges).items():
            hours[request_id].append(request_hour)
    return [Explanation(r, hours[r]) for r in request_ids]


def _explain_hour(data_dir: Path, pool: Pool, charges: pl.DataFrame) -> dict[str, RequestHour]:
    """The charged requests of one pool-hour (`charges`: their rows of `_CHARGES`), each with
    its allocation rows as the hour's attribution makes them from its saved inputs."""
    hour = from_warehouse(charges["hour"][0])
    try:
        inputs, weights = saved_inputs(data_dir, pool, hour)
    except SavedInputsMissing as err:
        raise ExplainError(str(err)) from err
    request_ids = charges["request_id"].to_list()
    attribution = attribute_pool_hour(
        DataDir(data_dir).lake, pool, inputs, weights, allocations_of=request_ids
    )
    steps = _by_request(attribution.allocations)
    details = _by_request(attribution.request_details)
    context = _by_request(inputs.context)
    # A request the lake no longer gives rows for has none: it is then not reproduced.
    none = attribution.request_details.clear()
    explained = {}
    for charge in charges.iter_rows(named=True):
        request_id = charge["request_id"]
        retry = context.get(request_id)
        retry_of = retry["retry_of"][0] if retry is not None else None
        retry_cause = retry["retry_cause"][0] if retry is not None else None
        explained[request_id] = RequestHour(
            hour=hour,
            pool=pool.name,
            published=charge["published"],
            tenant=charge["tenant"],
            feature=charge["feature"],
            line_kind=charge["line_kind"],
            paid_by=_paid_by(charge["line_kind"]),
            amount_nano=charge["amount_nano"],
            compute_nano=charge["compute_nano"],
            kv_nano=charge["kv_nano"],
            weights_version=str(charge["weights_version"]),
            policy_version=str(charge["policy_version"]),
            policies=pool.policies.model_dump(mode="json"),
            alpha=attribution.alpha,
            retry_of=retry_of,
            retry_cause=retry_cause,
            retry_handling=_retry_handling(pool, charge["line_kind"], retry_of, retry_cause),
            cached_tokens=charge["cached_tokens"],
            prefix_cache=pool.policies.prefix_cache,
            cache_read_nano=int(details.get(request_id, none)["cache_read_nano"].sum()),
            steps=steps.get(request_id, attribution.allocations.clear()).select(STEP_COLUMNS),
            resources=attribution.ledger.resource_parts(request_id, charge["compute_nano"]),
        )
    return explained


def _by_request(frame: pl.DataFrame) -> dict[str, pl.DataFrame]:
    """The frame's rows of each request_id."""
    return {
        str(key[0]): rows
        for key, rows in frame.partition_by("request_id", as_dict=True, maintain_order=True).items()
    }


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
