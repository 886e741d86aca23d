"""What the report shows, read from the warehouse (read-only) and the Parquet lake.

Money stays integer nano-dollars here; the renderer turns it into dollars. The per-resource
breakdown comes from the kernel's work per request and resource that attribution stored with
each hour's ledger in the lake (`HourLedger.resource_work`): each request's compute
charge is split over the five resources in proportion to it, so a tenant's resource columns
add up exactly to its compute charge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import duckdb
import numpy as np
import polars as pl

from pipeline.attribution.ledger import split_by_resource
from pipeline.attribution.weights import kernel_weights
from pipeline.storage.lake import load_ledger
from pipeline.storage.warehouse import connect_read_only, query_frame
from pricing import RESOURCES, Slots
from schemas.config import Pool, PoolsFile
from schemas.errors import StateError
from schemas.units import (
    from_warehouse,
    hour_key,
    instant_to_warehouse,
    parse_hour_key,
    to_warehouse,
)

UNATTRIBUTED = "(unattributed)"
SWEEP_BATCHES = np.arange(1, 257)
# Decode context used for the bottleneck chart when the lake holds no decode slot of the pool.
FALLBACK_CONTEXT = 2048
TOP_REQUESTS = 20


class ReportError(StateError, ValueError):
    """The report cannot be built; the message says what is missing and what to run."""


@dataclass(frozen=True)
class Scope:
    """The hours a report covers: [start, end), UTC, and how to name them."""

    start: datetime
    end: datetime
    label: str

    @classmethod
    def everything(cls) -> Scope:
        return cls(
            datetime(1970, 1, 1, tzinfo=UTC),
            datetime(9999, 1, 1, tzinfo=UTC),
            "all hours",
        )

    @classmethod
    def hour(cls, key: str) -> Scope:
        start = parse_hour_key(key)
        return cls(start, start + timedelta(hours=1), f"hour {hour_key(start)} UTC")

    @classmethod
    def day(cls, text: str) -> Scope:
        try:
            start = datetime.strptime(text, "%Y-%m-%d").replace(tzinfo=UTC)
        except ValueError as err:
            raise ValueError(f"day {text!r} is not of the form YYYY-MM-DD") from err
        return cls(start, start + timedelta(days=1), f"day {text} UTC")

    def params(self) -> list[datetime]:
        # Not to_warehouse: the scope's ends need not be hours the warehouse can hold.
        return [instant_to_warehouse(self.start), instant_to_warehouse(self.end)]


@dataclass(frozen=True)
class BottleneckSweep:
    """A pool's deployment priced for decode batches 1..256 at one context length."""

    pool: str
    title: str
    context_tokens: int
    context_source: str  # where the context length came from
    batches: np.ndarray
    resource_ms: dict[str, np.ndarray]
    overlap_ms: np.ndarray
    nooverlap_ms: np.ndarray
    bottleneck_ranges: list[tuple[str, int, int]]  # (resource, first batch, last batch)


@dataclass(frozen=True)
class MonthToDate:
    """The UTC month of the report's last published hour: per tenant what its published hours
    cost from the month's start through that hour, and a projection to the month's end at
    the rate of the hours published so far (amount + amount x hours left // hours published)."""

    month: datetime
    through: datetime  # the end of the last published hour
    published_hours: int  # distinct published hours of the month so far
    hours_left: int  # from `through` to the month's end
    tenants: pl.DataFrame  # tenant, amount_nano, projected_nano


