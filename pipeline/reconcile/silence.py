"""The silence check: a replica without a step log, or whose log stops, while DCGM shows its GPUs
busy, and a replica whose silence nothing can vouch for."""

from __future__ import annotations

from datetime import datetime

import polars as pl

from pipeline.reconcile.facts import HourFacts
from pipeline.reconcile.findings import (
    SILENT_REPLICA,
    SILENT_TAIL,
    SILENT_UNVERIFIED,
    Finding,
)
from pipeline.reconcile.frames import steps_of_hour, utc_clock
from pipeline.reconcile.result import CheckResult, fold
from schemas.config import Pool, Replica, Settings
from schemas.units import NS_PER_SECOND, hour_bounds_ns, hour_key


def run(facts: HourFacts) -> list[CheckResult]:
    """The silence check of the gathered pool-hour."""
    return check_silence(facts.hour, facts.pool, facts.steps, facts.dcgm, facts.settings)


# DCGM readings cover the scrape interval before them: a reading within this of the last
# logged step's end may still show that step's work.
TAIL_GRACE_NS = 30 * NS_PER_SECOND


def check_silence(
    hour: datetime, pool: Pool, steps: pl.DataFrame, dcgm: pl.DataFrame, settings: Settings
) -> list[CheckResult]:
    """Per replica: no step logged in the hour while DCGM shows its GPUs busy is missing step
    logs, not idle time, and so is DCGM showing them busy after the replica's last logged step
    (its log's tail is missing). No step and no DCGM sample leaves nothing to tell idle from
    missing. Billing any of these would turn the replica's work into idle cost, so each holds
    the hour back (ERROR, blocking). Busy: mean GR_ENGINE_ACTIVE above
    `settings.dcgm_tolerance`, the band within which an idle GPU's readings fall."""
    start_ns, end_ns = hour_bounds_ns(hour)
    in_hour = steps_of_hour(steps, hour, pool)
    last_end = dict(in_hour.group_by("replica").agg(pl.col("end_utc_ns").max()).iter_rows())
    samples = dcgm.filter(pl.col("timestamp_ns").is_between(start_ns, end_ns, closed="left"))
    activity = dict(samples.group_by("uuid").agg(pl.col("value").mean()).iter_rows())
    results = []
    for replica in pool.streams:
        own = samples.filter(pl.col("uuid").is_in(list(replica.gpu_uuids)))
        seen = [activity[uuid] for uuid in replica.gpu_uuids if uuid in activity]
        active = sum(seen) / len(seen) if seen else None
        ended = last_end.get(replica.id)
        findings = _silence_findings(
            (hour, replica, settings.dcgm_tolerance),
            active,
            ended,
            own if ended is not None else own.clear(),
        )
        observed = f"{'steps logged' if ended is not None else 'no steps'}; " + (
            f"DCGM mean {active:.3f}" if active is not None else "no DCGM samples"
        )
        results.append(
            fold(
                (hour, pool.name, replica.id),
                "silence",
                f"steps logged whenever DCGM activity exceeds {settings.dcgm_tolerance:.2f}",
                observed,
                findings,
                passed_detail=observed,
                weights=pool.policies.weights,
            )
        )
    return results


def _silence_findings(
    where: tuple[datetime, Replica, float],
    active: float | None,
    ended: int | None,
    samples: pl.DataFrame,
) -> list[Finding]:
    hour, replica, band = where
    named = f"replica {replica.id} (host {replica.hostname}) in hour {hour_key(hour)}"
    if ended is None and active is None:
        return [
            SILENT_UNVERIFIED.found(
                f"no step log and no DCGM sample from {named}: nothing shows it sat idle, so "
                "the hour is not billed as idle"
            )
        ]
    if ended is None and active is not None and active > band:
        return [
            SILENT_REPLICA.found(
                f"no step log from {named} while DCGM shows its GPUs {active:.1%} busy (idle band "
                f"±{band:.0%}): its segments are missing, and billing the hour would charge "
                "its work as idle"
            )
        ]
    after = samples.filter(pl.col("timestamp_ns") > (ended or 0) + TAIL_GRACE_NS)
    if not after.height:
        return []
    tail_active = float(after["value"].mean())  # type: ignore[arg-type]
    if tail_active > band:
        first, last = int(after["timestamp_ns"].min()), int(after["timestamp_ns"].max())  # type: ignore[arg-type]
        return [
            SILENT_TAIL.found(
                f"{named}: its last logged step ends at {utc_clock(ended or 0)} UTC, and DCGM "
                f"shows its GPUs {tail_active:.1%} busy in {after.height} samples from "
                f"{utc_clock(first)} to {utc_clock(last)} UTC (idle band ±{band:.0%}): the "
                "log's last segments are missing, and billing the hour would charge that work "
                "as idle"
            )
        ]
    return []
