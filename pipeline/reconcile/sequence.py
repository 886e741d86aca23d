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
    DIVERGENT_COPY,
    DROPPED,
    DUPLICATE_SEGMENT,
    GAP,
    HARMLESS_DAMAGE,
    LOST_TAIL,
    MISSING_HEAD,
    REPEATED,
    UNPLACED_DAMAGE,
    Finding,
)
from pipeline.reconcile.frames import steps_of_hour, utc_clock
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
from schemas.units import hour_bounds_ns


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
    sequence number before the hour, so a gap at the hour's start is seen too; without it the
    hour continues the replica's latest segment before it, or the start of its log (seq 0).
    Damage holds the hour only where the log misses the sequence numbers it could hide.
    """
    in_hour = steps_of_hour(steps, hour, pool)
    damage = _damage_of_pool(damage, segments, pool)
    results = []
    for replica in pool.streams:
        logged = in_hour.filter(pl.col("replica") == replica.id)
        own_segments = segments.filter(pl.col("replica") == replica.id)
        prior = _prior_seq(
            logged["seq"].to_numpy(), (last_seq_before or {}).get(replica.id), own_segments
        )
        results.append(
            _sequence_of_replica(
                (hour, pool, replica.id),
                logged,
                prior,
                drops.filter((pl.col("pool") == pool.name) & (pl.col("replica") == replica.id)),
                _bounded_by_later_segments(
                    damage.filter(pl.col("replica") == replica.id), own_segments
                ),
            )
        )
    unplaced = damage.filter(~pl.col("replica").is_in([r.id for r in pool.streams]))
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


def _prior_seq(seqs: np.ndarray, last_seq_before: int | None, segments: pl.DataFrame) -> int:
    """The sequence number the replica's hour continues: the previous hour's last, else the last
    of its latest segment ending before the hour's first step, else -1 (a log starts at 0)."""
    if last_seq_before is not None:
        return last_seq_before
    if seqs.size == 0:
        return -1
    earlier = segments.filter(pl.col("last_seq") < int(seqs.min()))["last_seq"].max()
    return -1 if earlier is None else int(earlier)  # type: ignore[arg-type]


def _bounded_by_later_segments(damage: pl.DataFrame, segments: pl.DataFrame) -> pl.DataFrame:
    """Damage with a first sequence number and no last (a torn tail decoded before the
    replica's next segment arrived) ends where the replica's next segment, as ingested since,
    starts; with no later segment it stays open: the log's tail is unknown."""
    open_ended = damage["first_seq"].is_not_null() & damage["last_seq"].is_null()
    if not open_ended.any():
        return damage
    starts = segments.select("path", "first_seq").drop_nulls().rows()
    bounds = [
        min((start - 1 for path, start in starts if start >= first and path != own), default=None)
        if is_open
        else last
        for own, first, last, is_open in zip(
            damage["path"], damage["first_seq"], damage["last_seq"], open_ended, strict=True
        )
    ]
    return damage.with_columns(pl.Series("last_seq", bounds, dtype=pl.Int64))


@dataclass(frozen=True)
class _Sequence:
    """A replica's sequence numbers of the hour: the span they should fill (None without
    steps), the ranges missing from it (the head, before the hour's first step, apart) and the
    numbers logged more than once."""

    span: SeqRange | None
    head: list[SeqRange]
    missing: list[SeqRange]
    repeated: list[SeqRange]


def _sequence(seqs: np.ndarray, prior: int) -> _Sequence:
    if seqs.size == 0:
        return _Sequence(None, [], [], [])
    ordered = np.concatenate(([prior], np.sort(seqs)))
    span = (prior + 1, int(ordered[-1]))
    steps_between = np.diff(ordered)
    gap_at = np.flatnonzero(steps_between > 1)
    missing = [(int(ordered[i]) + 1, int(ordered[i + 1]) - 1) for i in gap_at]
    head = missing[:1] if missing and missing[0][0] == span[0] else []
    repeated = runs(np.unique(ordered[1:][steps_between == 0]))
    return _Sequence(span, head, missing, repeated)


