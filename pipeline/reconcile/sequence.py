"""The sequence check: gaps, repeats and damage in each replica's step sequence for the hour."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import PurePath

import numpy as np
import polars as pl

from pipeline.reconcile.facts import HourFacts
from pipeline.reconcile.findings import (
    DAMAGE,
    DROPPED,
    DUPLICATE_SEGMENT,
    GAP,
    REPEATED,
    UNPLACED_DAMAGE,
    Finding,
)
from pipeline.reconcile.frames import steps_of_hour
from pipeline.reconcile.ranges import (
    RANGES_LISTED,
    SeqRange,
    compact_ranges,
    count,
    intersect,
    merge,
    runs,
    subtract,
)
from pipeline.reconcile.result import CheckResult, failed, fold
from schemas.config import Pool


def run(facts: HourFacts) -> list[CheckResult]:
    """The sequence check of the gathered pool-hour."""
    return check_sequence(
        facts.hour,
        facts.pool,
        facts.steps,
        facts.drops,
        facts.damage,
        facts.segments,
        last_seq_before=facts.last_seq_before,
    )


def check_sequence(
    hour: datetime,
    pool: Pool,
    steps: pl.DataFrame,
    drops: pl.DataFrame,
    damage: pl.DataFrame,
    segments: pl.DataFrame,
    *,
    last_seq_before: Mapping[str, int] | None = None,
) -> list[CheckResult]:
    """Gaps, repeats and damage in each replica's step sequence for the hour.

    `steps` (STEPS): the pool's decoded steps; those starting in the hour are checked.
    `drops` (DROPS): counted drops; a gap they cover is still a failure, reported as the
    recorder dropping steps. `damage` (DAMAGE) from decoding the pool's segments: attributed to
    a replica through `segments` (SEGMENTS, by path) or the outbox directory the file sits in
    (`.../<replica>/<file>.seg`); with a sequence range it counts for the hour whose sequence
    span it touches, without one it always counts. `last_seq_before`: each replica's last
    sequence number before the hour, so a gap at the hour's start is seen too.
    """
    in_hour = steps_of_hour(steps, hour, pool)
    damage = _damage_of_pool(damage, segments, pool)
    results = []
    for replica in pool.replicas:
        seqs = in_hour.filter(pl.col("replica") == replica.id)["seq"].to_numpy()
        results.append(
            _sequence_of_replica(
                (hour, pool, replica.id),
                seqs,
                (last_seq_before or {}).get(replica.id),
                drops.filter((pl.col("pool") == pool.name) & (pl.col("replica") == replica.id)),
                damage.filter(pl.col("replica") == replica.id),
            )
        )
    unplaced = damage.filter(~pl.col("replica").is_in([r.id for r in pool.replicas]))
    if unplaced.height:
        listed = ", ".join(
            f"{row['kind']} in {row['path']}"
            for row in unplaced.head(RANGES_LISTED).iter_rows(named=True)
        )
        finding = UNPLACED_DAMAGE.found(
            f"damage in files not attributable to a replica of pool {pool.name}: {listed}"
        )
        results.append(
            failed(
                (hour, pool.name, None),
                "every damaged file belongs to a replica of the pool",
                f"{unplaced.height} damaged files without a replica",
                [finding],
            )
        )
    return results


def _damage_of_pool(damage: pl.DataFrame, segments: pl.DataFrame, pool: Pool) -> pl.DataFrame:
    """The pool's damage rows with the pool and replica of the file each was found in."""
    owner_of_path = {
        path: (pool_name, replica)
        for path, pool_name, replica in segments.select("path", "pool", "replica").iter_rows()
    }
    owners = [
        owner_of_path.get(path, (pool.name, PurePath(path).parent.name))
        for path in damage["path"].to_list()
    ]
    return damage.with_columns(
        pl.Series("pool", [owner[0] for owner in owners], dtype=pl.String),
        pl.Series("replica", [owner[1] for owner in owners], dtype=pl.String),
    ).filter(pl.col("pool") == pool.name)


@dataclass(frozen=True)
class _Sequence:
    """A replica's sequence numbers of the hour: the span they should fill (None without
    steps), the ranges missing from it and the numbers logged more than once."""

    span: SeqRange | None
    missing: list[SeqRange]
    repeated: list[SeqRange]


