from __future__ import annotations

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.reconcile import check_sequence, check_time
from pipeline.reconcile.ranges import compact_ranges, intersect, merge, subtract
from schemas.config import Settings
from schemas.tables import DAMAGE, DROPS
from tests.helpers.hours import HOUR
from tests.helpers.reconcile_builders import (
    MS,
    STEPS_PER_HOUR,
    S,
    clean_steps,
    empty,
    make_damage,
    make_drops,
    make_pool,
    make_segments,
    make_steps,
    sequence,
    shift_utc,
    without_seq,
)

POOL = make_pool()
SETTINGS = Settings()


def time_check(steps, replica):
    """The time check's result for `replica` of the hour's `steps`."""
    return by_replica(check_time(HOUR, POOL, steps, SETTINGS))[replica]


def by_replica(results):
    return {r.replica: r for r in results}


def test_clean_hour_passes_sequence_and_time():
    steps = clean_steps(POOL)
    for result in sequence(steps) + check_time(HOUR, POOL, steps, SETTINGS):
        assert result.passed, result
        assert (result.severity, result.blocking, result.finding) == ("ERROR", True, "")
    r0 = by_replica(sequence(steps))["chat-r0"]
    assert r0.expected == "seq 0-71999 contiguous (72000 steps)"
    assert (
        r0.observed
        == "72000 steps logged, 0 missing (0 counted drops), 0 repeated, 0 damaged frames"
    )
    time_r0 = time_check(steps, "chat-r0")
    assert time_r0.observed == (
        "3600.000 s GPU-time: busy 2160.000 s, gaps 1439.980 s, idle before/after 0.020 s, unaccounted 0.000 s per GPU"
    )
    assert time_r0.detail == "72000 steps, busy 60.00% of the hour"


def test_dropped_records_fail_sequence_with_missing_ranges_and_time_with_shortfall():
    steps = without_seq(
        without_seq(clean_steps(POOL), "chat-r0", 1200, 1299), "chat-r0", 4000, 4010
    )
    steps = without_seq(steps, "chat-r0", 10_000, 10_999)
    results = by_replica(sequence(steps))
    assert results["chat-r1"].passed
    r0 = results["chat-r0"]
    assert not r0.passed
    assert r0.blocking
    assert r0.severity == "ERROR"
    assert r0.finding == "gap"
    assert r0.detail == (
        "missing seq 1200-1299, 4000-4010, 10000-10999 (1111 steps) with no counted drop or damage "
        "to explain them, UTC 05:00:59.980-05:01:05.000, 05:03:19.980-05:03:20.550, "
        "05:08:19.980-05:09:10.000"
    )
    # 1111 lost steps of 50 ms, plus one 20 ms gap per break that the lost steps took with them.
    time_r0 = time_check(steps, "chat-r0")
    assert not time_r0.passed
    assert time_r0.finding == "shortfall"
    assert time_r0.detail == (
        "55.610 s GPU-time (1.54% of the hour) unaccounted; 3 sequence break(s) span 55.610 s: "
        "step records are missing (the sequence check says which and why)"
    )


def test_small_loss_fails_sequence_but_stays_within_time_tolerance():
    steps = without_seq(clean_steps(POOL), "chat-r1", 500, 509)
    assert not by_replica(sequence(steps))["chat-r1"].passed
    time_r1 = time_check(steps, "chat-r1")
    assert time_r1.passed
    assert time_r1.observed.endswith("unaccounted 0.520 s per GPU")


def test_counted_drop_is_still_a_failure_saying_the_recorder_dropped_steps():
    steps = without_seq(clean_steps(POOL), "chat-r0", 1000, 1999)
    r0 = by_replica(sequence(steps, drops=make_drops(POOL, "chat-r0", 1500, 1999)))["chat-r0"]
    assert not r0.passed
    assert r0.blocking
    assert r0.finding == "gap+dropped"
    assert r0.detail == (
        "missing seq 1000-1499 (500 steps) with no counted drop or damage to explain them, "
        "UTC 05:00:49.980-05:01:40.000; recorder dropped 500 steps (seq 1500-1999): its buffer overflowed"
    )
    assert (
        r0.observed
        == "71000 steps logged, 1000 missing (500 counted drops), 0 repeated, 0 damaged frames"
    )


def test_torn_segment_fails_with_the_damaged_frames_and_steps_they_hid():
    path = "outbox/chat-r1/chat-r1-003.seg"
    steps = without_seq(clean_steps(POOL), "chat-r1", 30_000, 30_041)
    damage = make_damage(
        path,
        "torn_tail",
        first=30_000,
        last=30_041,
        offset=4_096,
        detail="frame cut at 212 of 640 bytes",
    )
    r1 = by_replica(sequence(steps, damage=damage))["chat-r1"]
    assert not r1.passed
    assert r1.blocking
    assert r1.severity == "ERROR"
    assert r1.finding == "damage"
    assert r1.detail == (
        "1 damaged frames: torn_tail in outbox/chat-r1/chat-r1-003.seg at byte 4096 (seq 30000-30041): "
        "frame cut at 212 of 640 bytes; 42 steps lost (seq 30000-30041)"
    )


