from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.attribution.allocator import (
    AllocationError,
    GroupedRows,
    allocate_step,
    blend_and_allocate,
    largest_remainder,
    split_compute_kv,
    step_total_units,
)
from pipeline.attribution.workmodel import Coefficients, SlotBatch, fitted_work_ms


@dataclass
class Slot:
    request_id: str
    new_tokens: int
    context: int
    kv_blocks: float


SEED_BATCH = [
    Slot("A", 512, 0, 32),
    Slot("B", 1, 3800, 238),
    Slot("C", 1, 1000, 63),
    Slot("D", 1, 100, 7),
]

groups_strategy = st.lists(
    st.tuples(
        st.integers(0, 10**9),
        st.lists(
            st.floats(0.0, 1e6, allow_nan=False, allow_subnormal=False), min_size=1, max_size=12
        ).filter(lambda w: sum(w) > 0),
    ),
    min_size=1,
    max_size=20,
)


def _flatten(groups):
    totals = np.array([total for total, _ in groups], dtype=np.int64)
    index = np.concatenate([np.full(len(w), g) for g, (_, w) in enumerate(groups)])
    weights = np.concatenate([np.array(w) for _, w in groups])
    return totals, index, weights


def test_seed_worked_example_both_alphas():
    # 50 ms at $3.60 per GPU-hour is 1 micro-dollar per ms.
    assert allocate_step(SEED_BATCH, 50, 1.0, 12, 0.05, 0.00005, alpha=1.0) == {
        "A": 39,
        "B": 4,
        "C": 4,
        "D": 3,
    }
    assert allocate_step(SEED_BATCH, 50, 1.0, 12, 0.05, 0.00005, alpha=0.8) == {
        "A": 32,
        "B": 10,
        "C": 5,
        "D": 3,
    }
    assert 238 / sum(s.kv_blocks for s in SEED_BATCH) == pytest.approx(0.70)


def test_exact_shares_and_remainders():
    shares, exact = largest_remainder(
        np.array([10, 7]), np.array([0, 0, 0, 1, 1]), np.array([1.0, 1.0, 1.0, 2.0, 1.0])
    )
    # 10/3 each: one leftover unit to the earliest; 7 x 2/3 = 4.67 -> 5, 7/3 = 2.33 -> 2.
    assert shares.tolist() == [4, 3, 3, 5, 2]
    assert exact.tolist() == pytest.approx([10 / 3, 10 / 3, 10 / 3, 14 / 3, 7 / 3])


def test_ties_go_to_the_earlier_position_even_with_many_leftovers():
    shares, _ = largest_remainder(np.array([5]), np.zeros(8, dtype=np.int64), np.ones(8))
    assert shares.tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    shares, _ = largest_remainder(np.array([1]), np.zeros(9, dtype=np.int64), np.ones(9))
    assert shares.tolist() == [1, 0, 0, 0, 0, 0, 0, 0, 0]


def test_the_largest_remainder_wins_within_a_crowded_bucket():
    # Remainders .26, .27 and .30 share a bucket: the leftover unit goes to the largest.
    shares, _ = largest_remainder(
        np.array([4]), np.zeros(4, dtype=np.int64), np.array([1.26, 1.27, 1.30, 0.17])
    )
    assert shares.tolist() == [1, 1, 2, 0]
    # Seventy equal remainders in one bucket: the 30 leftover units go to the first 30 rows.
    shares, _ = largest_remainder(np.array([100]), np.zeros(70, dtype=np.int64), np.ones(70))
    assert shares.tolist() == [2] * 30 + [1] * 40


def test_unsorted_groups_match_sorted_layout():
    shares, exact = largest_remainder(
        np.array([10, 7]), np.array([1, 0, 1, 0, 0]), np.array([2.0, 1.0, 1.0, 1.0, 1.0])
    )
    assert shares.tolist() == [5, 4, 2, 3, 3]
    assert exact[0] == pytest.approx(14 / 3)


def test_grouped_rows_split_as_the_group_index_does():
    index = np.array([0, 0, 0, 2, 2])
    rows = GroupedRows.of(index, 3)
    assert rows.offsets.tolist() == [0, 3, 3, 5]
    assert rows.sizes.tolist() == [3, 0, 2]
    assert rows.n_rows == 5
    totals, work, kv = (
        np.array([10, 0, 7]),
        np.array([1.0, 1.0, 1.0, 2.0, 1.0]),
        np.array([0.0, 4.0, 1.0, 1.0, 1.0]),
    )
    shares, exact = largest_remainder(totals, rows, work)
    assert shares.tolist() == [4, 3, 3, 5, 2]
    assert exact.tolist() == largest_remainder(totals, index, work)[1].tolist()
    # Step 0: 10 x (0.8/3 + 0.2 x (0, 0.8, 0.2)) = 2.67, 4.27, 3.07; step 2: 7 x (0.63, 0.37) = 4.43, 2.57.
    blended = blend_and_allocate(totals, rows, work, kv, 0.8)
    assert blended.shares.tolist() == [3, 4, 3, 4, 3]
    assert blended.exact.tolist() == blend_and_allocate(totals, index, work, kv, 0.8).exact.tolist()


