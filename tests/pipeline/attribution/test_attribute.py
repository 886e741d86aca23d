"""The resource work kept with a pool-hour's ledger: attribution prices the hour a batch of
steps at a time, from rows in any order, and totals each request's work per resource as it
goes; its figures must be those of pricing the whole hour at once."""

from __future__ import annotations

import itertools

import numpy as np
import polars as pl
from hypothesis import given, settings
from hypothesis import strategies as st
from polars.testing import assert_frame_equal

from pipeline.attribution.hour import attribute_hour, decode_contexts, step_batches
from pipeline.attribution.ledger import DECODE_CONTEXTS_SCHEMA, RESOURCE_WORK_SCHEMA
from pipeline.attribution.synthetic import HOUR, HOUR_START_NS, synthetic_log, synthetic_pool
from pipeline.attribution.weights import kernel_weights
from pipeline.attribution.workmodel import Coefficients, FittedWeights, SlotBatch, split_fixed
from pricing import RESOURCES


def _whole_hour_at_once(pool, steps: pl.DataFrame, slots: pl.DataFrame) -> pl.DataFrame:
    """The reference: every slot of the hour priced in one kernel call, in the order of the
    steps by (replica, start, seq) and of their slots, each request's work summed in that order."""
    ordered = steps.sort("replica", "start_utc_ns", "seq").with_row_index("step")
    keyed = slots.join(
        ordered.select("replica", "seq", pl.col("step").cast(pl.Int64)), on=["replica", "seq"]
    ).sort("step", "slot_index")
    batch = SlotBatch.of_slots(keyed["step"].to_numpy(), ordered.height, keyed)
    fixed_us, slot_us = kernel_weights(pool).kernel.slot_work_many(
        batch.kernel_slots, ordered.height
    )
    work = {
        f"{r}_us": split_fixed(fixed_us[:, i], batch, pool.policies.fixed_cost) + slot_us[:, i]
        for i, r in enumerate(RESOURCES)
    }
    return (
        keyed.select("request_id")
        .with_columns(pl.Series(name, values) for name, values in work.items())
        .group_by("request_id", maintain_order=True)
        .agg(pl.col(name).sum() for name in work)
        .cast(RESOURCE_WORK_SCHEMA)
        .sort("request_id")
    )


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    rows_per_batch=st.integers(1, 80),
    shuffle_seed=st.integers(0, 2**32 - 1),
    fixed_cost=st.sampled_from(["per_slot", "per_token"]),
    kernel_weighted=st.booleans(),
)
def test_any_batch_size_and_row_order_give_the_whole_hours_resource_work(
    seed, rows_per_batch, shuffle_seed, fixed_cost, kernel_weighted
):
    pool = synthetic_pool(fixed_cost=fixed_cost)
    # Every step inside the hour: the reference prices them all.
    log = synthetic_log(pool, steps_per_replica=30, seed=seed, start_ns=HOUR_START_NS + 10**9)
    weights = (
        kernel_weights(pool) if kernel_weighted else FittedWeights(Coefficients(12.0, 0.05, 5e-5))
    )
    expected = _whole_hour_at_once(pool, log.steps, log.slots)
    shuffled = (
        log.steps.sample(fraction=1.0, shuffle=True, seed=shuffle_seed),
        log.slots.sample(fraction=1.0, shuffle=True, seed=shuffle_seed + 1),
        log.holders.sample(fraction=1.0, shuffle=True, seed=shuffle_seed + 2),
    )
    for steps, slots, holders in ((log.steps, log.slots, log.holders), shuffled):
        attributed = attribute_hour(
            HOUR,
            pool,
            steps,
            slots,
            holders,
            log.context,
            weights,
            resource_weights=kernel_weights(pool),
            rows_per_batch=rows_per_batch,
        )
        got = attributed.ledger.resource_work.sort("request_id")
        assert_frame_equal(got, expected, check_exact=True)


def test_without_resource_weights_no_resource_work_is_totalled():
    pool = synthetic_pool()
    log = synthetic_log(pool, steps_per_replica=3)
    attributed = attribute_hour(
        HOUR, pool, log.steps, log.slots, log.holders, log.context, kernel_weights(pool)
    )
    assert_frame_equal(attributed.ledger.resource_work, pl.DataFrame(schema=RESOURCE_WORK_SCHEMA))


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=40),
    rows_per_batch=st.integers(1, 30),
)
def test_batches_cover_the_steps_in_order_and_never_leave_a_step_alone(sizes, rows_per_batch):
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    batches = step_batches(offsets, rows_per_batch, min_steps=2)
    assert batches[0][0] == 0
    assert batches[-1][1] == len(sizes)
    assert all(end == first for (_, end), (first, _) in itertools.pairwise(batches))
    assert all(end - first >= 2 for first, end in batches) or len(sizes) == 1
    # Without a minimum, a batch holds about rows_per_batch rows.
    assert step_batches(np.array([0, 5, 10, 15, 20]), 10) == [(0, 2), (2, 4)]
    assert step_batches(np.array([0, 5, 10, 15]), 10) == [(0, 2), (2, 3)]
    assert step_batches(np.array([0, 5, 10, 15]), 10, min_steps=2) == [(0, 3)]


def test_decode_contexts_count_the_decode_slots_at_each_context_length():
    pool = synthetic_pool()
    slots = pl.DataFrame(
        {
            "new_tokens": [1, 1, 1, 300, 1],
            "context_tokens": [900, 900, 40, 0, 120],
            "prompt_tokens": [100, 100, 30, 300, 200],
        }
    )
    # The prefill chunk (300 new tokens) and the slot still inside its prompt are not decode.
    assert decode_contexts(pool, slots).rows() == [(40, 1), (900, 2)]
    assert decode_contexts(pool, slots).schema == DECODE_CONTEXTS_SCHEMA