def test_damage_without_sequence_range_in_an_unknown_directory_is_reported_at_pool_level():
    damage = make_damage("outbox/stranger/x.seg", "bad_header", detail="magic mismatch")
    results = sequence(clean_steps(POOL), damage=damage)
    pool_level = [r for r in results if r.replica is None]
    assert len(pool_level) == 1
    assert pool_level[0].blocking
    assert pool_level[0].detail == (
        "damage in files not attributable to a replica of pool chat: bad_header in outbox/stranger/x.seg"
    )


def test_duplicated_segment_is_reported_without_blocking_the_hour():
    damage = make_damage(
        "outbox/chat-r0/chat-r0-000.seg.copy", "duplicate_segment", first=0, last=999
    )
    r0 = by_replica(sequence(clean_steps(POOL), damage=damage))["chat-r0"]
    assert not r0.passed
    assert (r0.severity, r0.blocking, r0.finding) == ("WARN", False, "duplicate_segment")
    assert (
        r0.detail
        == "1 segments delivered twice, the copies were ignored: outbox/chat-r0/chat-r0-000.seg.copy"
    )


def test_repeated_sequence_numbers_block_the_hour():
    steps = clean_steps(POOL)
    repeated = steps.filter((pl.col("replica") == "chat-r0") & pl.col("seq").is_between(100, 199))
    r0 = by_replica(sequence(pl.concat([steps, repeated])))["chat-r0"]
    assert not r0.passed
    assert r0.blocking
    assert r0.finding == "repeated"
    assert (
        r0.detail
        == "seq 100-199 logged more than once (100 sequence numbers): steps would be charged twice"
    )
    # The repeated steps add 3 s of step time beyond the hour: within the time tolerance.
    time_r0 = time_check(pl.concat([steps, repeated]), "chat-r0")
    assert time_r0.passed
    assert time_r0.observed.endswith("unaccounted -3.000 s per GPU")


def test_missing_head_is_seen_with_the_previous_last_seq():
    steps = pl.concat([make_steps(POOL, "chat-r0", first_seq=500), make_steps(POOL, "chat-r1")])
    r0 = by_replica(sequence(steps, last_seq_before={"chat-r0": 449, "chat-r1": -1}))["chat-r0"]
    assert (r0.severity, r0.blocking, r0.finding) == ("ERROR", True, "missing_head")
    assert r0.detail == (
        "missing seq 450-499 (50 steps) before the hour's first logged step, "
        "UTC 05:00:00.000-05:00:00.000: no segment holds them (the log continues seq 449)"
    )
    assert r0.expected == "seq 450-72499 contiguous (72050 steps)"


def test_missing_head_without_a_previous_hour_counts_from_the_start_of_the_log():
    """The first segments of a replica's first hour never arrived: its log starts at seq 0."""
    steps = pl.concat(
        [make_steps(POOL, "chat-r0").filter(pl.col("seq") >= 532), make_steps(POOL, "chat-r1")]
    )
    r0 = by_replica(sequence(steps))["chat-r0"]
    assert (r0.severity, r0.blocking, r0.finding) == ("ERROR", True, "missing_head")
    assert r0.detail == (
        "missing seq 0-531 (532 steps) before the hour's first logged step, "
        "UTC 05:00:00.000-05:00:26.600: no segment holds them (the log continues seq -1)"
    )


def test_an_hour_continues_the_replicas_latest_earlier_segment():
    """No step in the previous hour (the replica sat idle), but an earlier segment ends at
    seq 499: the hour's first step 500 continues it."""
    steps = pl.concat([make_steps(POOL, "chat-r0", first_seq=500), make_steps(POOL, "chat-r1")])
    earlier = make_segments(POOL).with_columns(
        pl.lit("outbox/chat-r0/earlier.seg").alias("path"),
        pl.lit("earlier").alias("segment_id"),
        pl.lit(499, pl.Int64).alias("last_seq"),
    )
    (r0, r1) = check_sequence(
        HOUR,
        POOL,
        steps,
        empty(DROPS),
        empty(DAMAGE),
        pl.concat([make_segments(POOL), earlier]),
    )
    assert r0.passed
    assert r1.passed


@pytest.mark.parametrize(
    ("shift_ns", "disagreement"),
    [
        (
            30 * S,
            "UTC span differs from the monotonic span by 30.000 s; UTC-monotonic offset moved by "
            "30.000 s within the hour",
        ),
        (-2 * S, "consecutive steps overlap in UTC by up to 1.980 s"),
    ],
)
def test_clock_skew_fails_time_as_skew_not_as_drops(shift_ns, disagreement):
    steps = shift_utc(clean_steps(POOL), "chat-r1", 36_000, shift_ns)
    assert all(r.passed for r in sequence(steps))
    r1 = time_check(steps, "chat-r1")
    assert not r1.passed
    assert r1.blocking
    assert r1.finding == "clock_skew"
    assert r1.detail == (
        f"wall-clock placement disagrees with monotonic durations (clock skew): {disagreement}"
    )