def _touching(frame: pl.DataFrame, span: SeqRange | None) -> pl.DataFrame:
    """Rows of drops or damage that count for a span: those without a sequence range always,
    open-ended ones when they start in it or right after it, the others when their range
    touches the span."""
    if span is None:
        return frame.filter(pl.col("first_seq").is_null())
    first, last = pl.col("first_seq"), pl.col("last_seq")
    return frame.filter(
        first.is_null()
        | (last.is_null() & first.is_between(span[0], span[1] + 1))
        | ((first <= span[1]) & (last >= span[0]))
    )


def _when(ranges: list[SeqRange], logged: pl.DataFrame, hour: datetime) -> str:
    """The UTC time each missing range took: from the logged step before it (or the hour's
    start) to the logged step after it (or the hour's end)."""
    start_ns, end_ns = hour_bounds_ns(hour)
    seqs = logged["seq"].to_numpy()
    starts, ends = logged["start_utc_ns"].to_numpy(), logged["end_utc_ns"].to_numpy()
    spans = []
    for first, _ in ranges[:RANGES_LISTED]:
        after = int(np.searchsorted(seqs, first))
        since = int(ends[after - 1]) if after > 0 else start_ns
        until = int(starts[after]) if after < seqs.size else end_ns
        spans.append(f"{utc_clock(since)}-{utc_clock(until)}")
    more = f" and {len(ranges) - RANGES_LISTED} more" if len(ranges) > RANGES_LISTED else ""
    return f"UTC {', '.join(spans)}{more}"


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


@dataclass(frozen=True)
class _Damages:
    """The replica's damage rows of the hour by what they mean for the log."""

    hiding: pl.DataFrame  # hides missing sequence numbers, or cannot say which it hides
    open_tail: pl.DataFrame  # the log ends in a torn frame: what follows is unknown
    harmless: pl.DataFrame  # every sequence number it could hide is in the log
    duplicates: pl.DataFrame  # identical copies of a segment, kept once
    divergent: pl.DataFrame  # copies of a segment id with other content


def _sort_damage(damage: pl.DataFrame, unexplained: list[SeqRange]) -> _Damages:
    kind, first, last = pl.col("kind"), pl.col("first_seq"), pl.col("last_seq")
    copies = ["duplicate_segment", "divergent_copy", "recovered"]
    # Recovered damage: every sequence number it could hide is held by another file.
    harmful = damage.filter(~kind.is_in(copies))
    empty_file = (kind == "torn_tail") & (pl.col("byte_length") == 0)
    # Open-ended: nothing after it. A frame cut short by the file's end is a lost step; bytes
    # that are no frame at all after the last intact one are no step (a step lost with them
    # would leave DCGM busy after the log's end, which the silence check sees).
    open_ended = first.is_not_null() & last.is_null()
    hides = [
        bool(intersect(unexplained, [(row_first, row_last)]))
        for row_first, row_last in harmful.select("first_seq", "last_seq").iter_rows()
        if row_first is not None and row_last is not None
    ]
    ranged = harmful.filter(first.is_not_null() & last.is_not_null())
    hides_series = pl.Series(hides, dtype=pl.Boolean)
    return _Damages(
        hiding=pl.concat(
            [harmful.filter(first.is_null() & ~empty_file), ranged.filter(hides_series)]
        ),
        open_tail=harmful.filter(open_ended & (kind == "torn_tail")),
        harmless=pl.concat(
            [
                harmful.filter(first.is_null() & empty_file),
                ranged.filter(~hides_series),
                harmful.filter(open_ended & (kind != "torn_tail")),
            ]
        ),
        duplicates=damage.filter(kind == "duplicate_segment"),
        divergent=damage.filter(kind == "divergent_copy"),
    )