def _sequence(seqs: np.ndarray, last_seq_before: int | None) -> _Sequence:
    ordered = np.sort(seqs)
    if last_seq_before is not None:
        ordered = np.concatenate(([last_seq_before], ordered))
    if ordered.size == 0:
        span: SeqRange | None = None
    else:
        span = (int(ordered[0]) + (last_seq_before is not None), int(ordered[-1]))
    steps_between = np.diff(ordered)
    gap_at = np.flatnonzero(steps_between > 1)
    missing = [(int(ordered[i]) + 1, int(ordered[i + 1]) - 1) for i in gap_at]
    repeated = runs(np.unique(ordered[1:][steps_between == 0]))
    return _Sequence(span, missing, repeated)


def _touching(frame: pl.DataFrame, span: SeqRange | None) -> pl.DataFrame:
    """Rows of drops or damage that count for a span: those without a sequence range always,
    the others when their range touches the span."""
    if span is None:
        return frame.filter(pl.col("first_seq").is_null())
    return frame.filter(
        pl.col("first_seq").is_null()
        | ((pl.col("first_seq") <= span[1]) & (pl.col("last_seq") >= span[0]))
    )


def _damage_described(harmful: pl.DataFrame, lost_to_damage: list[SeqRange]) -> str:
    described = "; ".join(
        f"{row['kind']} in {row['path']} at byte {row['byte_offset']}"
        + (f" (seq {row['first_seq']}-{row['last_seq']})" if row["first_seq"] is not None else "")
        + (f": {row['detail']}" if row["detail"] else "")
        for row in harmful.head(RANGES_LISTED).iter_rows(named=True)
    )
    if harmful.height > RANGES_LISTED:
        described += f"; and {harmful.height - RANGES_LISTED} more"
    lost = (
        f"; {count(lost_to_damage)} steps lost (seq {compact_ranges(lost_to_damage)})"
        if lost_to_damage
        else ""
    )
    return f"{harmful.height} damaged frames: {described}{lost}"


def _sequence_of_replica(
    where: tuple[datetime, Pool, str],
    seqs: np.ndarray,
    last_seq_before: int | None,
    drops: pl.DataFrame,
    damage: pl.DataFrame,
) -> CheckResult:
    hour, pool, replica = where
    sequence = _sequence(seqs, last_seq_before)
    span, missing, repeated = sequence.span, sequence.missing, sequence.repeated
    drop_ranges = merge(_touching(drops, span).select("first_seq", "last_seq").iter_rows())
    dropped = intersect(missing, drop_ranges)
    unexplained = subtract(missing, drop_ranges)
    damage = _touching(damage, span)
    # Recovered damage: every sequence number it could hide is held by another file.
    harmful = damage.filter(~pl.col("kind").is_in(["duplicate_segment", "recovered"]))
    duplicates = damage.filter(pl.col("kind") == "duplicate_segment")
    damage_ranges = merge(
        harmful.filter(pl.col("first_seq").is_not_null())
        .select("first_seq", "last_seq")
        .iter_rows()
    )
    lost_to_damage = intersect(unexplained, damage_ranges)
    unexplained = subtract(unexplained, damage_ranges)

    findings: list[Finding] = []
    if unexplained:
        findings.append(
            GAP.found(
                f"missing seq {compact_ranges(unexplained)} ({count(unexplained)} steps) with no counted drop "
                "or damage to explain them"
            )
        )
    if dropped:
        findings.append(
            DROPPED.found(
                f"recorder dropped {count(dropped)} steps (seq {compact_ranges(dropped)}): its buffer overflowed"
            )
        )
    if harmful.height:
        findings.append(DAMAGE.found(_damage_described(harmful, lost_to_damage)))
    if repeated:
        findings.append(
            REPEATED.found(
                f"seq {compact_ranges(repeated)} logged more than once ({count(repeated)} sequence numbers): "
                "steps would be charged twice"
            )
        )
    if duplicates.height:
        paths = ", ".join(duplicates["path"].head(RANGES_LISTED).to_list())
        findings.append(
            DUPLICATE_SEGMENT.found(
                f"{duplicates.height} segments delivered twice, the copies were ignored: {paths}"
            )
        )
    expected = (
        "no steps"
        if span is None
        else f"seq {span[0]}-{span[1]} contiguous ({span[1] - span[0] + 1} steps)"
    )
    observed = (
        f"{seqs.size} steps logged, {count(missing)} missing ({count(dropped)} counted drops), "
        f"{count(repeated)} repeated, {harmful.height} damaged frames"
    )
    return fold(
        (hour, pool.name, replica),
        "sequence",
        expected,
        observed,
        findings,
        passed_detail="no steps logged in the hour" if span is None else "sequence contiguous",
        weights=pool.policies.weights,
    )
