"""Builders of one pool-hour of pipeline tables, clean or with a fault of the simulator's kinds."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl

from pipeline.attribution.synthetic import synthetic_pool
from pipeline.ingestion.dcgm import DCGM_SCHEMA
from pipeline.reconcile import CheckResult, check_sequence
from schemas.config import Pool
from schemas.tables import DAMAGE, DROPS, SEGMENTS, STEPS
from schemas.units import hour_bounds_ns
from tests.helpers.hours import HOUR

HOUR_START_NS, HOUR_END_NS = hour_bounds_ns(HOUR)
MS = 1_000_000
S = 1_000_000_000
# A clean replica: a 30 ms step every 50 ms fills the hour exactly with 72,000 steps (60% busy).
STEP_NS = 30 * MS
PERIOD_NS = 50 * MS
STEPS_PER_HOUR = 72_000
# Monotonic clock reading at the hour's start (any boot-relative value).
MONO_AT_HOUR_NS = 987_654 * S


def empty(schema) -> pl.DataFrame:
    return pl.DataFrame(schema.empty_table())


def make_pool(
    *,
    name: str = "chat",
    replicas: int = 2,
    gpus: int = 1,
    weights: str = "kernel",
    unattributed: float = 0.02,
) -> Pool:
    return synthetic_pool(
        replicas,
        gpus,
        name=name,
        replica_id="{name}-r{i}",
        hostname="gpu-node-{i:02d}",
        gpu_uuid="GPU-{i:04d}-{g:04d}",
        weights=weights,
        unattributed_alert_fraction=unattributed,
    )


def make_steps(
    pool: Pool,
    replica: str,
    *,
    count: int = STEPS_PER_HOUR,
    first_seq: int = 0,
    step_ns: int = STEP_NS,
    period_ns: int = PERIOD_NS,
    segment_id: str = "seg-0",
) -> pl.DataFrame:
    """`count` steps from the hour's start, each `step_ns` long, one every `period_ns`."""
    offsets = np.arange(count, dtype=np.int64) * period_ns
    start_ns = MONO_AT_HOUR_NS + offsets
    return pl.DataFrame(
        {
            "pool": pool.name,
            "replica": replica,
            "segment_id": segment_id,
            "seq": np.arange(first_seq, first_seq + count, dtype=np.int64),
            "start_ns": start_ns,
            "end_ns": start_ns + step_ns,
            "start_utc_ns": HOUR_START_NS + offsets,
            "end_utc_ns": HOUR_START_NS + offsets + step_ns,
            "admission_blocked": False,
            "free_blocks": 100,
            "total_blocks": 6000,
            "num_slots": 8,
            "num_holders": 0,
        },
        schema=empty(STEPS).schema,
    )


def clean_steps(pool: Pool) -> pl.DataFrame:
    return pl.concat([make_steps(pool, replica.id) for replica in pool.replicas])


def without_seq(steps: pl.DataFrame, replica: str, first: int, last: int) -> pl.DataFrame:
    """The steps minus one replica's seq range (records lost)."""
    return steps.filter(~((pl.col("replica") == replica) & pl.col("seq").is_between(first, last)))


def shift_utc(steps: pl.DataFrame, replica: str, from_seq: int, shift_ns: int) -> pl.DataFrame:
    """Move one replica's wall-clock placement from `from_seq` on (a segment anchored to a stepped clock)."""
    moved = (pl.col("replica") == replica) & (pl.col("seq") >= from_seq)
    return steps.with_columns(
        pl.when(moved).then(pl.col(c) + shift_ns).otherwise(pl.col(c)).alias(c)
        for c in ("start_utc_ns", "end_utc_ns")
    )


def make_segments(
    pool: Pool, *, engine_version: str = "0.25.0", driver_version: str = "570.86"
) -> pl.DataFrame:
    rows = [
        {
            "path": f"outbox/{replica.id}/{replica.id}-000.seg",
            "segment_id": f"{replica.id}-000",
            "format_version": 1,
            "pool": pool.name,
            "replica": replica.id,
            "engine_name": "vllm",
            "engine_version": engine_version,
            "driver_version": driver_version,
            "model": pool.model,
            "gpu_type": pool.gpu_type,
            "gpus_per_replica": pool.gpus_per_replica,
            "kv_block_size": pool.kv_block_size,
            "mono_anchor_ns": MONO_AT_HOUR_NS,
            "wall_anchor_ns": HOUR_START_NS,
            "first_seq": 0,
            "last_seq": STEPS_PER_HOUR - 1,
            "steps": STEPS_PER_HOUR,
            "dropped_steps": 0,
            "bytes": 1 << 20,
        }
        for replica in pool.replicas
    ]
    return pl.DataFrame(rows, schema=empty(SEGMENTS).schema)