def test_grouped_rows_refuse_a_layout_they_cannot_describe():
    with pytest.raises(ValueError, match="non-decreasing within 0..1"):
        GroupedRows.of(np.array([0, 1, 0]), 2)
    with pytest.raises(ValueError, match="non-decreasing within 0..1"):
        GroupedRows.of(np.array([0, 2]), 2)
    with pytest.raises(ValueError, match="start at 0 and never decrease"):
        GroupedRows(np.array([0, 3, 2]))
    rows = GroupedRows(np.array([0, 2, 3]))
    with pytest.raises(AllocationError, match="3 totals for 2 groups of rows"):
        largest_remainder(np.array([1, 1, 1]), rows, np.ones(3))
    with pytest.raises(AllocationError, match="the groups have 3 rows but weight has 4"):
        largest_remainder(np.array([1, 1]), rows, np.ones(4))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 6), max_size=40), st.integers(0, 3))
def test_group_offsets_of_sorted_rows_match_a_search(groups, spare_groups):
    index = np.sort(np.array(groups, dtype=np.int64))
    n_groups = (int(index.max()) + 1 if index.size else 0) + spare_groups
    offsets = GroupedRows.of(index, n_groups).offsets
    np.testing.assert_array_equal(offsets, np.searchsorted(index, np.arange(n_groups + 1)))


def test_blend_parts_follow_the_rows_in_input_order():
    # Group 1's rows come first in the input; the parts come back in that order.
    split = blend_and_allocate(
        np.array([10, 20]),
        np.array([1, 0, 1, 0]),
        np.array([3.0, 1.0, 1.0, 0.0]),
        np.array([0.0, 0.0, 0.0, 2.0]),
        0.8,
    )
    compute_part, kv_part = split.parts()
    assert compute_part.tolist() == [0.75, 0.8, 0.25, 0.0]
    assert kv_part.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.2])
    assert split.shares.tolist() == [15, 8, 5, 2]


def test_bad_inputs_are_named():
    with pytest.raises(AllocationError, match="group 0 has total 5 but no row"):
        largest_remainder(np.array([5]), np.array([0, 0]), np.array([0.0, 0.0]))
    with pytest.raises(AllocationError, match="row 1 has weight"):
        largest_remainder(np.array([5]), np.array([0, 0]), np.array([1.0, np.nan]))
    with pytest.raises(AllocationError, match="outside 0..0"):
        largest_remainder(np.array([5]), np.array([0, 1]), np.array([1.0, 1.0]))
    with pytest.raises(AllocationError, match="needs at least one slot"):
        allocate_step([], 50, 1.0, 12, 0.05, 0.00005)


@settings(max_examples=150, deadline=None)
@given(groups_strategy)
def test_shares_sum_to_totals_and_stay_within_one_unit(groups):
    totals, index, weights = _flatten(groups)
    shares, exact = largest_remainder(totals, index, weights)
    assert (
        np.bincount(index, weights=shares, minlength=len(totals)).astype(np.int64) == totals
    ).all()
    np.testing.assert_array_equal(
        np.bincount(index, minlength=len(totals)), [len(w) for _, w in groups]
    )
    assert (np.abs(shares - exact) < 1.0 + 1e-6).all()
    assert (shares >= 0).all()


@settings(max_examples=100, deadline=None)
@given(groups_strategy, st.randoms(use_true_random=False))
def test_shares_invariant_to_order_up_to_ties(groups, rnd):
    totals, index, weights = _flatten(groups)
    shares, exact = largest_remainder(totals, index, weights)
    permutation = np.array(rnd.sample(range(len(index)), len(index)))
    shuffled, _ = largest_remainder(totals, index[permutation], weights[permutation])
    back = np.empty_like(shuffled)
    back[permutation] = shuffled
    remainders = exact - np.floor(exact)
    for g in range(len(totals)):
        rows = index == g
        differ = rows & (back != shares)
        # Only rows whose remainder ties another row's may trade a unit with it.
        for row in np.flatnonzero(differ):
            assert np.isclose(remainders[rows], remainders[row], rtol=0, atol=1e-9).sum() > 1
        assert back[rows].sum() == shares[rows].sum()


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 2048),
            st.integers(0, 16000),
            st.floats(0, 500, allow_nan=False, allow_subnormal=False),
        ),
        min_size=1,
        max_size=16,
    ),
    st.floats(1, 500),
    st.floats(0, 1),
)
def test_vectorised_path_matches_the_reference_allocator(rows, step_ms, alpha):
    slots = [Slot(f"r{i}", t, L, kv) for i, (t, L, kv) in enumerate(rows)]
    reference = allocate_step(slots, step_ms, 1.0, 12, 0.05, 0.00005, alpha=alpha)
    n = len(slots)
    batch = SlotBatch(
        np.zeros(n, dtype=np.int64),
        1,
        np.array([s.new_tokens for s in slots]),
        np.array([s.context for s in slots]),
        np.zeros(n, dtype=np.int64),
    )
    work = fitted_work_ms(Coefficients(12, 0.05, 0.00005), batch, "per_slot")
    split = blend_and_allocate(
        np.array([round(step_ms)]),
        batch.step_index,
        work,
        np.array([s.kv_blocks for s in slots]),
        alpha,
    )
    # Same operations in the same order: identical shares, ties included.
    assert dict(zip(reference, split.shares.tolist(), strict=False)) == reference


