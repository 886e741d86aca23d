"""Hourly reconciliation: is an hour's bill trustworthy enough to publish?

One pure function per check, over polars frames with the pipeline's table schemas
(`schemas.tables` STEPS, DROPS, DAMAGE, SEGMENTS; the warehouse's `invoices` and
`ledger_lines`), for one pool and one UTC hour. Each returns `CheckResult`s that map one to one
onto rows of the `reconciliation` table; the failed ones also become `alerts` rows
(`pipeline.reconcile.alerts.record_alerts`). `reconcile_hour` runs them all on one pool-hour.

Severity (what pages, what holds an hour back from the finance views):

| check             | scope   | failure                                   | severity | blocking |
|-------------------|---------|-------------------------------------------|----------|----------|
| sequence          | replica | missing, dropped, repeated or damaged seq | ERROR    | yes      |
| sequence          | replica | only a duplicate delivery, already ignored| WARN     | no       |
| time              | replica | shortfall/excess, clock skew              | ERROR    | yes      |
| money             | pool    | ledger != invoice, non-integer money      | ERROR    | yes      |
| plausibility      | replica | engine busier than DCGM (host stall)      | ERROR    | no       |
| plausibility      | replica | DCGM busier than the engine               | WARN     | no       |
| plausibility      | replica | no DCGM samples for a GPU                 | WARN     | no       |
| unattributed      | pool    | share above the pool's threshold          | ERROR    | no       |
| calibration       | replica | no coefficients (fitted weights)          | ERROR    | no       |
| calibration       | replica | engine version unmeasured (kernel weights)| WARN     | no       |
| calibration_drift | pool    | fresh fit drifted (fitted weights only)   | ERROR    | no       |
| clock             | replica | wall clock jumped (steps placed by mono)  | WARN     | no       |
| silence           | replica | no step log while DCGM shows GPUs busy    | ERROR    | yes      |
| conservation      | replica | steps up to the hour in hours never billed| ERROR    | yes      |
| deadman           | pool    | hours not reconciled in time (alerts.py)  | ERROR    | no       |

Sequence, time, money, silence and conservation decide whether the numbers are complete and exact, so a
failure holds the hour back. The others say the numbers may be unfair (host stalls charged to
customers, unattributed usage, stale coefficients) or that a cross-check is unavailable: the
hour is still published, and the ERROR ones page. A duplicated segment is reported but does not
block: the decoder kept one copy, so nothing is lost or counted twice.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePath
from typing import Literal

import duckdb
import numpy as np
import polars as pl

from pipeline.attribution.calibration import CalibrationError, CalibrationStore, fit_coefficients
from pipeline.attribution.ledger import LINE_KINDS
from pipeline.hours import (
    HOUR_NS,
    from_warehouse,
    hour_bounds_ns,
    hour_key,
    to_warehouse,
    utc_hour,
)
from pipeline.ingestion.dcgm import read_dcgm_hour
from pipeline.ingestion.ingest import committed_batches
from pipeline.storage.lake import HourInput, last_seq_before, load_hour, steps_of_other_hours
from pipeline.storage.warehouse import query_frame, record_checks
from pricing import load_chip
from schemas.config import Pool, Settings

Severity = Literal["ERROR", "WARN"]
SeqRange = tuple[int, int]  # inclusive first, last
# (model, gpu_type, engine_version, driver_version): what a calibration fit is valid for.
CalibrationKey = tuple[str, str, str, str]

NS_PER_S = 1_000_000_000
# The (monotonic, wall) anchor pair of a segment is read from two clocks microseconds apart, so
# UTC placements of consecutive steps may overlap by that much; a millisecond means the wall
# clock stepped backwards.
OVERLAP_ALLOWANCE_NS = 1_000_000
# Line kinds that charge work done for requests (the denominator of the unattributed share).
WORK_LINE_KINDS = ("usage", "unattributed", "platform_retry")
# Ranges listed in a detail before the rest is summarised as a count.
RANGES_LISTED = 20


@dataclass(frozen=True)
class CheckResult:
    """One row of the `reconciliation` table; a failed one is also an alert.

    `finding` is a short stable code of what failed ("gap", "host_stall", ...; "" when
    passed). With the check name, hour, pool and replica it identifies the alert, so a re-run
    whose numbers moved slightly does not page again.
    """

    hour: datetime
    pool: str
    replica: str | None
    check_name: str
    passed: bool
    expected: str
    observed: str
    detail: str
    severity: Severity
    blocking: bool
    finding: str = ""

    def __post_init__(self) -> None:
        hour_bounds_ns(
            self.hour
        )  # refuses naive or non-:00 hours, which would land in the wrong row


@dataclass(frozen=True)
class _Finding:
    code: str
    severity: Severity
    blocking: bool
    text: str


def _result(
    hour: datetime,
    pool: str,
    replica: str | None,
    check_name: str,
    expected: str,
    observed: str,
    findings: Sequence[_Finding],
    *,
    passed_detail: str,
    severity: Severity,
    blocking: bool,
) -> CheckResult:
    """Fold a check's findings into one result: the worst severity, all texts in the detail."""
    if not findings:
        return CheckResult(
            hour,
            pool,
            replica,
            check_name,
            True,
            expected,
            observed,
            passed_detail,
            severity,
            blocking,
        )
    worst: Severity = "ERROR" if any(f.severity == "ERROR" for f in findings) else "WARN"
    return CheckResult(
        hour,
        pool,
        replica,
        check_name,
        False,
        expected,
        observed,
        "; ".join(f.text for f in findings),
        worst,
        any(f.blocking for f in findings),
        "+".join(f.code for f in findings),
    )


