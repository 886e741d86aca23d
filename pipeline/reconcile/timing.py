"""The time check: each replica's step time plus measured gaps against the wall-clock hour."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

import polars as pl

from pipeline.reconcile.facts import HourFacts
from pipeline.reconcile.findings import CLOCK_SKEW, EXCESS, SHORTFALL, Finding
from pipeline.reconcile.frames import seconds, steps_of_hour
from pipeline.reconcile.result import CheckResult, fold
from schemas.config import Pool, Settings
from schemas.units import HOUR_NS, hour_bounds_ns

# The (monotonic, wall) anchor pair of a segment is read from two clocks microseconds apart, so
# UTC placements of consecutive steps may overlap by that much; a millisecond means the wall
# clock stepped backwards.
OVERLAP_ALLOWANCE_NS = 1_000_000


def run(facts: HourFacts) -> list[CheckResult]:
    """The time check of the gathered pool-hour."""
    return check_time(facts.hour, facts.pool, facts.steps, facts.settings)


def check_time(
    hour: datetime, pool: Pool, steps: pl.DataFrame, settings: Settings
) -> list[CheckResult]:
    """Step durations plus measured gaps against the wall-clock hour, per replica.

    Gaps are measured on the engine's monotonic clock between consecutive sequence numbers;
    across a sequence break the time is unaccounted (records were lost). The stretch before
    the first and after the last step is idle wall-clock time. If UTC placement agrees with the
    monotonic clock, accounted time equals the hour, so a shortfall is lost records and the
    remainder is clock skew, which is also flagged on its own: steps overlapping in UTC or on
    the monotonic clock, or the UTC-monotonic offset moving by more than the tolerance.
    """
    tolerance_ns = int(settings.time_tolerance_fraction * HOUR_NS)
    gpus = pool.gpus_per_stream
    facts = {row["replica"]: row for row in _times(steps, hour, pool).iter_rows(named=True)}
    expected = f"{seconds(HOUR_NS * gpus)} GPU-time (3600 s x {gpus} GPUs) within {settings.time_tolerance_fraction:.2%}"
    results = []
    for replica in pool.streams:
        row = facts.get(replica.id)
        where = (hour, pool.name, replica.id)
        if row is None:
            passed_detail = "no steps logged: the replica was idle all hour (the plausibility check confirms with DCGM)"
            results.append(
                fold(
                    where,
                    "time",
                    expected,
                    "no steps",
                    [],
                    passed_detail=passed_detail,
                    weights=pool.policies.weights,
                )
            )
            continue
        accounted_ns = row["lead_ns"] + row["busy_ns"] + row["gaps_ns"] + row["trail_ns"]
        shortfall_ns = HOUR_NS - accounted_ns
        observed = (
            f"{seconds(accounted_ns * gpus)} GPU-time: busy {seconds(row['busy_ns'])}, gaps "
            f"{seconds(row['gaps_ns'])}, idle before/after {seconds(row['lead_ns'] + row['trail_ns'])}, "
            f"unaccounted {seconds(shortfall_ns)} per GPU"
        )
        results.append(
            fold(
                where,
                "time",
                expected,
                observed,
                _time_findings(row, shortfall_ns, tolerance_ns, gpus),
                passed_detail=f"{row['steps']} steps, busy {row['busy_ns'] / HOUR_NS:.2%} of the hour",
                weights=pool.policies.weights,
            )
        )
    return results


def _times(steps: pl.DataFrame, hour: datetime, pool: Pool) -> pl.DataFrame:
    """Per replica with steps in the hour: its busy time, gaps, sequence breaks, overlaps, the
    UTC-monotonic skew and the idle stretches before the first and after the last step."""
    start_ns, end_ns = hour_bounds_ns(hour)
    return (
        steps_of_hour(steps, hour, pool)
        .with_columns(
            (pl.col("seq") - pl.col("seq").shift(1).over("replica")).alias("seq_step"),
            (pl.col("start_ns") - pl.col("end_ns").shift(1).over("replica")).alias("gap_ns"),
            (pl.col("end_utc_ns").shift(1).over("replica") - pl.col("start_utc_ns")).alias(
                "utc_overlap_ns"
            ),
            (pl.col("start_utc_ns") - pl.col("start_ns")).alias("utc_offset_ns"),
        )
        .group_by("replica")
        .agg(
            pl.len().alias("steps"),
            (pl.col("end_ns") - pl.col("start_ns")).sum().alias("busy_ns"),
            pl.col("gap_ns").filter(pl.col("seq_step") == 1).sum().alias("gaps_ns"),
            pl.col("gap_ns").filter(pl.col("seq_step") > 1).sum().alias("break_ns"),
            (pl.col("seq_step") > 1).sum().alias("breaks"),
            (-pl.col("gap_ns"))
            .filter(pl.col("seq_step") == 1)
            .max()
            .fill_null(0)
            .alias("mono_overlap_ns"),
            # A repeated seq overlaps itself; the sequence check reports that, it is not skew.
            pl.col("utc_overlap_ns")
            .filter(pl.col("seq_step") > 0)
            .max()
            .fill_null(0)
            .alias("utc_overlap_ns"),
            (pl.col("utc_offset_ns").max() - pl.col("utc_offset_ns").min()).alias(
                "offset_spread_ns"
            ),
            (
                (pl.col("end_utc_ns").last() - pl.col("start_utc_ns").first())
                - (pl.col("end_ns").last() - pl.col("start_ns").first())
            ).alias("skew_ns"),
            (pl.col("start_utc_ns").first() - start_ns).alias("lead_ns"),
            (end_ns - pl.col("end_utc_ns").last()).alias("trail_ns"),
        )
    )


def _skew_signs(row: Mapping[str, Any], tolerance_ns: int) -> list[str]:
    """The signs of clock skew in a replica's times, each said in words."""
    signs = []
    if abs(row["skew_ns"]) > tolerance_ns:
        signs.append(f"UTC span differs from the monotonic span by {seconds(row['skew_ns'])}")
    if row["offset_spread_ns"] > tolerance_ns:
        signs.append(
            f"UTC-monotonic offset moved by {seconds(row['offset_spread_ns'])} within the hour"
        )
    if row["utc_overlap_ns"] > OVERLAP_ALLOWANCE_NS:
        signs.append(f"consecutive steps overlap in UTC by up to {seconds(row['utc_overlap_ns'])}")
    if row["mono_overlap_ns"] > OVERLAP_ALLOWANCE_NS:
        signs.append(
            f"consecutive steps overlap on the monotonic clock by up to {seconds(row['mono_overlap_ns'])}"
        )
    return signs