@dataclass(frozen=True)
class ReportData:
    warehouse: Path
    scope: Scope
    generated_at: datetime
    invoices: pl.DataFrame  # hour, pool, gpus, usd_per_gpu_hour, amount_nano, published, reason
    lines: (
        pl.DataFrame
    )  # hour, pool, tenant, feature, line_kind, amount_nano, requests, new_tokens, cached_tokens
    requests: pl.DataFrame  # the TOP_REQUESTS most expensive published request-hours
    resources: (
        pl.DataFrame
    )  # tenant, <r>_us, <r>_nano per resource, compute_nano, kv_nano, requests
    checks: pl.DataFrame  # reconciliation rows of the scope
    alerts: pl.DataFrame
    sweeps: list[BottleneckSweep]
    # Each invoiced pool's target utilization, from the pools file.
    targets: dict[str, float] = field(default_factory=dict)
    month: MonthToDate | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def published_lines(self) -> pl.DataFrame:
        published = self.invoices.filter(pl.col("published")).select("hour", "pool")
        return self.lines.join(published, on=["hour", "pool"], how="semi")


_INVOICES = """
SELECT i.hour, i.pool, i.gpus, i.usd_per_gpu_hour, i.amount_nano,
       p.hour IS NOT NULL AS published, h.reason
FROM invoices i
LEFT JOIN published_hours p USING (hour, pool)
LEFT JOIN held_back_hours h USING (hour, pool)
WHERE i.hour >= ? AND i.hour < ?
ORDER BY i.hour, i.pool
"""
_LINES = """
SELECT hour, pool, tenant, feature, line_kind, amount_nano, charged_requests AS requests,
       new_tokens, cached_tokens
FROM counted_ledger_lines WHERE hour >= ? AND hour < ?
ORDER BY hour, pool, line_kind, tenant, feature
"""
_TOP_REQUESTS = f"""
SELECT hour, pool, request_id, coalesce(tenant, '{UNATTRIBUTED}') AS tenant,
       coalesce(feature, '{UNATTRIBUTED}') AS feature,
       amount_nano, compute_nano, kv_nano, steps, prompt_tokens, output_tokens, new_tokens, cached_tokens
FROM cost_per_request WHERE hour >= ? AND hour < ?
ORDER BY amount_nano DESC, hour, pool, request_id
LIMIT {TOP_REQUESTS}
"""
_CHECKS = """
SELECT hour, pool, replica, check_name, passed, severity, blocking, expected, observed, detail
FROM reconciliation WHERE hour >= ? AND hour < ?
ORDER BY hour, pool, check_name, replica NULLS FIRST
"""
_ALERTS = """
SELECT raised_at, severity, kind, hour, pool, replica, detail
FROM alerts WHERE hour >= ? AND hour < ?
ORDER BY hour, pool, kind, replica NULLS FIRST
"""
_MONTH_TO_DATE = """
SELECT tenant, CAST(sum(amount_nano) AS BIGINT) AS amount_nano
FROM published_ledger_lines WHERE hour >= ? AND hour < ?
GROUP BY tenant ORDER BY amount_nano DESC, tenant
"""
_MONTH_HOURS = "SELECT count(DISTINCT hour) FROM published_hours WHERE hour >= ? AND hour < ?"
_REQUEST_COSTS = f"""
SELECT request_id, coalesce(tenant, '{UNATTRIBUTED}') AS tenant, compute_nano, kv_nano
FROM request_costs WHERE hour = ? AND pool = ?
"""


def load_report(
    warehouse: Path, pools: PoolsFile, lake: Path, scope: Scope, *, now: datetime | None = None
) -> ReportData:
    """Everything the report shows for `scope`, from a read-only warehouse connection."""
    notes: list[str] = []
    with connect_read_only(warehouse) as con:
        try:
            invoices = query_frame(con, _INVOICES, scope.params())
        except duckdb.CatalogException as err:
            raise ReportError(
                f"{warehouse}: not a stepledger warehouse ({err}); run `stepledger run` first"
            ) from err
        if invoices.is_empty():
            raise ReportError(
                f"{warehouse}: no invoiced hours in {scope.label}; run `stepledger run` for those hours, "
                "or choose another --hour/--day"
            )
        lines = query_frame(con, _LINES, scope.params())
        top = query_frame(con, _TOP_REQUESTS, scope.params())
        checks = query_frame(con, _CHECKS, scope.params())
        alerts = query_frame(con, _ALERTS, scope.params())
        resources, decode_contexts = _resource_breakdown(con, pools, lake, invoices, notes)
        month = _month_to_date(con, invoices)
    sweeps = [
        _sweep(pool, decode_contexts.get(pool.name))
        for pool in pools.pools
        if pool.name in set(invoices["pool"].to_list())
    ]
    return ReportData(
        warehouse=warehouse,
        scope=scope,
        generated_at=now or datetime.now(UTC),
        invoices=invoices,
        lines=lines,
        requests=top,
        resources=resources,
        checks=checks,
        alerts=alerts,
        sweeps=sweeps,
        targets={p.name: p.target_utilization for p in pools.pools},
        month=month,
        notes=notes,
    )