# --- sequence ranges ----------------------------------------------------------------------


def compact_ranges(ranges: Sequence[SeqRange], limit: int = RANGES_LISTED) -> str:
    """ "1200-1299, 4000-4010, 5123"; beyond `limit` ranges the rest is counted, not listed."""
    shown = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges[:limit])
    if len(ranges) > limit:
        shown += f" and {len(ranges) - limit} more ranges"
    return shown


def _count(ranges: Iterable[SeqRange]) -> int:
    return sum(b - a + 1 for a, b in ranges)


def _merge(ranges: Iterable[SeqRange]) -> list[SeqRange]:
    merged: list[SeqRange] = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _intersect(left: Sequence[SeqRange], right: Sequence[SeqRange]) -> list[SeqRange]:
    """Intersection of two sorted, merged range lists (two pointers: O(len(left) + len(right)))."""
    out: list[SeqRange] = []
    i = j = 0
    while i < len(left) and j < len(right):
        a, b = max(left[i][0], right[j][0]), min(left[i][1], right[j][1])
        if a <= b:
            out.append((a, b))
        if left[i][1] < right[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(left: Sequence[SeqRange], right: Sequence[SeqRange]) -> list[SeqRange]:
    """`left` minus `right`, both sorted and merged."""
    out: list[SeqRange] = []
    j = 0
    for a, b in left:
        while j < len(right) and right[j][1] < a:
            j += 1
        k, start = j, a
        while k < len(right) and right[k][0] <= b:
            if right[k][0] > start:
                out.append((start, right[k][0] - 1))
            start = max(start, right[k][1] + 1)
            k += 1
        if start <= b:
            out.append((start, b))
    return out


def _runs(values: np.ndarray) -> list[SeqRange]:
    """Sorted distinct integers as maximal consecutive runs."""
    if values.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(values) != 1)
    starts = np.concatenate(([0], breaks + 1))
    ends = np.concatenate((breaks, [values.size - 1]))
    return [(int(values[s]), int(values[e])) for s, e in zip(starts, ends, strict=True)]


# --- inputs -------------------------------------------------------------------------------


def _steps_of_hour(steps: pl.DataFrame, hour: datetime, pool: Pool) -> pl.DataFrame:
    """The pool's steps placed in the hour by their UTC start, ordered by replica and seq."""
    start_ns, end_ns = hour_bounds_ns(hour)
    in_hour = steps.filter(
        (pl.col("pool") == pool.name)
        & pl.col("start_utc_ns").is_between(start_ns, end_ns, closed="left")
    )
    # The lake delivers them in that order: checking it costs a fifth of sorting.
    replica, seq = pl.col("replica"), pl.col("seq")
    ordered = in_hour.select(
        ((replica > replica.shift(1)) | ((replica == replica.shift(1)) & (seq > seq.shift(1))))
        .fill_null(True)
        .all()
    ).item()
    return in_hour if ordered else in_hour.sort("replica", "seq")


def _rows_of_hour(frame: pl.DataFrame, hour: datetime, pool: str, table: str) -> pl.DataFrame:
    """A warehouse table's rows for one hour and pool; `hour` may be naive UTC or zoned."""
    for column in ("hour", "pool"):
        if column not in frame.columns:
            raise ValueError(f"{table}: no column {column!r} (columns: {frame.columns})")
    dtype = frame.schema["hour"]
    if not isinstance(dtype, pl.Datetime):
        raise ValueError(f"{table}.hour is {dtype}, expected a timestamp")
    moment = hour.astimezone(UTC)
    if dtype.time_zone is None:
        moment = moment.replace(tzinfo=None)
    return frame.filter((pl.col("hour") == moment) & (pl.col("pool") == pool))


def _seconds(ns: int) -> str:
    return f"{ns / NS_PER_S:.3f} s"


# --- sequence -----------------------------------------------------------------------------


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
    in_hour = _steps_of_hour(steps, hour, pool)
    owner_of_path = {
        path: (pool_name, replica)
        for path, pool_name, replica in segments.select("path", "pool", "replica").iter_rows()
    }
    owners = [
        owner_of_path.get(path, (pool.name, PurePath(path).parent.name))
        for path in damage["path"].to_list()
    ]
    damage = damage.with_columns(
        pl.Series("pool", [owner[0] for owner in owners], dtype=pl.String),
        pl.Series("replica", [owner[1] for owner in owners], dtype=pl.String),
    ).filter(pl.col("pool") == pool.name)
    results = []
    unplaced = damage.filter(~pl.col("replica").is_in([r.id for r in pool.replicas]))
    for replica in pool.replicas:
        seqs = in_hour.filter(pl.col("replica") == replica.id)["seq"].to_numpy()
        before = (last_seq_before or {}).get(replica.id)
        results.append(
            _sequence_of_replica(
                hour,
                pool.name,
                replica.id,
                seqs,
                before,
                drops.filter((pl.col("pool") == pool.name) & (pl.col("replica") == replica.id)),
                damage.filter(pl.col("replica") == replica.id),
            )
        )
    if unplaced.height:
        listed = ", ".join(
            f"{row['kind']} in {row['path']}"
            for row in unplaced.head(RANGES_LISTED).iter_rows(named=True)
        )
        results.append(
            CheckResult(
                hour,
                pool.name,
                None,
                "sequence",
                False,
                "every damaged file belongs to a replica of the pool",
                f"{unplaced.height} damaged files without a replica",
                f"damage in files not attributable to a replica of pool {pool.name}: {listed}",
                "ERROR",
                True,
                "unplaced_damage",
            )
        )
    return results