def _time_findings(
    row: Mapping[str, Any], shortfall_ns: int, tolerance_ns: int, gpus: int
) -> list[Finding]:
    skew_signs = _skew_signs(row, tolerance_ns)
    findings = []
    # A shortfall that skew alone explains is reported as skew, not as lost records.
    if shortfall_ns > tolerance_ns and (row["break_ns"] > 0 or not skew_signs):
        cause = (
            f"; {row['breaks']} sequence break(s) span {seconds(row['break_ns'])}: step records are missing "
            "(the sequence check says which and why)"
            if row["break_ns"] > 0
            else "; no sequence break explains it"
        )
        findings.append(
            SHORTFALL.found(
                f"{seconds(shortfall_ns * gpus)} GPU-time ({shortfall_ns / HOUR_NS:.2%} of the hour) "
                f"unaccounted{cause}"
            )
        )
    elif shortfall_ns < -tolerance_ns and not skew_signs:
        findings.append(
            EXCESS.found(
                f"step time and gaps exceed the wall-clock hour by {seconds(-shortfall_ns)} "
                f"({-shortfall_ns / HOUR_NS:.2%}): duplicated records or clock skew"
            )
        )
    if skew_signs:
        findings.append(
            CLOCK_SKEW.found(
                "wall-clock placement disagrees with monotonic durations (clock skew): "
                + "; ".join(skew_signs)
            )
        )
    return findings