def _damage_findings(
    damages: _Damages, lost_to_damage: list[SeqRange], logged: pl.DataFrame
) -> list[Finding]:
    findings = []
    if damages.hiding.height:
        findings.append(DAMAGE.found(_damage_described(damages.hiding, lost_to_damage)))
    if damages.open_tail.height:
        unknown_from = int(damages.open_tail["first_seq"].min())  # type: ignore[arg-type]
        last_end = int(logged["end_utc_ns"].max())  # type: ignore[arg-type]
        findings.append(
            LOST_TAIL.found(
                _damage_described(damages.open_tail, [])
                + f"; no later segment: the steps from seq {unknown_from} on are unknown, "
                f"after the last logged step ends at {utc_clock(last_end)} UTC"
            )
        )
    if damages.duplicates.height:
        paths = ", ".join(damages.duplicates["path"].head(RANGES_LISTED).to_list())
        findings.append(
            DUPLICATE_SEGMENT.found(
                f"{damages.duplicates.height} segments delivered twice, the copies were ignored: "
                f"{paths}"
            )
        )
    if damages.divergent.height:
        findings.append(
            DIVERGENT_COPY.found(
                "; ".join(
                    f"{row['path']}: {row['detail']}"
                    for row in damages.divergent.head(RANGES_LISTED).iter_rows(named=True)
                )
            )
        )
    if damages.harmless.height:
        findings.append(
            HARMLESS_DAMAGE.found(
                "hides no missing sequence number: " + _damage_described(damages.harmless, [])
            )
        )
    return findings


def _sequence_of_replica(
    where: tuple[datetime, Pool, str],
    logged: pl.DataFrame,
    prior: int,
    drops: pl.DataFrame,
    damage: pl.DataFrame,
) -> CheckResult:
    hour, pool, replica = where
    seqs = logged["seq"].to_numpy()
    sequence = _sequence(seqs, prior)
    span, missing, repeated = sequence.span, sequence.missing, sequence.repeated
    drop_ranges = merge(_touching(drops, span).select("first_seq", "last_seq").iter_rows())
    dropped = intersect(missing, drop_ranges)
    unexplained = subtract(missing, drop_ranges)
    damages = _sort_damage(_touching(damage, span), unexplained)
    damage_ranges = merge(
        damages.hiding.filter(pl.col("first_seq").is_not_null())
        .select("first_seq", "last_seq")
        .iter_rows()
    )
    lost_to_damage = intersect(unexplained, damage_ranges)
    unexplained = subtract(unexplained, damage_ranges)
    head = intersect(unexplained, sequence.head)
    middle = subtract(unexplained, sequence.head)

    findings: list[Finding] = []
    if head:
        findings.append(
            MISSING_HEAD.found(
                f"missing seq {compact_ranges(head)} ({count(head)} steps) before the hour's "
                f"first logged step, {_when(head, logged, hour)}: no segment holds them "
                f"(the log continues seq {prior})"
            )
        )
    if middle:
        findings.append(
            GAP.found(
                f"missing seq {compact_ranges(middle)} ({count(middle)} steps) with no counted drop "
                f"or damage to explain them, {_when(middle, logged, hour)}"
            )
        )
    if dropped:
        findings.append(
            DROPPED.found(
                f"recorder dropped {count(dropped)} steps (seq {compact_ranges(dropped)}): its buffer overflowed"
            )
        )
    if repeated:
        findings.append(
            REPEATED.found(
                f"seq {compact_ranges(repeated)} logged more than once ({count(repeated)} sequence numbers): "
                "steps would be charged twice"
            )
        )
    findings += _damage_findings(damages, lost_to_damage, logged)
    expected = (
        "no steps"
        if span is None
        else f"seq {span[0]}-{span[1]} contiguous ({span[1] - span[0] + 1} steps)"
    )
    observed = (
        f"{seqs.size} steps logged, {count(missing)} missing ({count(dropped)} counted drops), "
        f"{count(repeated)} repeated, {damages.hiding.height + damages.open_tail.height} damaged "
        "frames"
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
