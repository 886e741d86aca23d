"""The per-step allocation rows attribute_hour keeps for chosen requests are the shares it
bills: every request's rows sum to its request cost and every step's rows to the step's cost,
and choosing requests changes nothing billed."""

from __future__ import annotations

import polars as pl
from hypothesis import given, settings
from hypothesis import strategies as st
from polars.testing import assert_frame_equal

from pipeline.attribution.hour import attribute_hour
from pipeline.attribution.kv import ACCRUING_STATES, NON_ACCRUING_STATES
from pipeline.attribution.synthetic import HOUR, HOUR_START_NS, synthetic_log, synthetic_pool
from pipeline.attribution.workmodel import Coefficients, FittedWeights

WEIGHTS = FittedWeights(Coefficients(12.0, 0.05, 0.00005))


def _hour(seed: int = 0, gap_ns: int = 5_000_000, **policies):
    pool = synthetic_pool(**policies)
    log = synthetic_log(
        pool, steps_per_replica=40, seed=seed, gap_ns=gap_ns, start_ns=HOUR_START_NS - 20 * gap_ns
    )
    return pool, log


def _attribute(pool, log, **options):
    return attribute_hour(
        HOUR, pool, log.steps, log.slots, log.holders, log.context, WEIGHTS, **options
    )


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    prefix_cache=st.sampled_from(["first_writer", "split_by_holders", "cache_read"]),
    fixed_cost=st.sampled_from(["per_slot", "per_token"]),
    alpha=st.floats(0.0, 1.0),
    gap_ns=st.integers(0, 800_000_000),
    rows_per_batch=st.integers(1, 60),
)
def test_every_requests_rows_sum_to_its_billed_cost(
    seed, prefix_cache, fixed_cost, alpha, gap_ns, rows_per_batch
):
    pool, log = _hour(seed, gap_ns, prefix_cache=prefix_cache, fixed_cost=fixed_cost, alpha=alpha)
    attributed = _attribute(pool, log, allocations_of="all", rows_per_batch=rows_per_batch)
    rows = attributed.allocations
    summed = rows.group_by("request_id").agg(
        pl.col("share_nano").sum().alias("shares"),
        pl.col("compute_nano").sum().alias("compute_shares"),
        pl.col("kv_nano").sum().alias("kv_shares"),
    )
    billed = attributed.ledger.request_costs.join(
        attributed.request_details.select("request_id", "cache_read_nano"), on="request_id"
    ).join(summed, on="request_id", how="full", coalesce=True)
    # Every billed request has rows and every request with rows is billed.
    assert billed.select("amount_nano", "shares").null_count().rows() == [(0, 0)]
    for request in billed.iter_rows(named=True):
        assert request["shares"] + request["cache_read_nano"] == request["amount_nano"], request
        assert request["compute_shares"] + request["cache_read_nano"] == request["compute_nano"]
        assert request["kv_shares"] == request["kv_nano"], request
    # A step carried by work or blocks is shared out exactly; one carried by nothing is idle.
    steps = rows.group_by("step").agg(
        pl.col("share_nano").sum(),
        pl.col("cost_nano").first(),
        carried=(pl.col("step_work").first() > 0) | (pl.col("step_kv_blocks").first() > 0),
    )
    assert steps.filter(pl.col("carried"))["share_nano"].to_list() == (
        steps.filter(pl.col("carried"))["cost_nano"].to_list()
    )
    assert set(steps.filter(~pl.col("carried"))["share_nano"].to_list()) <= {0}
    assert int(rows["cost_nano"].min() or 0) >= 0
    assert set(rows["role"]) <= {"slot", *ACCRUING_STATES, *NON_ACCRUING_STATES}


def test_choosing_requests_changes_nothing_billed_and_keeps_only_theirs():
    pool, log = _hour(seed=7, prefix_cache="first_writer")
    plain = _attribute(pool, log)
    everyone = _attribute(pool, log, allocations_of="all", rows_per_batch=50)
    chosen = sorted(set(log.slots["request_id"]))[:3]
    some = _attribute(pool, log, allocations_of=chosen)
    assert plain.allocations.height == 0
    assert some.allocations["request_id"].unique().sort().to_list() == chosen
    assert_frame_equal(
        some.allocations, everyone.allocations.filter(pl.col("request_id").is_in(chosen))
    )
    for attributed in (everyone, some):
        assert attributed.ledger.invoice == plain.ledger.invoice
        for table in ("ledger_lines", "request_costs", "resource_work", "decode_contexts"):
            assert_frame_equal(getattr(attributed.ledger, table), getattr(plain.ledger, table))
        assert_frame_equal(attributed.request_details, plain.request_details)
