from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.attribution.allocator import AllocationError, blend_and_allocate
from pipeline.attribution.clock import cumulative_nano, step_costs_in_hour
from pipeline.attribution.kv import alpha_for_period, first_writer_blocks, holder_blocks
from schemas.config import AlphaFromEvidence, Policies
from schemas.units import HOUR_NS


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, HOUR_NS), min_size=1, max_size=50), st.integers(1, 8 * 10**11))
def test_cumulative_money_is_exact_integer_arithmetic(offsets, price):
    got = cumulative_nano(np.array(offsets, dtype=np.int64), price)
    assert got.tolist() == [t * price // HOUR_NS for t in offsets]


def test_whole_hour_maps_to_the_price_and_costs_round_down_at_instants():
    price = 3 * 3_600_000_000  # three GPUs at $3.60
    assert cumulative_nano(np.array([0, HOUR_NS // 2, HOUR_NS]), price).tolist() == [
        0,
        5_400_000_000,
        price,
    ]
    # 50 ms at 3 x $3.60/h is exactly 150 micro-dollars = 150_000 nano.
    cost, busy = step_costs_in_hour(np.array([10**9]), np.array([10**9 + 50_000_000]), 0, price)
    assert cost.tolist() == [150_000]
    assert busy.tolist() == [50_000_000]


@settings(max_examples=100, deadline=None)
@given(st.integers(-(10**9), 10**9), st.integers(0, 10**10), st.integers(10**9, 4 * 10**10))
def test_a_step_crossing_the_hour_splits_by_time_into_exact_parts(start_offset, duration, price):
    hour = 5 * HOUR_NS
    start, end = hour + start_offset - duration // 2, hour + start_offset - duration // 2 + duration
    before, busy_before = step_costs_in_hour(
        np.array([start]), np.array([end]), hour - HOUR_NS, price
    )
    after, busy_after = step_costs_in_hour(np.array([start]), np.array([end]), hour, price)
    assert busy_before[0] + busy_after[0] == duration
    exact = duration * price / HOUR_NS
    assert abs(int(before[0] + after[0]) - exact) < 1.0 + 1e-6
    assert abs(int(before[0]) - int(busy_before[0]) * price / HOUR_NS) < 1.0 + 1e-6


def test_a_price_outside_int64_range_is_refused():
    with pytest.raises(ValueError, match="price per replica-hour"):
        cumulative_nano(np.array([0]), 0)


def test_alpha_fixed_or_from_admission_evidence():
    blocked = np.array([True, False, False, False])
    assert alpha_for_period(Policies(alpha=0.8), blocked) == (0.8, 0.25)
    alpha, fraction = alpha_for_period(
        Policies(alpha=AlphaFromEvidence(min_alpha=0.5, max_alpha=1.0)), blocked
    )
    assert (alpha, fraction) == (0.875, 0.25)
    assert alpha_for_period(Policies(alpha=AlphaFromEvidence()), np.array([], dtype=bool)) == (
        1.0,
        0.0,
    )
    assert alpha_for_period(
        Policies(alpha=AlphaFromEvidence(min_alpha=0.3)), np.ones(3, dtype=bool)
    )[0] == pytest.approx(0.3)


def test_holders_accrue_unless_swapped_out():
    blocks = holder_blocks(np.array([4.0, 2.5, 9.0]), np.array(["waiting", "preempted", "swapped"]))
    assert blocks.tolist() == [4.0, 2.5, 0.0]
    with pytest.raises(ValueError, match=r"holder state\(s\) \['running'\] unknown"):
        holder_blocks(np.array([1.0]), np.array(["running"]))


def test_first_writer_readers_pay_only_past_their_cached_prefix():
    # Block size 16: writer holds 1040 tokens = 65 blocks; a reader of the same 1024-token
    # prefix with 100 more tokens pays ceil(1124/16) - 64 = 7 blocks.
    blocks = first_writer_blocks(
        np.array([1039.0, 1123.0]), np.array([1.0, 1.0]), np.array([0.0, 1024.0]), 16
    )
    assert blocks.tolist() == [65.0, 7.0]


def test_blend_falls_back_when_a_step_has_no_blocks_or_no_compute():
    group = np.array([0, 0, 1, 1, 2])
    compute = np.array([3.0, 1.0, 1.0, 1.0, 0.0])
    kv = np.array([1.0, 3.0, 0.0, 0.0, 5.0])
    split = blend_and_allocate(np.array([100, 7, 3]), group, compute, kv, 0.8)
    compute_part, kv_part = split.parts()
    weights = compute_part + kv_part
    assert weights.tolist() == pytest.approx(
        [0.8 * 0.75 + 0.2 * 0.25, 0.8 * 0.25 + 0.2 * 0.75, 0.5, 0.5, 1.0]
    )
    assert kv_part[2:4].tolist() == [0.0, 0.0]
    assert compute_part[4] == 0.0
    assert split.shares.tolist() == [65, 35, 4, 3, 3]


def test_blend_refuses_a_step_nobody_can_carry():
    with pytest.raises(
        AllocationError, match="group 0 has total 5 but no row with compute work or KV blocks"
    ):
        blend_and_allocate(np.array([5]), np.array([0]), np.array([0.0]), np.array([0.0]), 0.8)
