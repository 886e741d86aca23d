"""attribute_hour processes an hour a batch of steps at a time, from rows in any order: the
ledger must not depend on either."""

from __future__ import annotations

from dataclasses import replace

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from polars.testing import assert_frame_equal

from pipeline.attribution.hour import ROWS_PER_BATCH, attribute_hour
from pipeline.attribution.layout import AttributionError
from pipeline.attribution.synthetic import HOUR, HOUR_START_NS, synthetic_log, synthetic_pool
from pipeline.attribution.workmodel import Coefficients, FittedWeights

WEIGHTS = FittedWeights(Coefficients(12.0, 0.05, 0.00005))


def _attribute(pool, log, *, rows_per_batch: int = ROWS_PER_BATCH):
    return attribute_hour(
        HOUR,
        pool,
        log.steps,
        log.slots,
        log.holders,
        log.context,
        WEIGHTS,
        rows_per_batch=rows_per_batch,
    )


def _assert_same_ledger(expected, actual) -> None:
    for name in ("request_costs", "ledger_lines", "resource_work", "decode_contexts"):
        assert_frame_equal(
            getattr(expected.ledger, name), getattr(actual.ledger, name), check_exact=True
        )
    assert expected.ledger.invoice == actual.ledger.invoice
    for name in ("replicas", "request_details"):
        assert_frame_equal(getattr(expected, name), getattr(actual, name), check_exact=True)
    for name in (
        "step_count",
        "busy_ns",
        "usage_nano",
        "idle_nano",
        "headroom_nano",
        "cache_read_nano",
        "cache_saving_nano",
        "unattributed_nano",
        "platform_retry_nano",
    ):
        assert getattr(expected, name) == getattr(actual, name), name


_POLICIES = dict(
    seed=st.integers(0, 10**6),
    prefix_cache=st.sampled_from(["first_writer", "split_by_holders", "cache_read"]),
    fixed_cost=st.sampled_from(["per_slot", "per_token"]),
    alpha=st.floats(0.0, 1.0),
    # Up to half a minute of 20-40 step logs before the hour: some steps fall outside it.
    gap_ns=st.integers(0, 800_000_000),
)


@settings(max_examples=15, deadline=None)
@given(rows_per_batch=st.integers(1, 60), **_POLICIES)
def test_any_batch_size_gives_the_same_ledger(
    rows_per_batch, seed, prefix_cache, fixed_cost, alpha, gap_ns
):
    pool = synthetic_pool(prefix_cache=prefix_cache, fixed_cost=fixed_cost, alpha=alpha)
    log = synthetic_log(
        pool, steps_per_replica=40, seed=seed, gap_ns=gap_ns, start_ns=HOUR_START_NS - 20 * gap_ns
    )
    _assert_same_ledger(_attribute(pool, log), _attribute(pool, log, rows_per_batch=rows_per_batch))


@settings(max_examples=15, deadline=None)
@given(shuffle_seed=st.integers(0, 2**32 - 1), **_POLICIES)
def test_rows_in_any_order_give_the_same_ledger(
    shuffle_seed, seed, prefix_cache, fixed_cost, alpha, gap_ns
):
    pool = synthetic_pool(prefix_cache=prefix_cache, fixed_cost=fixed_cost, alpha=alpha)
    log = synthetic_log(
        pool, steps_per_replica=40, seed=seed, gap_ns=gap_ns, start_ns=HOUR_START_NS - 20 * gap_ns
    )
    shuffled = replace(
        log,
        steps=log.steps.sample(fraction=1.0, shuffle=True, seed=shuffle_seed),
        slots=log.slots.sample(fraction=1.0, shuffle=True, seed=shuffle_seed + 1),
        holders=log.holders.sample(fraction=1.0, shuffle=True, seed=shuffle_seed + 2),
    )
    _assert_same_ledger(_attribute(pool, log), _attribute(pool, shuffled, rows_per_batch=17))


def test_a_step_logged_twice_around_the_hour_is_an_error():
    pool = synthetic_pool()
    log = synthetic_log(pool, steps_per_replica=3)
    first = log.steps.row(0, named=True)
    # The same (replica, seq) again, a day earlier: its slots could belong to either.
    copy = log.steps.head(1).with_columns(pl.col("start_utc_ns", "end_utc_ns") - 86_400 * 10**9)
    message = f"steps: replica {first['replica']} seq {first['seq']} appears more than once"
    with pytest.raises(AttributionError, match=message):
        attribute_hour(
            HOUR, pool, pl.concat([log.steps, copy]), log.slots, log.holders, log.context, WEIGHTS
        )


def test_rows_without_keys_are_named():
    pool = synthetic_pool()
    log = synthetic_log(pool, steps_per_replica=3)
    anonymous = log.slots.with_columns(
        pl.when(pl.int_range(pl.len()) == 2)
        .then(None)
        .otherwise(pl.col("request_id"))
        .alias("request_id")
    )
    with pytest.raises(AttributionError, match="slots: 1 row.* have no request_id"):
        attribute_hour(HOUR, pool, log.steps, anonymous, log.holders, log.context, WEIGHTS)
    unsequenced = log.holders.with_columns(pl.lit(None, dtype=pl.Int64).alias("seq"))
    with pytest.raises(AttributionError, match=f"holders: {log.holders.height} row.* have no seq"):
        attribute_hour(HOUR, pool, log.steps, log.slots, unsequenced, log.context, WEIGHTS)