def _sequence_of_replica(
    hour: datetime,
    pool: str,
    replica: str,
    seqs: np.ndarray,
    last_seq_before: int | None,
    drops: pl.DataFrame,
    damage: pl.DataFrame,
) -> CheckResult:
    ordered = np.sort(seqs)
    if last_seq_before is not None:
        ordered = np.concatenate(([last_seq_before], ordered))
    steps_logged = seqs.size
    if ordered.size == 0:
        span: SeqRange | None = None
    else:
        span = (int(ordered[0]) + (last_seq_before is not None), int(ordered[-1]))
    steps_between = np.diff(ordered)
    gap_at = np.flatnonzero(steps_between > 1)
    missing = [(int(ordered[i]) + 1, int(ordered[i + 1]) - 1) for i in gap_at]
    repeated = _runs(np.unique(ordered[1:][steps_between == 0]))

    def touches_span(frame: pl.DataFrame) -> pl.DataFrame:
        if span is None:
            return frame.filter(pl.col("first_seq").is_null())
        return frame.filter(
            pl.col("first_seq").is_null()
            | ((pl.col("first_seq") <= span[1]) & (pl.col("last_seq") >= span[0]))
        )

    drop_ranges = _merge(touches_span(drops).select("first_seq", "last_seq").iter_rows())
    dropped = _intersect(missing, drop_ranges)
    unexplained = _subtract(missing, drop_ranges)
    damage = touches_span(damage)
    # Recovered damage: every sequence number it could hide is held by another file.
    harmful = damage.filter(~pl.col("kind").is_in(["duplicate_segment", "recovered"]))
    duplicates = damage.filter(pl.col("kind") == "duplicate_segment")
    damage_ranges = _merge(
        harmful.filter(pl.col("first_seq").is_not_null())
        .select("first_seq", "last_seq")
        .iter_rows()
    )
    lost_to_damage = _intersect(unexplained, damage_ranges)
    unexplained = _subtract(unexplained, damage_ranges)

    findings = []
    if unexplained:
        findings.append(
            _Finding(
                "gap",
                "ERROR",
                True,
                f"missing seq {compact_ranges(unexplained)} ({_count(unexplained)} steps) with no counted drop "
                "or damage to explain them",
            )
        )
    if dropped:
        findings.append(
            _Finding(
                "dropped",
                "ERROR",
                True,
                f"recorder dropped {_count(dropped)} steps (seq {compact_ranges(dropped)}): its buffer overflowed",
            )
        )
    if harmful.height:
        described = "; ".join(
            f"{row['kind']} in {row['path']} at byte {row['byte_offset']}"
            + (
                f" (seq {row['first_seq']}-{row['last_seq']})"
                if row["first_seq"] is not None
                else ""
            )
            + (f": {row['detail']}" if row["detail"] else "")
            for row in harmful.head(RANGES_LISTED).iter_rows(named=True)
        )
        if harmful.height > RANGES_LISTED:
            described += f"; and {harmful.height - RANGES_LISTED} more"
        lost = (
            f"; {_count(lost_to_damage)} steps lost (seq {compact_ranges(lost_to_damage)})"
            if lost_to_damage
            else ""
        )
        findings.append(
            _Finding("damage", "ERROR", True, f"{harmful.height} damaged frames: {described}{lost}")
        )
    if repeated:
        findings.append(
            _Finding(
                "repeated",
                "ERROR",
                True,
                f"seq {compact_ranges(repeated)} logged more than once ({_count(repeated)} sequence numbers): "
                "steps would be charged twice",
            )
        )
    if duplicates.height:
        paths = ", ".join(duplicates["path"].head(RANGES_LISTED).to_list())
        findings.append(
            _Finding(
                "duplicate_segment",
                "WARN",
                False,
                f"{duplicates.height} segments delivered twice, the copies were ignored: {paths}",
            )
        )
    expected = (
        "no steps"
        if span is None
        else f"seq {span[0]}-{span[1]} contiguous ({span[1] - span[0] + 1} steps)"
    )
    observed = (
        f"{steps_logged} steps logged, {_count(missing)} missing ({_count(dropped)} counted drops), "
        f"{_count(repeated)} repeated, {harmful.height} damaged frames"
    )
    return _result(
        hour,
        pool,
        replica,
        "sequence",
        expected,
        observed,
        findings,
        passed_detail="no steps logged in the hour" if span is None else "sequence contiguous",
        severity="ERROR",
        blocking=True,
    )


