"""The silence check: a replica without a step log while DCGM shows its GPUs busy."""

from __future__ import annotations

from datetime import datetime

import polars as pl

from pipeline.reconcile.facts import HourFacts
from pipeline.reconcile.findings import SILENT_REPLICA
from pipeline.reconcile.frames import steps_of_hour
from pipeline.reconcile.result import CheckResult, fold
from schemas.config import Pool, Settings
from schemas.units import hour_bounds_ns, hour_key


def run(facts: HourFacts) -> list[CheckResult]:
    """The silence check of the gathered pool-hour."""
    return check_silence(facts.hour, facts.pool, facts.steps, facts.dcgm, facts.settings)


def check_silence(
    hour: datetime, pool: Pool, steps: pl.DataFrame, dcgm: pl.DataFrame, settings: Settings
) -> list[CheckResult]:
    """Per replica: no step logged in the hour while DCGM shows its GPUs busy is missing step
    logs, not idle time. Billing the hour would turn the replica's work into idle cost, so it
    holds the hour back (ERROR, blocking). Busy: mean GR_ENGINE_ACTIVE above
    `settings.dcgm_tolerance`, the band within which an idle GPU's readings fall."""
    start_ns, end_ns = hour_bounds_ns(hour)
    logged = set(steps_of_hour(steps, hour, pool)["replica"].unique().to_list())
    activity = dict(
        dcgm.filter(pl.col("timestamp_ns").is_between(start_ns, end_ns, closed="left"))
        .group_by("uuid")
        .agg(pl.col("value").mean())
        .iter_rows()
    )
    band = settings.dcgm_tolerance
    results = []
    for replica in pool.replicas:
        seen = [activity[uuid] for uuid in replica.gpu_uuids if uuid in activity]
        active = sum(seen) / len(seen) if seen else None
        findings = []
        if replica.id not in logged and active is not None and active > band:
            findings.append(
                SILENT_REPLICA.found(
                    f"no step log from replica {replica.id} (host {replica.hostname}) in hour "
                    f"{hour_key(hour)} while DCGM shows its GPUs {active:.1%} busy (idle band "
                    f"±{band:.0%}): its segments are missing, and billing the hour would charge "
                    "its work as idle"
                )
            )
        observed = f"{'steps logged' if replica.id in logged else 'no steps'}; " + (
            f"DCGM mean {active:.3f}" if active is not None else "no DCGM samples"
        )
        results.append(
            fold(
                (hour, pool.name, replica.id),
                "silence",
                f"steps logged whenever DCGM activity exceeds {band:.2f}",
                observed,
                findings,
                passed_detail=observed,
                weights=pool.policies.weights,
            )
        )
    return results
