"""The clock check: wall-clock jumps in the segments of each replica's hour."""

from __future__ import annotations

from datetime import datetime

import polars as pl

from pipeline.reconcile.facts import HourFacts
from pipeline.reconcile.findings import CLOCK_JUMP
from pipeline.reconcile.result import CheckResult, fold
from schemas.config import Pool
from schemas.units import NS_PER_SECOND, hour_bounds_ns


def run(facts: HourFacts) -> list[CheckResult]:
    """The clock check of the gathered pool-hour."""
    return check_clock(facts.hour, facts.pool, facts.clock_jumps)


def check_clock(hour: datetime, pool: Pool, clock_jumps: pl.DataFrame) -> list[CheckResult]:
    """Per replica, the wall-clock jumps (`clock_jumps` rows, as `pipeline.ingestion.ingest` records
    them) of segments whose first step was placed in the hour. The steps were placed by the
    monotonic clock, so the money is exact; the finding says the host's clock needs fixing."""
    start_ns, end_ns = hour_bounds_ns(hour)
    in_hour = clock_jumps.filter(
        pl.col("first_start_utc_ns").is_between(start_ns, end_ns, closed="left")
    )
    results = []
    for replica in pool.streams:
        mine = in_hour.filter(pl.col("replica") == replica.id).sort("first_seq")
        findings = [
            CLOCK_JUMP.found(
                f"{path}: the wall clock stepped {jump_ns / NS_PER_SECOND:+.3f} s against the "
                f"monotonic clock since segment {previous}; its steps from seq {first_seq} are "
                "placed by the monotonic clock (fix the host's time source)"
            )
            for path, first_seq, previous, jump_ns in mine.select(
                "path", "first_seq", "previous_segment_id", "jump_ns"
            ).iter_rows()
        ]
        results.append(
            fold(
                (hour, pool.name, replica.id),
                "clock",
                "segment wall-clock anchors agree with the monotonic clock",
                f"{mine.height} wall-clock jump(s)",
                findings,
                passed_detail="no wall-clock jump",
                weights=pool.policies.weights,
            )
        )
    return results