# --- time ---------------------------------------------------------------------------------


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
    start_ns, end_ns = hour_bounds_ns(hour)
    tolerance_ns = int(settings.time_tolerance_fraction * HOUR_NS)
    gpus = pool.gpus_per_replica
    per_replica = (
        _steps_of_hour(steps, hour, pool)
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
    facts = {row["replica"]: row for row in per_replica.iter_rows(named=True)}
    expected = f"{_seconds(HOUR_NS * gpus)} GPU-time (3600 s x {gpus} GPUs) within {settings.time_tolerance_fraction:.2%}"
    results = []
    for replica in pool.replicas:
        row = facts.get(replica.id)
        if row is None:
            results.append(
                CheckResult(
                    hour,
                    pool.name,
                    replica.id,
                    "time",
                    True,
                    expected,
                    "no steps",
                    "no steps logged: the replica was idle all hour (the plausibility check confirms with DCGM)",
                    "ERROR",
                    True,
                )
            )
            continue
        accounted_ns = row["lead_ns"] + row["busy_ns"] + row["gaps_ns"] + row["trail_ns"]
        shortfall_ns = HOUR_NS - accounted_ns
        skew_signs = []
        if abs(row["skew_ns"]) > tolerance_ns:
            skew_signs.append(
                f"UTC span differs from the monotonic span by {_seconds(row['skew_ns'])}"
            )
        if row["offset_spread_ns"] > tolerance_ns:
            skew_signs.append(
                f"UTC-monotonic offset moved by {_seconds(row['offset_spread_ns'])} within the hour"
            )
        if row["utc_overlap_ns"] > OVERLAP_ALLOWANCE_NS:
            skew_signs.append(
                f"consecutive steps overlap in UTC by up to {_seconds(row['utc_overlap_ns'])}"
            )
        if row["mono_overlap_ns"] > OVERLAP_ALLOWANCE_NS:
            skew_signs.append(
                f"consecutive steps overlap on the monotonic clock by up to {_seconds(row['mono_overlap_ns'])}"
            )
        findings = []
        # A shortfall that skew alone explains is reported as skew, not as lost records.
        if shortfall_ns > tolerance_ns and (row["break_ns"] > 0 or not skew_signs):
            cause = (
                f"; {row['breaks']} sequence break(s) span {_seconds(row['break_ns'])}: step records are missing "
                "(the sequence check says which and why)"
                if row["break_ns"] > 0
                else "; no sequence break explains it"
            )
            findings.append(
                _Finding(
                    "shortfall",
                    "ERROR",
                    True,
                    f"{_seconds(shortfall_ns * gpus)} GPU-time ({shortfall_ns / HOUR_NS:.2%} of the hour) "
                    f"unaccounted{cause}",
                )
            )
        elif shortfall_ns < -tolerance_ns and not skew_signs:
            findings.append(
                _Finding(
                    "excess",
                    "ERROR",
                    True,
                    f"step time and gaps exceed the wall-clock hour by {_seconds(-shortfall_ns)} "
                    f"({-shortfall_ns / HOUR_NS:.2%}): duplicated records or clock skew",
                )
            )
        if skew_signs:
            findings.append(
                _Finding(
                    "clock_skew",
                    "ERROR",
                    True,
                    "wall-clock placement disagrees with monotonic durations (clock skew): "
                    + "; ".join(skew_signs),
                )
            )
        observed = (
            f"{_seconds(accounted_ns * gpus)} GPU-time: busy {_seconds(row['busy_ns'])}, gaps "
            f"{_seconds(row['gaps_ns'])}, idle before/after {_seconds(row['lead_ns'] + row['trail_ns'])}, "
            f"unaccounted {_seconds(shortfall_ns)} per GPU"
        )
        results.append(
            _result(
                hour,
                pool.name,
                replica.id,
                "time",
                expected,
                observed,
                findings,
                passed_detail=f"{row['steps']} steps, busy {row['busy_ns'] / HOUR_NS:.2%} of the hour",
                severity="ERROR",
                blocking=True,
            )
        )
    return results


# --- money --------------------------------------------------------------------------------


def check_money(
    hour: datetime, pool: Pool, invoices: pl.DataFrame, ledger_lines: pl.DataFrame
) -> list[CheckResult]:
    """Ledger lines of every kind sum to the invoice exactly, in integer nano-dollars.

    `invoices` and `ledger_lines` are the warehouse tables (other hours and pools are ignored).
    The invoice itself must equal its GPUs times the GPU-hour price in nano-dollars.
    """
    invoice_rows = _rows_of_hour(invoices, hour, pool.name, "invoices")
    lines = _rows_of_hour(ledger_lines, hour, pool.name, "ledger_lines")

    def failed(expected: str, observed: str, detail: str, finding: str) -> list[CheckResult]:
        return [
            CheckResult(
                hour,
                pool.name,
                None,
                "money",
                False,
                expected,
                observed,
                detail,
                "ERROR",
                True,
                finding,
            )
        ]

    for table, frame in (("invoices", invoice_rows), ("ledger_lines", lines)):
        dtype = frame.schema["amount_nano"]
        if not dtype.is_integer():
            return failed(
                "integer nano-dollars",
                f"{table}.amount_nano is {dtype}",
                f"{table}.amount_nano is {dtype}: money must be integer nano-dollars",
                "not_integer",
            )
        if frame["amount_nano"].null_count():
            return failed(
                "an amount on every row",
                f"{frame['amount_nano'].null_count()} null amounts",
                f"{table} has rows without amount_nano for {hour_key(hour)}",
                "null_amount",
            )
    if invoice_rows.height != 1:
        return failed(
            "one invoice",
            f"{invoice_rows.height} invoices",
            f"expected exactly one invoice for pool {pool.name} hour {hour_key(hour)}, found {invoice_rows.height}",
            "invoice_count",
        )
    invoice = invoice_rows.row(0, named=True)
    findings = []
    invoice_nano = int(invoice["amount_nano"])
    priced_nano = int(invoice["gpus"]) * round(float(invoice["usd_per_gpu_hour"]) * 1_000_000_000)
    if priced_nano != invoice_nano:
        findings.append(
            _Finding(
                "invoice_price",
                "ERROR",
                True,
                f"invoice {invoice_nano} nano-dollars != {invoice['gpus']} GPUs x "
                f"{invoice['usd_per_gpu_hour']} USD/GPU-hour = {priced_nano}",
            )
        )
    unknown = sorted(set(lines["line_kind"].to_list()) - set(LINE_KINDS))
    if unknown:
        findings.append(
            _Finding("line_kind", "ERROR", True, f"unknown ledger line kinds {unknown}")
        )
    by_kind = lines.group_by("line_kind").agg(pl.col("amount_nano").sum()).sort("line_kind")
    ledger_nano = int(lines["amount_nano"].sum())
    kinds = ", ".join(f"{kind} {amount}" for kind, amount in by_kind.iter_rows())
    if ledger_nano != invoice_nano:
        findings.append(
            _Finding(
                "mismatch",
                "ERROR",
                True,
                f"ledger lines sum to {ledger_nano} nano-dollars, the invoice is {invoice_nano}: "
                f"off by {ledger_nano - invoice_nano} ({kinds})",
            )
        )
    return [
        _result(
            hour,
            pool.name,
            None,
            "money",
            f"{invoice_nano} nano-dollars (invoice)",
            f"{ledger_nano} nano-dollars in {lines.height} ledger lines",
            findings,
            passed_detail=f"ledger equals the invoice exactly ({kinds})",
            severity="ERROR",
            blocking=True,
        )
    ]


# --- plausibility -------------------------------------------------------------------------


def check_plausibility(
    hour: datetime, pool: Pool, steps: pl.DataFrame, dcgm: pl.DataFrame, settings: Settings
) -> list[CheckResult]:
    """The engine's busy fraction against the mean DCGM engine activity of the replica's GPUs.

    `steps` (STEPS): busy fraction = step time starting in the hour / 3600 s. `dcgm`: samples
    as `pipeline.ingestion.dcgm.parse_dcgm` returns them, matched to the pool's replicas by GPU UUID; the
    hour's samples are averaged per GPU, then over the replica's GPUs. DCGM readings are
    instantaneous, so the comparison uses the band `settings.dcgm_tolerance`. A GPU without
    samples is its own failed finding.
    """
    start_ns, end_ns = hour_bounds_ns(hour)
    band = settings.dcgm_tolerance
    busy = dict(
        _steps_of_hour(steps, hour, pool)
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
    results = []
    for replica in pool.replicas:
        busy_fraction = busy.get(replica.id, 0) / HOUR_NS
        seen = [uuid for uuid in replica.gpu_uuids if uuid in activity]
        missing = [uuid for uuid in replica.gpu_uuids if uuid not in activity]
        expected = f"DCGM_FI_PROF_GR_ENGINE_ACTIVE mean within ±{band:.2f} of engine busy {busy_fraction:.3f}"
        findings = []
        if missing:
            findings.append(
                _Finding(
                    "dcgm_missing",
                    "WARN",
                    False,
                    f"no DCGM samples for GPU {', '.join(missing)} in hour {hour_key(hour)} "
                    f"(host {replica.hostname}): engine activity cannot be cross-checked",
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
                    _Finding(
                        "host_stall",
                        "ERROR",
                        False,
                        f"{comparison}: steps are stalling on the host, and customers would be "
                        "charged for CPU waits",
                    )
                )
            elif active - busy_fraction > band:
                findings.append(
                    _Finding(
                        "gpu_busier",
                        "WARN",
                        False,
                        f"{comparison}: the GPU is busier than the engine's log, so steps went "
                        "unlogged or another process shares the GPU",
                    )
                )
            passed_detail = (
                f"replica idle (no steps): {comparison}" if replica.id not in busy else comparison
            )
        results.append(
            _result(
                hour,
                pool.name,
                replica.id,
                "plausibility",
                expected,
                observed,
                findings,
                passed_detail=passed_detail,
                severity="ERROR",
                blocking=False,
            )
        )
    return results


# --- unattributed -------------------------------------------------------------------------


def check_unattributed(hour: datetime, pool: Pool, ledger_lines: pl.DataFrame) -> list[CheckResult]:
    """The share of the hour's usage charges without tenant context, against the pool's threshold.

    Usage is the work charged to requests (line kinds usage, unattributed, platform_retry);
    idle, headroom and cache credits are not usage.
    """
    threshold = pool.policies.unattributed_alert_fraction
    lines = _rows_of_hour(ledger_lines, hour, pool.name, "ledger_lines").filter(
        pl.col("line_kind").is_in(WORK_LINE_KINDS)
    )
    usage_nano = int(lines["amount_nano"].sum())
    orphan = lines.filter(pl.col("line_kind") == "unattributed")
    orphan_nano = int(orphan["amount_nano"].sum())
    orphan_requests = int(orphan["requests"].sum())
    share = orphan_nano / usage_nano if usage_nano else 0.0
    expected = f"at most {threshold:.2%} of usage unattributed"
    observed = (
        f"{share:.2%}: {orphan_nano} of {usage_nano} nano-dollars, {orphan_requests} requests"
    )
    findings = []
    if share > threshold:
        findings.append(
            _Finding(
                "over_threshold",
                "ERROR",
                False,
                f"{share:.2%} of the hour's usage ({orphan_nano} of {usage_nano} nano-dollars, "
                f"{orphan_requests} requests) has no tenant context, above the pool's "
                f"{threshold:.2%}: requests are missing from the gateway context log",
            )
        )
    return [
        _result(
            hour,
            pool.name,
            None,
            "unattributed",
            expected,
            observed,
            findings,
            passed_detail="no usage in the hour"
            if not usage_nano
            else f"{share:.2%} of usage unattributed",
            severity="ERROR",
            blocking=False,
        )
    ]


# --- calibration --------------------------------------------------------------------------


def check_calibration(
    hour: datetime,
    pool: Pool,
    segments: pl.DataFrame,
    known_keys: Collection[CalibrationKey],
    settings: Settings,
    *,
    kernel_engine_version: str | None = None,
    stored_fit: Mapping[str, float] | None = None,
    fresh_fit: Mapping[str, float] | None = None,
) -> list[CheckResult]:
    """Coefficients for the engine and driver versions in the log, and drift of a fresh fit.

    `segments` (SEGMENTS): the hour's segments (other pools ignored); their headers name the
    model, GPU type, engine and driver version per replica. `known_keys`: the
    (model, gpu_type, engine_version, driver_version) keys the calibration store holds.
    `kernel_engine_version`: the engine version the pricing kernel's coefficients were measured
    on. With fitted weights a version without coefficients is an ERROR; with kernel weights it
    is a WARN unless it is the kernel's own version. `stored_fit`/`fresh_fit`: coefficient name
    -> value (e.g. c0_ms, a_ms, b_ms); given both, a pool-level `calibration_drift` row
    compares them against `settings.calibration_drift_fraction`.
    """
    fitted = pool.policies.weights == "fitted"
    known = set(known_keys)
    versions = (
        segments.filter(pl.col("pool") == pool.name)
        .select("replica", "model", "gpu_type", "engine_name", "engine_version", "driver_version")
        .unique()
        .sort("engine_version", "driver_version")
    )
    results = []
    for replica in pool.replicas:
        findings = []
        seen = versions.filter(pl.col("replica") == replica.id)
        described = []
        for row in seen.iter_rows(named=True):
            key = (row["model"], row["gpu_type"], row["engine_version"], row["driver_version"])
            version = (
                f"{row['engine_name']} {row['engine_version']} / driver {row['driver_version']}"
            )
            described.append(version)
            if key in known or (not fitted and row["engine_version"] == kernel_engine_version):
                continue
            stored = sorted(
                f"{engine} / driver {driver}"
                for model, gpu, engine, driver in known
                if (model, gpu) == (row["model"], row["gpu_type"])
            )
            store_says = (
                f"stored coefficients are for {', '.join(stored)} only (stale)"
                if stored
                else f"the calibration store has nothing for {row['model']} on {row['gpu_type']}"
            )
            if fitted:
                findings.append(
                    _Finding(
                        "stale" if stored else "missing",
                        "ERROR",
                        False,
                        f"the log reports {version}: {store_says}; the pool charges with fitted "
                        "weights, so recalibrate (stepledger calibrate) for this version",
                    )
                )
            else:
                measured = (
                    f"the kernel's coefficients were measured on vLLM {kernel_engine_version}"
                    if kernel_engine_version
                    else "the kernel's measured engine version is unknown"
                )
                findings.append(
                    _Finding(
                        "new_engine_version",
                        "WARN",
                        False,
                        f"the log reports {version}, {measured} and {store_says}: "
                        "run a calibration sweep to confirm the kernel's weights still hold",
                    )
                )
        observed = ", ".join(described) if described else "no segments in the hour"
        expected = (
            "fitted coefficients for every version in the log"
            if fitted
            else (
                f"kernel measured on vLLM {kernel_engine_version} or a calibration for the version"
            )
        )
        results.append(
            _result(
                hour,
                pool.name,
                replica.id,
                "calibration",
                expected,
                observed,
                findings,
                passed_detail=f"coefficients known for {observed}" if described else observed,
                severity="ERROR" if fitted else "WARN",
                blocking=False,
            )
        )
    if stored_fit is not None and fresh_fit is not None:
        results.append(_drift(hour, pool, stored_fit, fresh_fit, settings, fitted))
    return results


def _drift(
    hour: datetime,
    pool: Pool,
    stored: Mapping[str, float],
    fresh: Mapping[str, float],
    settings: Settings,
    fitted: bool,
) -> CheckResult:
    limit = settings.calibration_drift_fraction
    severity: Severity = "ERROR" if fitted else "WARN"
    drifts = {}
    for name in sorted(set(stored) | set(fresh)):
        if name not in stored or name not in fresh:
            drifts[name] = float("inf")
        elif stored[name] == 0:
            drifts[name] = 0.0 if fresh[name] == 0 else float("inf")
        else:
            drifts[name] = abs(fresh[name] - stored[name]) / abs(stored[name])
    over = {name: value for name, value in drifts.items() if value > limit}
    listed = ", ".join(
        f"{name} {stored.get(name, 'absent')} -> {fresh.get(name, 'absent')} ({drifts[name]:.1%})"
        for name in sorted(drifts)
    )
    findings = []
    if over:
        consequence = (
            "charges shift between prefill-heavy and decode-heavy tenants: recalibrate"
            if fitted
            else "the kernel's weights may no longer match this engine"
        )
        findings.append(
            _Finding(
                "drift",
                severity,
                False,
                f"a fresh fit drifted beyond {limit:.0%} in {', '.join(sorted(over))}: {listed}; {consequence}",
            )
        )
    return _result(
        hour,
        pool.name,
        None,
        "calibration_drift",
        f"every coefficient within {limit:.0%} of the stored fit",
        listed,
        findings,
        passed_detail=f"fresh fit within {limit:.0%}: {listed}",
        severity=severity,
        blocking=False,
    )


# --- clock and silence -----------------------------------------------------------------------


def check_clock(hour: datetime, pool: Pool, clock_jumps: pl.DataFrame) -> list[CheckResult]:
    """Per replica, the wall-clock jumps (`clock_jumps` rows, as `pipeline.ingestion.ingest` records
    them) of segments whose first step was placed in the hour. The steps were placed by the
    monotonic clock, so the money is exact; the finding says the host's clock needs fixing."""
    start_ns, end_ns = hour_bounds_ns(hour)
    in_hour = clock_jumps.filter(
        pl.col("first_start_utc_ns").is_between(start_ns, end_ns, closed="left")
    )
    results = []
    for replica in pool.replicas:
        mine = in_hour.filter(pl.col("replica") == replica.id).sort("first_seq")
        findings = [
            _Finding(
                "clock_jump",
                "WARN",
                False,
                f"{path}: the wall clock stepped {jump_ns / NS_PER_S:+.3f} s against the "
                f"monotonic clock since segment {previous}; its steps from seq {first_seq} are "
                "placed by the monotonic clock (fix the host's time source)",
            )
            for path, first_seq, previous, jump_ns in mine.select(
                "path", "first_seq", "previous_segment_id", "jump_ns"
            ).iter_rows()
        ]
        results.append(
            _result(
                hour,
                pool.name,
                replica.id,
                "clock",
                "segment wall-clock anchors agree with the monotonic clock",
                f"{mine.height} wall-clock jump(s)",
                findings,
                passed_detail="no wall-clock jump",
                severity="WARN",
                blocking=False,
            )
        )
    return results


def check_silence(
    hour: datetime, pool: Pool, steps: pl.DataFrame, dcgm: pl.DataFrame, settings: Settings
) -> list[CheckResult]:
    """Per replica: no step logged in the hour while DCGM shows its GPUs busy is missing step
    logs, not idle time. Billing the hour would turn the replica's work into idle cost, so it
    holds the hour back (ERROR, blocking). Busy: mean GR_ENGINE_ACTIVE above
    `settings.dcgm_tolerance`, the band within which an idle GPU's readings fall."""
    start_ns, end_ns = hour_bounds_ns(hour)
    logged = set(_steps_of_hour(steps, hour, pool)["replica"].unique().to_list())
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
                _Finding(
                    "silent_replica",
                    "ERROR",
                    True,
                    f"no step log from replica {replica.id} (host {replica.hostname}) in hour "
                    f"{hour_key(hour)} while DCGM shows its GPUs {active:.1%} busy (idle band "
                    f"±{band:.0%}): its segments are missing, and billing the hour would charge "
                    "its work as idle",
                )
            )
        observed = f"{'steps logged' if replica.id in logged else 'no steps'}; " + (
            f"DCGM mean {active:.3f}" if active is not None else "no DCGM samples"
        )
        results.append(
            _result(
                hour,
                pool.name,
                replica.id,
                "silence",
                f"steps logged whenever DCGM activity exceeds {band:.2f}",
                observed,
                findings,
                passed_detail=observed,
                severity="ERROR",
                blocking=True,
            )
        )
    return results


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
    in_hour = _steps_of_hour(steps, hour, pool)
    key = hour_key(hour)
    results = []
    for replica in pool.replicas:
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
            ranges = compact_ranges(_runs(unbilled["seq"].unique().sort().to_numpy()))
            findings.append(
                _Finding(
                    "unbilled_steps",
                    "ERROR",
                    True,
                    f"{unbilled.height} steps of replica {replica.id} (seq {ranges}) lie in hours "
                    f"never attributed, neither published nor held back: {by_hour}; they are "
                    f"billed to nobody while hour {key} is published without them (attribute "
                    "those hours with stepledger run --hour, or fix the replica's clock and "
                    "re-ingest)",
                )
            )
        observed = (
            f"{seqs.len()} steps in the hour; {unbilled.height} steps up to it in hours not "
            "attributed"
        )
        results.append(
            _result(
                hour,
                pool.name,
                replica.id,
                "conservation",
                "every step up to the hour's last in a published or held-back hour",
                observed,
                findings,
                passed_detail=f"{seqs.len()} steps in the hour, none billed to nobody",
                severity="ERROR",
                blocking=True,
            )
        )
    return results


# --- one pool-hour, from the lake, the warehouse and the DCGM scrapes ----------------------


# The reconciliation checks run on every pool-hour (the table above says which block).
CHECKS = (
    "sequence",
    "time",
    "money",
    "plausibility",
    "unattributed",
    "calibration",
    "calibration_drift",
    "clock",
    "silence",
    "conservation",
)


def _pool_rows(con: duckdb.DuckDBPyConnection, table: str, pool: Pool) -> pl.DataFrame:
    """A warehouse table's rows for the pool's replicas (damage by the replica outbox holding the file)."""
    if table == "damage":
        return query_frame(
            con,
            "SELECT * FROM damage WHERE list_contains(?, regexp_extract(path, '([^/]+)/[^/]*$', 1))",
            [[r.id for r in pool.replicas]],
        )
    return query_frame(con, f"SELECT * FROM {table} WHERE pool = ?", [pool.name])


def check_calibration_of_hour(
    con: duckdb.DuckDBPyConnection,
    pool: Pool,
    hour: datetime,
    data: HourInput,
    settings: Settings,
    store: CalibrationStore,
) -> list[CheckResult]:
    """The calibration check of one pool-hour: the engine and driver versions of the segments
    the hour's steps came from, against the calibration `store` (a CalibrationStore) and the
    engine release the pricing kernel's chip coefficients were measured on.

    A kernel-weights pool passes for the kernel's own release and for any version with a
    stored sweep; another version is a WARN (its charges stand, the kernel was not measured
    on it). A fitted-weights pool needs stored coefficients for every version (ERROR
    otherwise), and the hour's own steps are fitted afresh and compared with the stored fit
    of the version that logged most of them (`calibration_drift`). Kernel-weights pools get
    no drift row: their charges do not use the fit, and a linear fit's coefficients move with
    the workload's batch mix (a few minutes' sweep against a busy hour differ by over 10%),
    which would only warn about traffic."""
    segment_ids = data.steps["segment_id"].unique()
    segments = _pool_rows(con, "segments", pool).filter(
        pl.col("segment_id").is_in(segment_ids.implode())
    )
    key_columns = ["model", "gpu_type", "engine_version", "driver_version"]
    versions = (
        segments.group_by(key_columns)
        .agg(pl.col("steps").sum(), pl.col("segment_id"))
        .sort("steps", *key_columns, descending=[True, False, False, False, False])
    )
    stored_fit = fresh_fit = None
    # Fit only the steps of the version that logged most of the hour among those with a
    # stored fit: other versions' steps would blur the fresh fit.
    calibrated = pool.policies.weights == "fitted" and next(
        (
            (version, stored)
            for version in versions.iter_rows(named=True)
            if (stored := store.lookup(*(version[c] for c in key_columns))) is not None
        ),
        None,
    )
    if calibrated:
        version, stored = calibrated
        steps = data.steps.filter(pl.col("segment_id").is_in(version["segment_id"]))
        slots = data.slots.join(steps.select("replica", "seq"), on=["replica", "seq"], how="semi")
        try:
            fresh = fit_coefficients(steps, slots).coefficients
        except CalibrationError:
            pass  # too few or too uniform steps in the hour to fit: no drift to measure
        else:
            stored_fit, fresh_fit = (
                {n: getattr(c, n) for n in ("c0_ms", "a_ms", "b_ms")} for c in (stored, fresh)
            )
    return check_calibration(
        hour,
        pool,
        segments,
        [entry.key for entry in store.entries],
        settings,
        kernel_engine_version=load_chip(pool.gpu_type).measured_engine.version,
        stored_fit=stored_fit,
        fresh_fit=fresh_fit,
    )


def attributed_hours(con: duckdb.DuckDBPyConnection, pool: Pool, hour: datetime) -> set[str]:
    """Keys of the pool's hours with an invoice (published or held back), and `hour`'s own."""
    rows = con.execute("SELECT DISTINCT hour FROM invoices WHERE pool = ?", [pool.name]).fetchall()
    return {hour_key(from_warehouse(row[0])) for row in rows} | {hour_key(hour)}


def reconcile_hour(
    con: duckdb.DuckDBPyConnection,
    lake: Path,
    dcgm_dir: Path,
    pool: Pool,
    hour: datetime,
    settings: Settings,
    *,
    calibration_file: Path | None = None,
) -> list[CheckResult]:
    """Run the CHECKS on one published pool-hour and record them in the warehouse's
    `reconciliation` table (`pipeline.reconcile.alerts.record_alerts` adds the failures to `alerts`).

    `calibration_file`: the calibration store (`<data dir>/calibration.yaml`); without one no
    engine version has been calibrated."""
    hour = utc_hour(hour)
    batches = committed_batches(con)
    # The checks read the steps; only a fitted pool's drift check reads their slots.
    tables = ("steps", "slots") if pool.policies.weights == "fitted" else ("steps",)
    data = load_hour(lake, pool.name, hour, batches, tables=tables)
    steps = data.steps
    store = (
        CalibrationStore.load(calibration_file)
        if calibration_file is not None
        else CalibrationStore()
    )
    at_hour = [to_warehouse(hour), pool.name]
    invoices = query_frame(con, "SELECT * FROM invoices WHERE hour = ? AND pool = ?", at_hour)
    dcgm = read_dcgm_hour(dcgm_dir, hour)
    lines = query_frame(con, "SELECT * FROM ledger_lines WHERE hour = ? AND pool = ?", at_hour)
    results = [
        *check_sequence(
            hour,
            pool,
            steps,
            _pool_rows(con, "drops", pool),
            _pool_rows(con, "damage", pool),
            _pool_rows(con, "segments", pool),
            last_seq_before=last_seq_before(lake, pool.name, hour, batches),
        ),
        *check_time(hour, pool, steps, settings),
        *check_money(hour, pool, invoices, lines),
        *check_plausibility(hour, pool, steps, dcgm, settings),
        *check_silence(hour, pool, steps, dcgm, settings),
        *check_clock(hour, pool, _pool_rows(con, "clock_jumps", pool)),
        *check_conservation(
            hour,
            pool,
            steps,
            steps_of_other_hours(lake, pool.name, attributed_hours(con, pool, hour), batches),
        ),
        *check_unattributed(hour, pool, lines),
        *check_calibration_of_hour(con, pool, hour, data, settings, store),
    ]
    record_checks(con, hour, pool.name, list(CHECKS), results)
    return results


def failed_checks(con: duckdb.DuckDBPyConnection, pool: str, hour: datetime) -> list[CheckResult]:
    """The hour's failed reconciliation results, as recorded in the warehouse."""
    rows = query_frame(
        con,
        "SELECT hour, pool, replica, check_name, passed, expected, observed, detail, severity, blocking, finding "
        "FROM reconciliation WHERE hour = ? AND pool = ? AND NOT passed ORDER BY check_name, replica",
        [to_warehouse(hour), pool],
    )
    return [
        CheckResult(**{**row, "hour": from_warehouse(row["hour"])})
        for row in rows.iter_rows(named=True)
    ]
