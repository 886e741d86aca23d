"""The plausibility check: each replica's engine busy fraction against DCGM's activity, and
the KV blocks its steps' requests hold against the blocks the engine has."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

import polars as pl

from pipeline.reconcile.facts import HourFacts
from pipeline.reconcile.findings import (
    DCGM_MISSING,
    GPU_BUSIER,
    HOST_STALL,
    IMPOSSIBLE_KV,
    Finding,
)
from pipeline.reconcile.frames import steps_of_hour
from pipeline.reconcile.ranges import RANGES_LISTED, compact_ranges, runs
from pipeline.reconcile.result import CheckResult, fold
from schemas.config import Pool, Replica, Settings
from schemas.units import HOUR_NS, hour_bounds_ns, hour_key


def run(facts: HourFacts) -> list[CheckResult]:
    """The plausibility check of the gathered pool-hour."""
    return check_plausibility(
        facts.hour, facts.pool, facts.steps, facts.dcgm, facts.settings, kv_held=facts.kv_held
    )


def kv_held_by_step(slots: pl.DataFrame, holders: pl.DataFrame) -> pl.DataFrame:
    """`replica`, `seq` and the KV blocks (`kv_blocks`) a step's slots and holders hold."""
    parts = [frame.select("replica", "seq", "kv_blocks") for frame in (slots, holders)]
    return pl.concat(parts).group_by("replica", "seq").agg(pl.col("kv_blocks").sum())


def check_plausibility(
    hour: datetime,
    pool: Pool,
    steps: pl.DataFrame,
    dcgm: pl.DataFrame,
    settings: Settings,
    *,
    kv_held: pl.DataFrame | None = None,
) -> list[CheckResult]:
    """The engine's busy fraction against the mean DCGM engine activity of the replica's GPUs.

    `steps` (STEPS): busy fraction = step time starting in the hour / 3600 s. `dcgm`: samples
    as `pipeline.ingestion.dcgm.parse_dcgm` returns them, matched to the pool's replicas by GPU UUID; the
    hour's samples are averaged per GPU, then over the replica's GPUs. DCGM readings are
    instantaneous, so the comparison uses the band `settings.dcgm_tolerance`. A GPU without
    samples is its own failed finding. `kv_held` (`kv_held_by_step`): the KV blocks each
    step's requests hold, against the step's `total_blocks`; a block shared by k requests
    counts 1/k, so they never exceed it.
    """
    start_ns, end_ns = hour_bounds_ns(hour)
    band = settings.dcgm_tolerance
    busy = dict(
        steps_of_hour(steps, hour, pool)
        .group_by("replica")
        .agg((pl.col("end_ns") - pl.col("start_ns")).sum())
        .iter_rows()
    )
    activity = {
        uuid: (mean, samples)
        for uuid, mean, samples in dcgm.filter(
            pl.col("timestamp_ns").is_between(start_ns, end_ns, closed="left")
        )
        .group_by("uuid")
        .agg(pl.col("value").mean(), pl.len())
        .iter_rows()
    }
    overfull = _overfull_steps(steps_of_hour(steps, hour, pool), kv_held)
    return [
        _plausibility_of_replica(
            (hour, pool, replica), busy.get(replica.id), activity, band, overfull
        )
        for replica in pool.streams
    ]


# Sums of 1/k shares of blocks round: a step exceeds its blocks beyond this many.
_KV_ROUNDING_BLOCKS = 1e-6


def _overfull_steps(steps: pl.DataFrame, kv_held: pl.DataFrame | None) -> pl.DataFrame:
    """`replica`, `seq`, `kv_blocks` and `total_blocks` of the steps holding more KV blocks
    than the engine has."""
    if kv_held is None:
        kv_held = pl.DataFrame(
            schema={"replica": pl.String, "seq": pl.Int64, "kv_blocks": pl.Float64}
        )
    return (
        steps.select("replica", "seq", "total_blocks")
        .join(kv_held, on=["replica", "seq"])
        .filter(pl.col("kv_blocks") > pl.col("total_blocks") + _KV_ROUNDING_BLOCKS)
        .sort("replica", "seq")
    )


def _impossible_kv(overfull: pl.DataFrame) -> list[Finding]:
    if not overfull.height:
        return []
    worst = overfull.row(int(overfull["kv_blocks"].arg_max() or 0), named=True)
    seqs = runs(overfull["seq"].to_numpy())
    return [
        IMPOSSIBLE_KV.found(
            f"{overfull.height} steps (seq {compact_ranges(seqs, RANGES_LISTED)}) hold more KV "
            f"blocks than the engine has; the most, step {worst['seq']}: "
            f"{worst['kv_blocks']:.1f} blocks of {worst['total_blocks']}"
        )
    ]


def _plausibility_of_replica(
    where: tuple[datetime, Pool, Replica],
    busy_ns: int | None,
    activity: Mapping[str, tuple[float, int]],
    band: float,
    overfull: pl.DataFrame,
) -> CheckResult:
    """The replica's result: its step time in the hour (`busy_ns`, None without steps) against
    the mean activity of its GPUs (`activity`: uuid -> mean, samples), and its steps among
    the pool's `overfull` ones."""
    hour, pool, replica = where
    busy_fraction = (busy_ns or 0) / HOUR_NS
    seen = [uuid for uuid in replica.gpu_uuids if uuid in activity]
    missing = [uuid for uuid in replica.gpu_uuids if uuid not in activity]
    expected = (
        f"DCGM_FI_PROF_GR_ENGINE_ACTIVE mean within ±{band:.2f} of engine busy {busy_fraction:.3f}"
    )
    findings = _impossible_kv(overfull.filter(pl.col("replica") == replica.id))
    if missing:
        findings.append(
            DCGM_MISSING.found(
                f"no DCGM samples for GPU {', '.join(missing)} in hour {hour_key(hour)} "
                f"(host {replica.hostname}): engine activity cannot be cross-checked"
            )
        )
    if not seen:
        observed = "no DCGM samples"
        passed_detail = ""
    else:
        active = sum(activity[uuid][0] for uuid in seen) / len(seen)
        samples = sum(activity[uuid][1] for uuid in seen)
        observed = f"DCGM mean {active:.3f} over {samples} samples of {len(seen)} GPUs"
        comparison = f"engine busy {busy_fraction:.1%} vs DCGM_FI_PROF_GR_ENGINE_ACTIVE mean {active:.1%} (band ±{band:.0%})"
        if busy_fraction - active > band:
            findings.append(
                HOST_STALL.found(
                    f"{comparison}: steps are stalling on the host, and customers would be "
                    "charged for CPU waits"
                )
            )
        elif active - busy_fraction > band:
            findings.append(
                GPU_BUSIER.found(
                    f"{comparison}: the GPU is busier than the engine's log, so steps went "
                    "unlogged or another process shares the GPU"
                )
            )
        passed_detail = f"replica idle (no steps): {comparison}" if busy_ns is None else comparison
    return fold(
        (hour, pool.name, replica.id),
        "plausibility",
        expected,
        observed,
        findings,
        passed_detail=passed_detail,
        weights=pool.policies.weights,
    )
