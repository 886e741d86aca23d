"""The conservation check: every step up to the hour is billed in some hour."""

from __future__ import annotations

from datetime import datetime

import polars as pl

from pipeline.reconcile.facts import HourFacts
from pipeline.reconcile.findings import UNBILLED_STEPS
from pipeline.reconcile.frames import steps_of_hour
from pipeline.reconcile.ranges import compact_ranges, runs
from pipeline.reconcile.result import CheckResult, fold
from schemas.config import Pool
from schemas.units import hour_key


def run(facts: HourFacts) -> list[CheckResult]:
    """The conservation check of the gathered pool-hour."""
    return check_conservation(facts.hour, facts.pool, facts.steps, facts.elsewhere)


def check_conservation(
    hour: datetime, pool: Pool, steps: pl.DataFrame, elsewhere: pl.DataFrame
) -> list[CheckResult]:
    """Per replica: every ingested step up to the hour is billed, in a published hour or in
    one held back. `steps` (STEPS): the pool's steps, those starting in the hour are this
    hour's; `elsewhere`: `replica`, `seq` and `hour` (key) of the pool's steps in hours not
    attributed yet (`pipeline.storage.lake.steps_of_other_hours`). A step placed in an earlier hour, or
    in a later hour though its sequence number comes before the hour's last, belongs to an hour
    that will not be attributed after this one: no one pays for it while the hour, which must
    have been busy around it, publishes as if it were not (ERROR, blocking)."""
    in_hour = steps_of_hour(steps, hour, pool)
    key = hour_key(hour)
    results = []
    for replica in pool.streams:
        seqs = in_hour.filter(pl.col("replica") == replica.id)["seq"]
        last = seqs.max()
        mine = elsewhere.filter(pl.col("replica") == replica.id)
        unbilled = mine.filter(
            (pl.col("hour") < key) | (pl.col("seq") <= last if last is not None else False)
        ).sort("seq")
        findings = []
        if unbilled.height:
            by_hour = ", ".join(
                f"{hour_of} ({count} steps)"
                for hour_of, count in unbilled.group_by("hour").len().sort("hour").iter_rows()
            )
            ranges = compact_ranges(runs(unbilled["seq"].unique().sort().to_numpy()))
            findings.append(
                UNBILLED_STEPS.found(
                    f"{unbilled.height} steps of replica {replica.id} (seq {ranges}) lie in hours "
                    f"never attributed, neither published nor held back: {by_hour}; they are "
                    f"billed to nobody while hour {key} is published without them (attribute "
                    "those hours with stepledger run --hour, or fix the replica's clock and "
                    "re-ingest)"
                )
            )
        observed = (
            f"{seqs.len()} steps in the hour; {unbilled.height} steps up to it in hours not "
            "attributed"
        )
        results.append(
            fold(
                (hour, pool.name, replica.id),
                "conservation",
                "every step up to the hour's last in a published or held-back hour",
                observed,
                findings,
                passed_detail=f"{seqs.len()} steps in the hour, none billed to nobody",
                weights=pool.policies.weights,
            )
        )
    return results