def test_step_total_units_is_exact_decimal_arithmetic():
    assert step_total_units(50, 1, 3.6, 1_000_000) == 50
    assert step_total_units(50, 1, 3.6, 1_000_000_000) == 50_000
    assert step_total_units(0.1, 8, 4.5, 1_000_000_000) == 1_000  # 0.1 ms x 8 x $4.50/h
    assert step_total_units(1, 1, 1.8, 1_000_000) == 0  # 0.5 rounds half to even


def test_compute_kv_split_sums_to_amount():
    compute, kv = split_compute_kv(
        np.array([10, 7, 0, 5]), np.array([0.75, 0.0, 0.5, 0.25]), np.array([0.25, 0.3, 0.5, 0.25])
    )
    assert compute.tolist() == [8, 0, 0, 3]
    assert kv.tolist() == [2, 7, 0, 2]


slots_strategy = st.lists(
    st.tuples(st.integers(0, 4), st.integers(0, 2048), st.integers(0, 8192)),
    min_size=1,
    max_size=30,
).map(sorted)
COEFFICIENTS = Coefficients(12, 0.05, 0.00005)
WITHOUT_C0 = Coefficients(0, 0.05, 0.00005)


def _slot_batch(slots: list[tuple[int, int, int]]) -> SlotBatch:
    step, new, context = (np.array(column, dtype=np.int64) for column in zip(*slots, strict=True))
    return SlotBatch(step, 5, new, context, np.zeros(len(slots), dtype=np.int64))


@settings(max_examples=100, deadline=None)
@given(slots_strategy, st.sampled_from(["per_slot", "per_token"]))
def test_each_step_with_slots_carries_c0_exactly_once(slots, policy):
    batch = _slot_batch(slots)
    fixed = fitted_work_ms(COEFFICIENTS, batch, policy) - fitted_work_ms(WITHOUT_C0, batch, policy)
    per_step = np.bincount(batch.step_index, weights=fixed, minlength=5)
    assert per_step.tolist() == pytest.approx(
        [12.0 if size else 0.0 for size in batch.slots_per_step]
    )
    assert (fixed >= 0).all()


@settings(max_examples=100, deadline=None)
@given(slots_strategy)
def test_per_token_gives_the_fixed_part_in_proportion_to_new_tokens(slots):
    batch = _slot_batch(slots)
    fixed = fitted_work_ms(COEFFICIENTS, batch, "per_token") - fitted_work_ms(
        WITHOUT_C0, batch, "per_token"
    )
    for step in np.unique(batch.step_index):
        rows = batch.step_index == step
        tokens = batch.new_tokens[rows]
        expected = (
            12.0 * tokens / tokens.sum()
            if tokens.sum()
            else np.full(tokens.size, 12.0 / tokens.size)
        )
        assert fixed[rows].tolist() == pytest.approx(expected.tolist())


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2048), st.integers(0, 8192), st.integers(1, 64), st.integers(1, 4096))
def test_a_slots_own_work_grows_with_its_tokens_and_its_context(
    new, context, more_new, more_context
):
    def own(t: int, length: int) -> float:
        return float(fitted_work_ms(WITHOUT_C0, _slot_batch([(0, t, length)]), "per_slot")[0])

    assert own(new, context) >= 0
    assert own(new + more_new, context) > own(new, context)
    assert own(new, context + more_context) >= own(new, context)
    assert own(0, context) == 0


def test_the_fixed_cost_policy_is_checked_and_a_step_without_tokens_splits_per_slot():
    idle = SlotBatch(
        np.array([0, 0]), 1, np.array([0, 0]), np.array([10, 20]), np.zeros(2, dtype=np.int64)
    )
    assert fitted_work_ms(COEFFICIENTS, idle, "per_token").tolist() == [6.0, 6.0]
    # A policy outside the Literal type, which fitted_work_ms still refuses when it runs.
    unknown_policy: Any = "per_hour"
    with pytest.raises(ValueError, match="unknown fixed-cost policy 'per_hour'"):
        fitted_work_ms(COEFFICIENTS, idle, unknown_policy)


def test_slot_batch_names_a_step_index_out_of_order():
    with pytest.raises(ValueError, match="step_index must be non-decreasing within 0..n_steps-1"):
        SlotBatch(np.array([1, 0]), 2, np.ones(2), np.zeros(2), np.zeros(2))
    with pytest.raises(ValueError, match="step_index must be non-decreasing within 0..n_steps-1"):
        SlotBatch(np.array([0, 2]), 2, np.ones(2), np.zeros(2), np.zeros(2))
    assert SlotBatch(
        np.array([0, 0, 2]), 3, np.ones(3), np.zeros(3), np.zeros(3)
    ).slots_per_step.tolist() == [2, 0, 1]