def make_drops(pool: Pool, replica: str, first: int, last: int) -> pl.DataFrame:
    return pl.DataFrame(
        [
            {
                "pool": pool.name,
                "replica": replica,
                "first_seq": first,
                "last_seq": last,
                "steps": last - first + 1,
            }
        ],
        schema=empty(DROPS).schema,
    )


def make_damage(
    path: str,
    kind: str,
    *,
    first: int | None = None,
    last: int | None = None,
    offset: int = 0,
    detail: str = "",
) -> pl.DataFrame:
    return pl.DataFrame(
        [
            {
                "path": path,
                "kind": kind,
                "byte_offset": offset,
                "byte_length": 100,
                "first_seq": first,
                "last_seq": last,
                "detail": detail,
            }
        ],
        schema=empty(DAMAGE).schema,
    )


def make_dcgm(pool: Pool, values: dict[str, list[float]]) -> pl.DataFrame:
    """Samples every 15 s from the hour's start, cycling through each UUID's `values`."""
    rows = []
    for replica in pool.replicas:
        for gpu_index, uuid in enumerate(replica.gpu_uuids):
            cycle = values.get(uuid, [])
            for sample in range(240 if cycle else 0):
                rows.append(
                    (
                        uuid,
                        replica.hostname,
                        gpu_index,
                        "NVIDIA H100 80GB HBM3",
                        HOUR_START_NS + sample * 15 * S,
                        cycle[sample % len(cycle)],
                    )
                )
    return pl.DataFrame(
        rows,
        schema=DCGM_SCHEMA,
        orient="row",
    )


def make_ledger(
    pool: Pool, lines: Sequence[tuple[str | None, str, int | None, int]]
) -> pl.DataFrame:
    """Ledger lines (tenant, line_kind, amount_nano, requests) for the hour."""
    return pl.DataFrame(
        [
            {
                "hour": HOUR.replace(tzinfo=None),
                "pool": pool.name,
                "tenant": tenant,
                "feature": "f",
                "line_kind": kind,
                "amount_nano": amount,
                "requests": requests,
                "new_tokens": 0,
                "cached_tokens": 0,
                "weights_version": "kernel",
                "policy_version": pool.policies.version(),
            }
            for tenant, kind, amount, requests in lines
        ],
        schema={
            "hour": pl.Datetime("us"),
            "pool": pl.String,
            "tenant": pl.String,
            "feature": pl.String,
            "line_kind": pl.String,
            "amount_nano": pl.Int64,
            "requests": pl.Int64,
            "new_tokens": pl.Int64,
            "cached_tokens": pl.Int64,
            "weights_version": pl.String,
            "policy_version": pl.String,
        },
    )


def make_invoice(pool: Pool, amount_nano: int) -> pl.DataFrame:
    return pl.DataFrame(
        [
            {
                "hour": HOUR.replace(tzinfo=None),
                "pool": pool.name,
                "gpus": len(pool.replicas) * pool.gpus_per_replica,
                "usd_per_gpu_hour": pool.usd_per_gpu_hour,
                "amount_nano": amount_nano,
            }
        ],
        schema={
            "hour": pl.Datetime("us"),
            "pool": pl.String,
            "gpus": pl.Int64,
            "usd_per_gpu_hour": pl.Float64,
            "amount_nano": pl.Int64,
        },
    )


def sequence(
    steps: pl.DataFrame,
    drops: pl.DataFrame | None = None,
    damage: pl.DataFrame | None = None,
    *,
    pool: Pool | None = None,
    **kwargs,
) -> list[CheckResult]:
    """The sequence check of the hour's `steps` for `pool` (the default pool), its segments
    as `make_segments` gives them, with no drops or damage unless given."""
    pool = pool or make_pool()
    return check_sequence(
        HOUR,
        pool,
        steps,
        empty(DROPS) if drops is None else drops,
        empty(DAMAGE) if damage is None else damage,
        make_segments(pool),
        **kwargs,
    )
