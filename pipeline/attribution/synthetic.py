"""Synthetic step logs with a known work model, in the decoder's table schemas.

For tests and benchmarks of the attribution core: step durations follow
c0 + sum(a t + b t (L + (t+1)/2)) ms (optionally with noise), so a fit must recover the
coefficients; slots, holders and gateway context look like a busy pool's.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
import polars as pl

from schemas.config import Policies, Pool, Replica
from schemas.units import hour_start_ns

HOUR = datetime(2026, 11, 30, 5, tzinfo=UTC)
HOUR_START_NS = hour_start_ns(HOUR)


def synthetic_pool(
    replicas: int = 2,
    gpus_per_replica: int = 1,
    *,
    name: str = "chat",
    replica_id: str = "r{i}",
    hostname: str = "node",
    gpu_uuid: str = "GPU-{i}-{g}",
    **policies: Any,
) -> Pool:
    """Pool `name` (Llama 3.1 8B on H100 at $3.60/GPU-h) with the given policies. Replica `i`'s
    id, host and GPU `g`'s UUID are the templates formatted with `name`, `i` and `g`."""
    return Pool(
        name=name,
        model="llama-3.1-8b-instruct",
        gpu_type="h100",
        gpus_per_replica=gpus_per_replica,
        usd_per_gpu_hour=3.60,
        capacity_owner="platform",
        slo_owner="support",
        target_utilization=0.7,
        replicas=[
            Replica(
                id=replica_id.format(name=name, i=i),
                hostname=hostname.format(i=i),
                gpu_uuids=[gpu_uuid.format(i=i, g=g) for g in range(gpus_per_replica)],
            )
            for i in range(replicas)
        ],
        policies=Policies(**policies),
    )


@dataclass
class StepLog:
    """A generated step log's tables: steps, their slots, KV holders and context records."""

    steps: pl.DataFrame
    slots: pl.DataFrame
    holders: pl.DataFrame
    context: pl.DataFrame


def synthetic_log(
    pool: Pool,
    *,
    steps_per_replica: int = 200,
    seed: int = 0,
    coefficients: tuple[float, float, float] = (12.0, 0.05, 0.00005),
    noise: float = 0.0,
    start_ns: int = HOUR_START_NS - 20_000_000,
    gap_ns: int = 5_000_000,
    missing_context: float = 0.1,
    holders_per_step: int = 2,
) -> StepLog:
    """Steps whose durations follow c0 + sum(a t + b t (L + (t+1)/2)) (ms), slots of a pool of
    requests (some prefill chunks, mostly decodes), holders, and context for most requests."""
    rng = np.random.default_rng(seed)
    requests = [f"req-{seed}-{i}" for i in range(60)]
    steps: list[dict[str, Any]] = []
    slots: list[dict[str, Any]] = []
    holders: list[dict[str, Any]] = []
    for replica in pool.streams:
        clock = start_ns
        for seq in range(steps_per_replica):
            duration = _synthetic_step(
                rng,
                pool,
                replica.id,
                seq,
                clock,
                requests,
                coefficients,
                noise,
                holders_per_step,
                (steps, slots, holders),
            )
            clock += duration + int(rng.integers(0, gap_ns + 1))
    known = [r for r in requests if rng.random() >= missing_context]
    causes = rng.choice(
        np.array([None, "client_timeout", "platform_timeout"], dtype=object),
        size=len(known),
        p=[0.8, 0.1, 0.1],
    )
    gateway_context = pl.DataFrame(
        {
            "request_id": known,
            "tenant": [f"tenant-{i % 3}" for i in range(len(known))],
            "feature": [f"feature-{i % 2}" for i in range(len(known))],
            "api_key_id": [f"key-{i % 3}" for i in range(len(known))],
            "retry_of": [None if c is None else "earlier" for c in causes],
            "retry_cause": list(causes),
        },
        schema={
            c: pl.String
            for c in ("request_id", "tenant", "feature", "api_key_id", "retry_of", "retry_cause")
        },
    )
    return StepLog(
        pl.DataFrame(steps).cast(
            {
                "seq": pl.Int64,
                "free_blocks": pl.Int32,
                "total_blocks": pl.Int32,
                "num_slots": pl.Int32,
                "num_holders": pl.Int32,
            }
        ),
        pl.DataFrame(slots).cast(
            {
                "seq": pl.Int64,
                "slot_index": pl.Int32,
                "new_tokens": pl.Int32,
                "context_tokens": pl.Int32,
                "prompt_tokens": pl.Int32,
                "prefix_hit_tokens": pl.Int32,
                "spec_drafted": pl.Int32,
                "spec_accepted": pl.Int32,
            }
        ),
        pl.DataFrame(holders).cast({"seq": pl.Int64, "holder_index": pl.Int32}),
        gateway_context,
    )


def _synthetic_step(
    rng: np.random.Generator,
    pool: Pool,
    replica: str,
    seq: int,
    clock: int,
    requests: list[str],
    coefficients: tuple[float, float, float],
    noise: float,
    holders_per_step: int,
    rows: tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]],
) -> int:
    """Append one step's row, slot rows and holder rows to `rows`; the step's duration."""
    c0, a, b = coefficients
    steps, slots, holders = rows
    n = int(rng.integers(1, 9))
    chosen = rng.choice(len(requests), size=n, replace=False)
    prefill = rng.random(n) < 0.2
    new = np.where(
        prefill,
        rng.integers(16, 1024, n),
        1 + rng.integers(0, 3, n) * (pool.engine.num_spec_tokens > 0),
    )
    context = rng.integers(0, 6000, n)
    prompt = np.where(prefill, context + new + rng.integers(0, 200, n), rng.integers(1, 4000, n))
    hits = np.where(prefill & (context > 0) & (rng.random(n) < 0.5), np.minimum(context, 256), 0)
    drafted = np.where(new > 1, new - 1, 0) * (~prefill)
    accepted = (drafted * rng.random(n)).astype(int)
    work = c0 + (a * new + b * new * (context + (new + 1) / 2)).sum()
    duration = int(work * (1 + noise * rng.standard_normal()) * 1_000_000)
    steps.append(
        {
            "pool": pool.name,
            "replica": replica,
            "segment_id": f"{replica}-s0",
            "seq": seq,
            "start_ns": clock,
            "end_ns": clock + duration,
            "start_utc_ns": clock,
            "end_utc_ns": clock + duration,
            "admission_blocked": bool(rng.random() < 0.3),
            "free_blocks": 100,
            "total_blocks": 6000,
            "num_slots": n,
            "num_holders": holders_per_step,
        }
    )
    for position, index in enumerate(chosen):
        slots.append(
            {
                "pool": pool.name,
                "replica": replica,
                "seq": seq,
                "slot_index": position,
                "request_id": requests[index],
                "new_tokens": int(new[position]),
                "context_tokens": int(context[position]),
                "kv_blocks": float(
                    np.ceil((context[position] + new[position]) / 16) / rng.integers(1, 3)
                ),
                "prompt_tokens": int(prompt[position]),
                "prefix_hit_tokens": int(hits[position]),
                "spec_drafted": int(drafted[position]),
                "spec_accepted": int(accepted[position]),
            }
        )
    others = [i for i in range(len(requests)) if i not in set(chosen)]
    for position, index in enumerate(rng.choice(others, size=holders_per_step, replace=False)):
        holders.append(
            {
                "pool": pool.name,
                "replica": replica,
                "seq": seq,
                "holder_index": position,
                "request_id": requests[index],
                "kv_blocks": float(rng.integers(1, 200)),
                "state": str(rng.choice(["waiting", "preempted", "swapped"])),
            }
        )
    return duration
