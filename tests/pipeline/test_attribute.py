"""resource_parts prices an hour's slots a batch of steps at a time, from rows in any order:
its figures must be those of pricing the whole hour at once."""

from __future__ import annotations

import itertools

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from polars.testing import assert_frame_equal

from pipeline.attribute import resource_parts
from pipeline.attribution.hour import step_batches
from pipeline.attribution.layout import AttributionError
from pipeline.attribution.synthetic import HOUR_START_NS, synthetic_log, synthetic_pool
from pipeline.attribution.workmodel import SlotBatch, split_fixed
from pipeline.lake import HourInput
from pipeline.ledger import DECODE_CONTEXTS_SCHEMA, RESOURCE_WORK_SCHEMA, RESOURCES
from pipeline.weights import kernel_weights


def _whole_hour_at_once(pool, data: HourInput) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The reference: every slot of the hour priced in one kernel call, in (step, slot) order
    (a step's place is its row in `data.steps`)."""
    steps = data.steps.with_row_index("step").select(
        "replica", "seq", pl.col("step").cast(pl.Int64)
    )
    slots = data.slots.join(steps, on=["replica", "seq"]).sort("step", "slot_index")
    batch = SlotBatch.of_slots(slots["step"].to_numpy(), steps.height, slots)
    fixed_us, slot_us = kernel_weights(pool).kernel.slot_work_many(batch.kernel_slots, steps.height)
    work = {
        f"{r}_us": split_fixed(fixed_us[:, i], batch, pool.policies.fixed_cost) + slot_us[:, i]
        for i, r in enumerate(RESOURCES)
    }
    resource_work = (
        slots.select("request_id")
        .with_columns(pl.Series(name, values) for name, values in work.items())
        .group_by("request_id", maintain_order=True)
        .agg(pl.col(name).sum() for name in work)
        .cast(RESOURCE_WORK_SCHEMA)
    )
    decode = (slots["context_tokens"] >= slots["prompt_tokens"]) & (
        slots["new_tokens"] <= pool.engine.decode_threshold
    )
    decode_contexts = (
        slots.filter(decode)
        .group_by("context_tokens")
        .agg(pl.len().alias("slots"))
        .sort("context_tokens")
        .cast(DECODE_CONTEXTS_SCHEMA)
    )
    return resource_work, decode_contexts


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    rows_per_batch=st.integers(1, 80),
    shuffle_seed=st.integers(0, 2**32 - 1),
    fixed_cost=st.sampled_from(["per_slot", "per_token"]),
)
def test_any_batch_size_and_row_order_give_the_whole_hours_figures(
    seed, rows_per_batch, shuffle_seed, fixed_cost
):
    pool = synthetic_pool(fixed_cost=fixed_cost)
    log = synthetic_log(pool, steps_per_replica=30, seed=seed, start_ns=HOUR_START_NS - 10**9)
    data = HourInput(log.steps, log.slots, log.holders)
    shuffled = HourInput(
        log.steps.sample(fraction=1.0, shuffle=True, seed=shuffle_seed),
        log.slots.sample(fraction=1.0, shuffle=True, seed=shuffle_seed + 1),
        log.holders,
    )
    # Slots in any order; steps in any order too, which sets the order the slots are summed in.
    for hour in (data, shuffled):
        batched = resource_parts(pool, hour, rows_per_batch=rows_per_batch)
        for got, expected in zip(batched, _whole_hour_at_once(pool, hour), strict=True):
            assert_frame_equal(got, expected, check_exact=True)


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=40),
    rows_per_batch=st.integers(1, 30),
)
def test_batches_cover_the_steps_in_order_and_never_leave_a_step_alone(sizes, rows_per_batch):
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    batches = step_batches(offsets, rows_per_batch, min_steps=2)
    assert batches[0][0] == 0 and batches[-1][1] == len(sizes)
    assert all(end == first for (_, end), (first, _) in itertools.pairwise(batches))
    assert all(end - first >= 2 for first, end in batches) or len(sizes) == 1
    # Without a minimum, a batch holds about rows_per_batch rows.
    assert step_batches(np.array([0, 5, 10, 15, 20]), 10) == [(0, 2), (2, 4)]
    assert step_batches(np.array([0, 5, 10, 15]), 10) == [(0, 2), (2, 3)]
    assert step_batches(np.array([0, 5, 10, 15]), 10, min_steps=2) == [(0, 3)]


def test_a_slot_of_no_logged_step_is_named():
    pool = synthetic_pool()
    log = synthetic_log(pool, steps_per_replica=3)
    stray = log.slots.with_columns(
        pl.when(pl.int_range(pl.len()) == 1).then(999).otherwise(pl.col("seq")).alias("seq")
    )
    with pytest.raises(AttributionError, match="slots: 1 row.* belong to no logged step"):
        resource_parts(pool, HourInput(log.steps, stray, log.holders))