def _month_to_date(con: duckdb.DuckDBPyConnection, invoices: pl.DataFrame) -> MonthToDate | None:
    published = invoices.filter(pl.col("published"))
    if published.is_empty():
        return None
    through = from_warehouse(published["hour"].max()) + timedelta(hours=1)  # type: ignore[arg-type]
    last = through - timedelta(hours=1)
    month = last.replace(day=1, hour=0)
    month_end = (month + timedelta(days=32)).replace(day=1)
    bounds: list[object] = [to_warehouse(month), to_warehouse(through)]
    hours = int(con.execute(_MONTH_HOURS, bounds).fetchall()[0][0])
    hours_left = (month_end - through) // timedelta(hours=1)
    tenants = query_frame(con, _MONTH_TO_DATE, bounds).with_columns(
        (pl.col("amount_nano") + pl.col("amount_nano") * hours_left // hours).alias(
            "projected_nano"
        )
    )
    return MonthToDate(month, through, hours, hours_left, tenants)


def _resource_breakdown(
    con: duckdb.DuckDBPyConnection,
    pools: PoolsFile,
    lake: Path,
    invoices: pl.DataFrame,
    notes: list[str],
) -> tuple[pl.DataFrame, dict[str, int]]:
    """Per tenant: kernel work per resource and its compute charge split over the resources.

    Also returns each pool's median decode context over the scope (for the bottleneck chart).
    """
    per_request = []
    decode_contexts: dict[str, list[pl.DataFrame]] = {}
    for stored_hour, pool_name in invoices.select("hour", "pool").iter_rows():
        hour = from_warehouse(stored_hour)
        if pool_name not in {p.name for p in pools.pools}:
            notes.append(f"pool {pool_name} is not in the pools file: no resource breakdown for it")
            continue
        costs = query_frame(con, _REQUEST_COSTS, [to_warehouse(hour), pool_name])
        try:
            ledger = load_ledger(lake, pool_name, hour)
        except FileNotFoundError:
            if costs.height:
                notes.append(
                    f"{hour_key(hour)} {pool_name}: no ledger in {lake}, so its requests are "
                    "missing from the resource breakdown"
                )
            continue
        decode_contexts.setdefault(pool_name, []).append(ledger.decode_contexts)
        request_work = ledger.resource_work
        # Requests that only held KV blocks in the hour have no slot work and no compute charge;
        # they stay in for their KV memory.
        joined = costs.join(request_work, on="request_id", how="left").with_columns(
            pl.col(f"{r}_us").fill_null(0.0) for r in RESOURCES
        )
        unexplained = joined.filter(
            (pl.col("compute_nano") > 0) & (pl.sum_horizontal(*(f"{r}_us" for r in RESOURCES)) == 0)
        )
        if unexplained.height:
            notes.append(
                f"{hour_key(hour)} {pool_name}: {unexplained.height} request(s) charged for compute have no "
                f"slot work stored in {lake} (e.g. {unexplained['request_id'][0]}); they are left out of the resource "
                "breakdown"
            )
            joined = joined.join(unexplained.select("request_id"), on="request_id", how="anti")
        per_request.append(joined)

    frames = [f for f in per_request if f.height]
    if not frames:
        empty = {
            "tenant": pl.String,
            "requests": pl.Int64,
            "compute_nano": pl.Int64,
            "kv_nano": pl.Int64,
        }
        empty |= {f"{r}_us": pl.Float64 for r in RESOURCES} | {
            f"{r}_nano": pl.Int64 for r in RESOURCES
        }
        return pl.DataFrame(schema=empty), _medians(decode_contexts)
    rows = pl.concat(frames).sort("tenant", "request_id")
    shares = split_by_resource(
        rows["compute_nano"].to_numpy(), rows.select(f"{r}_us" for r in RESOURCES).to_numpy()
    )
    split = rows.with_columns(pl.Series(f"{r}_nano", shares[:, i]) for i, r in enumerate(RESOURCES))
    by_tenant = (
        split.group_by("tenant", maintain_order=True)
        .agg(
            pl.len().cast(pl.Int64).alias("requests"),
            pl.col("compute_nano").sum(),
            pl.col("kv_nano").sum(),
            *(pl.col(f"{r}_us").sum() for r in RESOURCES),
            *(pl.col(f"{r}_nano").sum() for r in RESOURCES),
        )
        .sort("compute_nano", "tenant", descending=[True, False])
    )
    return by_tenant, _medians(decode_contexts)