def test_anchor_jitter_below_a_millisecond_is_not_skew():
    steps = shift_utc(clean_steps(POOL), "chat-r1", 36_000, -25 * MS)
    # A 25 ms step back overlaps the previous step by 5 ms: flagged; 0.5 ms is anchor jitter.
    assert not time_check(steps, "chat-r1").passed
    jitter = shift_utc(clean_steps(POOL), "chat-r1", 36_000, -20 * MS - MS // 2)
    assert time_check(jitter, "chat-r1").passed


def test_idle_replica_without_steps_passes_time_and_sequence_visibly():
    steps = make_steps(POOL, "chat-r0")
    r1_time = time_check(steps, "chat-r1")
    assert r1_time.passed
    assert r1_time.observed == "no steps"
    assert r1_time.detail.startswith("no steps logged: the replica was idle all hour")
    r1_seq = by_replica(sequence(steps))["chat-r1"]
    assert r1_seq.passed
    assert r1_seq.detail == "no steps logged in the hour"


def test_time_scales_with_gpus_per_replica_and_ignores_other_hours_and_pools():
    tp8 = make_pool(name="big", replicas=1, gpus=8)
    other_hour = make_steps(tp8, "big-r0").with_columns(pl.col("start_utc_ns") + 3_600 * S)
    other_pool = make_steps(make_pool(name="else"), "big-r0")
    steps = pl.concat(
        [make_steps(tp8, "big-r0", count=STEPS_PER_HOUR // 2), other_hour, other_pool]
    )
    (result,) = check_time(HOUR, tp8, steps, SETTINGS)
    assert result.expected == "28800.000 s GPU-time (3600 s x 8 GPUs) within 0.50%"
    assert result.observed.startswith("28800.000 s GPU-time: busy 1080.000 s")
    assert result.passed


def test_compact_ranges_lists_then_counts():
    assert (
        compact_ranges([(1200, 1299), (4000, 4010), (5123, 5123)]) == "1200-1299, 4000-4010, 5123"
    )
    assert (
        compact_ranges([(i * 10, i * 10) for i in range(5)], limit=2) == "0, 10 and 3 more ranges"
    )


range_lists = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 20)), max_size=12).map(
    lambda pairs: merge((a, a + n) for a, n in pairs)
)


def _as_set(ranges):
    return {value for a, b in ranges for value in range(a, b + 1)}


@settings(max_examples=200, deadline=None)
@given(range_lists, range_lists)
def test_range_algebra_matches_set_algebra(left, right):
    assert _as_set(intersect(left, right)) == _as_set(left) & _as_set(right)
    assert _as_set(subtract(left, right)) == _as_set(left) - _as_set(right)
    assert subtract(left, right) == merge(subtract(left, right))


@settings(max_examples=40, deadline=None)
@given(st.sets(st.integers(0, 1_999), max_size=300))
def test_sequence_reports_exactly_the_missing_steps(lost):
    pool = make_pool(replicas=1)
    steps = make_steps(pool, "chat-r0", count=2_000).filter(~pl.col("seq").is_in(sorted(lost)))
    (result,) = check_sequence(HOUR, pool, steps, empty(DROPS), empty(DAMAGE), make_segments(pool))
    kept = set(range(2_000)) - lost
    # A log starts at seq 0: steps lost before the first kept one are its missing head.
    detected = {s for s in lost if kept and s < max(kept)}
    assert result.passed == (not detected)
    head = {s for s in detected if s < min(kept)}
    if head:
        assert f"({len(head)} steps) before the hour's first logged step" in result.detail
    if detected - head:
        assert f"({len(detected - head)} steps) with no counted drop" in result.detail


def test_step_time_beyond_the_hour_fails_time_as_excess():
    steps = clean_steps(POOL)
    repeated = steps.filter((pl.col("replica") == "chat-r0") & (pl.col("seq") < 1_000))
    r0 = time_check(pl.concat([steps, repeated]), "chat-r0")
    assert not r0.passed
    assert r0.blocking
    assert r0.finding == "excess"
    assert r0.detail == (
        "step time and gaps exceed the wall-clock hour by 30.000 s (0.83%): duplicated records or clock skew"
    )


def test_damage_of_another_pools_segment_is_left_to_that_pool():
    other = make_pool(name="other")
    path = "outbox/other-r0/other-r0-000.seg"
    damage = make_damage(path, "corrupt_frame", first=5, last=9)
    results = check_sequence(
        HOUR,
        POOL,
        clean_steps(POOL),
        empty(DROPS),
        damage,
        pl.concat([make_segments(POOL), make_segments(other)]),
    )
    assert all(r.passed for r in results)
    assert len(results) == 2