def _medians(contexts: dict[str, list[pl.DataFrame]]) -> dict[str, int]:
    """Each pool's median decode context over its hours' (context_tokens, slots) counts: the
    middle slot's context, or the mean of the middle two, truncated to whole tokens."""
    medians = {}
    for pool, parts in contexts.items():
        counts = pl.concat(parts).group_by("context_tokens").agg(pl.col("slots").sum())
        counts = counts.sort("context_tokens")
        total = int(counts["slots"].sum())
        if not total:
            continue
        values = counts["context_tokens"].to_numpy()
        ends = np.cumsum(counts["slots"].to_numpy())
        low, high = (
            values[np.searchsorted(ends, k, side="right")] for k in ((total - 1) // 2, total // 2)
        )
        medians[pool] = int((int(low) + int(high)) / 2)
    return medians


def _sweep(pool: Pool, median_context: int | None) -> BottleneckSweep:
    """Price decode batches of 1..256 requests, each at `context` tokens (with the pool's
    speculative tokens), on the pool's deployment."""
    kernel = kernel_weights(pool).kernel
    context = median_context if median_context is not None else FALLBACK_CONTEXT
    source = (
        "median decode context in the lake"
        if median_context is not None
        else "no decode slots in the lake: default"
    )
    tokens = 1 + pool.engine.num_spec_tokens
    step_index = np.repeat(np.arange(SWEEP_BATCHES.size), SWEEP_BATCHES)
    computed = np.full(step_index.size, max(context - tokens, 0), dtype=np.int64)
    scheduled = np.full(step_index.size, tokens, dtype=np.int64)
    prices = kernel.price_many(
        Slots(step_index, scheduled, computed, computed), n_steps=SWEEP_BATCHES.size
    )
    bottleneck = prices.bottleneck.astype(np.int64)
    changes = np.flatnonzero(np.diff(bottleneck)) + 1
    ranges = [
        (RESOURCES[bottleneck[first]], int(SWEEP_BATCHES[first]), int(SWEEP_BATCHES[end - 1]))
        for first, end in zip(np.r_[0, changes], np.r_[changes, SWEEP_BATCHES.size], strict=True)
    ]
    d = pool.deployment()
    return BottleneckSweep(
        pool=pool.name,
        title=(
            f"{pool.name}: {d.model} {d.dtype or ''} on {d.tp}x {d.chip}, {d.cudagraph_mode}"
            + (f", {d.num_spec_tokens} speculative token(s)" if d.num_spec_tokens else "")
        ),
        context_tokens=context,
        context_source=source,
        batches=SWEEP_BATCHES,
        resource_ms={r: getattr(prices, f"{r}_us") / 1e3 for r in RESOURCES},
        overlap_ms=prices.overlap_us / 1e3,
        nooverlap_ms=prices.nooverlap_us / 1e3,
        bottleneck_ranges=ranges,
    )
