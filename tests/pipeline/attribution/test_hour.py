from __future__ import annotations

from datetime import timedelta

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.attribution.hour import LEDGER_LINE_SCHEMA, REQUEST_COST_SCHEMA, attribute_hour
from pipeline.attribution.layout import AttributionError
from pipeline.attribution.ledger import LINE_KINDS
from pipeline.attribution.synthetic import HOUR, HOUR_START_NS, StepLog, synthetic_log
from pipeline.attribution.synthetic import synthetic_pool as make_pool
from pipeline.attribution.workmodel import Coefficients, FittedWeights, SlotBatch, kernel_work_us

WEIGHTS = FittedWeights(Coefficients(12.0, 0.05, 0.00005))
PER_HOUR = 3_600_000_000  # $3.60 per GPU-hour in nano-dollars


def _attribute(pool, log, hour=HOUR, weights=WEIGHTS):
    return attribute_hour(hour, pool, log.steps, log.slots, log.holders, log.context, weights)


def _one_step_log(
    pool, *, slots, holders=(), context_ids=("a", "b"), retry_cause=None, duration_ns=50_000_000
):
    """One 50 ms step at :10 on r0 with the given slots (request, new, context, blocks, hits)."""
    steps = pl.DataFrame(
        {
            "pool": [pool.name],
            "replica": ["r0"],
            "segment_id": ["s"],
            "seq": [7],
            "start_ns": [0],
            "end_ns": [duration_ns],
            "start_utc_ns": [HOUR_START_NS + 600 * 10**9],
            "end_utc_ns": [HOUR_START_NS + 600 * 10**9 + duration_ns],
            "admission_blocked": [False],
            "free_blocks": [0],
            "total_blocks": [0],
            "num_slots": [len(slots)],
            "num_holders": [len(holders)],
        }
    )
    slot_frame = pl.DataFrame(
        [
            {
                "pool": pool.name,
                "replica": "r0",
                "seq": 7,
                "slot_index": i,
                "request_id": r,
                "new_tokens": t,
                "context_tokens": L,
                "kv_blocks": float(kv),
                "prompt_tokens": L + t if t > 1 else L,
                "prefix_hit_tokens": hits,
                "spec_drafted": 0,
                "spec_accepted": 0,
            }
            for i, (r, t, L, kv, hits) in enumerate(slots)
        ]
    )
    holder_frame = pl.DataFrame(
        [
            {
                "pool": pool.name,
                "replica": "r0",
                "seq": 7,
                "holder_index": i,
                "request_id": r,
                "kv_blocks": float(kv),
                "state": state,
            }
            for i, (r, kv, state) in enumerate(holders)
        ],
        schema={
            "pool": pl.String,
            "replica": pl.String,
            "seq": pl.Int64,
            "holder_index": pl.Int32,
            "request_id": pl.String,
            "kv_blocks": pl.Float64,
            "state": pl.String,
        },
    )
    context = pl.DataFrame(
        {
            "request_id": list(context_ids),
            "tenant": ["acme"] * len(context_ids),
            "feature": ["chat"] * len(context_ids),
            "api_key_id": ["k1"] * len(context_ids),
            "retry_of": [None] * len(context_ids),
            "retry_cause": [retry_cause] * len(context_ids),
        },
        schema={
            c: pl.String
            for c in ("request_id", "tenant", "feature", "api_key_id", "retry_of", "retry_cause")
        },
    )
    return StepLog(steps, slot_frame, holder_frame, context)


@settings(max_examples=12, deadline=None)
@given(
    st.integers(0, 10**6),
    st.sampled_from(["first_writer", "split_by_holders", "cache_read"]),
    st.sampled_from(["spread", "capacity_owner", "spread_then_headroom"]),
    st.sampled_from(["per_slot", "per_token"]),
    st.floats(0.0, 1.0),
    st.integers(0, 2 * 10**9),
)
def test_every_hour_sums_to_its_invoice(seed, prefix_cache, idle, fixed_cost, alpha, gap_ns):
    pool = make_pool(prefix_cache=prefix_cache, idle=idle, fixed_cost=fixed_cost, alpha=alpha)
    log = synthetic_log(
        pool, steps_per_replica=40, seed=seed, gap_ns=gap_ns, start_ns=HOUR_START_NS - gap_ns
    )
    attributed = _attribute(pool, log)
    assert attributed.ledger.amount_nano == 2 * PER_HOUR
    assert int(attributed.ledger.ledger_lines["amount_nano"].sum()) == 2 * PER_HOUR
    costs = attributed.ledger.request_costs
    assert (costs["compute_nano"] + costs["kv_nano"] == costs["amount_nano"]).all()
    assert int(costs["amount_nano"].sum()) - attributed.cache_read_nano == int(
        attributed.replicas["step_cost_nano"].sum()
    )
    assert set(attributed.ledger.ledger_lines["line_kind"]) <= set(LINE_KINDS)


def test_frames_have_exactly_the_warehouse_columns():
    pool = make_pool()
    attributed = _attribute(pool, synthetic_log(pool, steps_per_replica=20))
    assert dict(attributed.ledger.ledger_lines.schema) == LEDGER_LINE_SCHEMA
    assert dict(attributed.ledger.request_costs.schema) == REQUEST_COST_SCHEMA
    assert attributed.ledger.ledger_lines["hour"].unique().to_list() == [HOUR.replace(tzinfo=None)]
    assert attributed.ledger.ledger_lines["weights_version"].unique().to_list() == [WEIGHTS.version]
    assert attributed.ledger.ledger_lines["policy_version"].unique().to_list() == [
        pool.policies.version()
    ]
    assert attributed.ledger.ledger_lines.null_count().sum_horizontal().item() == 0


def test_one_step_split_with_idle_spread_and_headroom():
    # alpha 1: compute only. a: 512-token prefill, b: decode; 50 ms on 1 GPU = 50_000 nano.
    pool = make_pool(alpha=1.0, idle="spread_then_headroom", prefix_cache="split_by_holders")
    log = _one_step_log(pool, slots=[("a", 512, 0, 32, 0), ("b", 1, 3800, 238, 0)])
    attributed = _attribute(pool, log)
    costs = {r["request_id"]: r for r in attributed.ledger.request_costs.iter_rows(named=True)}
    # work a = 6 + 32.1664 ms, b = 6 + 0.24005 ms: a gets 50_000 x 38.1664 / 44.40645.
    assert costs["a"]["amount_nano"] == 42_974
    assert costs["b"]["amount_nano"] == 7_026
    assert costs["a"]["kv_nano"] == 0
    assert costs["a"]["steps"] == 1
    assert costs["a"]["output_tokens"] == 1
    exact = dict(
        zip(
            attributed.request_details["request_id"],
            attributed.request_details["exact_nano"],
            strict=False,
        )
    )
    assert exact["a"] == pytest.approx(50_000 * 38.1664 / 44.40645)
    assert exact["a"] + exact["b"] == pytest.approx(50_000)
    invoice = 2 * PER_HOUR
    idle = invoice - 50_000
    spread_cap = int(invoice * (1 - 0.7))
    lines = {
        (r["line_kind"], r["tenant"], r["feature"]): r["amount_nano"]
        for r in attributed.ledger.ledger_lines.iter_rows(named=True)
    }
    assert lines[("usage", "acme", "chat")] == 50_000
    assert lines[("idle", "acme", "chat")] == spread_cap
    assert lines[("headroom", "support", "(headroom)")] == idle - spread_cap
    assert attributed.headroom_nano == idle - spread_cap
    assert attributed.idle_nano == idle
    assert attributed.busy_ns == 50_000_000
    assert attributed.step_count == 1


def test_holders_pay_memory_time_and_swapped_ones_do_not():
    pool = make_pool(alpha=0.5, idle="capacity_owner")
    log = _one_step_log(
        pool,
        slots=[("a", 1, 100, 10, 0)],
        holders=[("b", 10, "preempted"), ("c", 20, "swapped")],
        context_ids=("a", "b", "c"),
    )
    attributed = _attribute(pool, log)
    amounts = dict(
        zip(
            attributed.ledger.request_costs["request_id"],
            attributed.ledger.request_costs["amount_nano"],
            strict=False,
        )
    )
    # a: 0.5 compute + 0.5 x 10/20 KV; b: 0.5 x 10/20 KV; c swapped out: nothing.
    assert amounts == {"a": 37_500, "b": 12_500, "c": 0}
    memory = dict(
        zip(
            attributed.request_details["request_id"],
            attributed.request_details["kv_block_seconds"],
            strict=False,
        )
    )
    assert memory == pytest.approx({"a": 0.5, "b": 0.5, "c": 0.0})
    lines = attributed.ledger.ledger_lines.filter(pl.col("line_kind") == "idle")
    assert lines.rows(named=True)[0]["tenant"] == "platform"
    assert lines["amount_nano"].sum() == 2 * PER_HOUR - 50_000


def test_platform_timeout_retries_and_missing_context():
    pool = make_pool(idle="capacity_owner")
    log = _one_step_log(
        pool,
        slots=[("a", 1, 100, 10, 0), ("b", 1, 100, 10, 0)],
        context_ids=("a",),
        retry_cause="platform_timeout",
    )
    attributed = _attribute(pool, log)
    kinds = {r["line_kind"]: r for r in attributed.ledger.ledger_lines.iter_rows(named=True)}
    assert kinds["platform_retry"]["tenant"] == "platform"
    assert kinds["platform_retry"]["amount_nano"] == 25_000
    assert kinds["unattributed"]["tenant"] == "(unattributed)"
    assert kinds["unattributed"]["amount_nano"] == 25_000
    assert attributed.unattributed_fraction == 0.5
    assert attributed.unattributed_requests == 1
    caller_pays = make_pool(idle="capacity_owner", platform_pays_platform_retries=False)
    caller_pays_kinds = set(_attribute(caller_pays, log).ledger.ledger_lines["line_kind"])
    assert "platform_retry" not in caller_pays_kinds
    assert "usage" in caller_pays_kinds


def test_cache_read_charges_hits_and_credits_them_back():
    pool = make_pool(
        alpha=1.0, prefix_cache="cache_read", cache_read_fraction=0.1, idle="capacity_owner"
    )
    # a computes 100 prompt tokens (its whole prefill); b hit 400 cached tokens and decodes.
    log = _one_step_log(pool, slots=[("a", 100, 0, 7, 0), ("b", 1, 400, 26, 400)])
    attributed = _attribute(pool, log)
    costs = {r["request_id"]: r for r in attributed.ledger.request_costs.iter_rows(named=True)}
    prefill_rate = costs["a"]["compute_nano"] / 100  # a is the hour's only prefill
    charge = round(400 * prefill_rate * 0.1)
    assert attributed.cache_read_nano == charge
    assert costs["b"]["cached_tokens"] == 400
    assert attributed.cache_saving_nano == round(400 * prefill_rate) - charge
    credit = attributed.ledger.ledger_lines.filter(pl.col("line_kind") == "cache_credit").row(
        0, named=True
    )
    assert credit["amount_nano"] == -charge
    assert credit["tenant"] == "platform"
    assert credit["cached_tokens"] == 400
    assert int(attributed.ledger.ledger_lines["amount_nano"].sum()) == 2 * PER_HOUR


def test_a_step_across_the_boundary_is_billed_in_both_hours_exactly():
    pool = make_pool()
    log = synthetic_log(pool, steps_per_replica=5, start_ns=HOUR_START_NS - 30_000_000)
    first = log.steps.filter(pl.col("seq") == 0).row(0, named=True)
    assert first["start_utc_ns"] < HOUR_START_NS < first["end_utc_ns"]
    this = _attribute(pool, log)
    before = _attribute(pool, log, hour=HOUR - timedelta(hours=1))
    assert before.step_count == 2  # the first step of each replica
    whole = (first["end_utc_ns"] - first["start_utc_ns"]) * PER_HOUR / 3_600_000_000_000
    r0_before = before.replicas.filter(pl.col("replica") == "r0")["step_cost_nano"].item()
    r0_after = (first["end_utc_ns"] - HOUR_START_NS) * PER_HOUR // 3_600_000_000_000
    assert abs(r0_before + r0_after - whole) < 1
    assert (
        int(before.ledger.ledger_lines["amount_nano"].sum())
        == int(this.ledger.ledger_lines["amount_nano"].sum())
        == 2 * PER_HOUR
    )


def test_an_idle_replica_is_all_idle():
    pool = make_pool(replicas=3, idle="capacity_owner")
    log = synthetic_log(pool, steps_per_replica=10)
    steps = log.steps.filter(pl.col("replica") != "r2")
    attributed = attribute_hour(
        HOUR,
        pool,
        steps,
        log.slots.filter(pl.col("replica") != "r2"),
        log.holders.filter(pl.col("replica") != "r2"),
        log.context,
        WEIGHTS,
    )
    r2 = attributed.replicas.filter(pl.col("replica") == "r2").row(0, named=True)
    assert r2["steps"] == 0
    assert r2["idle_nano"] == PER_HOUR


def test_bad_tables_are_named():
    pool = make_pool()
    log = synthetic_log(pool, steps_per_replica=3)
    with pytest.raises(AttributionError, match=r"replica\(s\) \['r9'\] not in pool 'chat'"):
        attribute_hour(
            HOUR,
            pool,
            log.steps.with_columns(pl.lit("r9").alias("replica")),
            log.slots,
            log.holders,
            log.context,
            WEIGHTS,
        )
    orphan = log.slots.head(1).with_columns(pl.lit(999, dtype=pl.Int64).alias("seq"))
    with pytest.raises(AttributionError, match="slots: 1 row.* belong to no logged step"):
        attribute_hour(
            HOUR, pool, log.steps, pl.concat([log.slots, orphan]), log.holders, log.context, WEIGHTS
        )
    with pytest.raises(AttributionError, match="ends before it starts"):
        attribute_hour(
            HOUR,
            pool,
            log.steps.with_columns(pl.col("start_utc_ns") + 10**12),
            log.slots,
            log.holders,
            log.context,
            WEIGHTS,
        )
    with pytest.raises(AttributionError, match="context table lacks column"):
        attribute_hour(
            HOUR, pool, log.steps, log.slots, log.holders, log.context.drop("retry_cause"), WEIGHTS
        )


class _FakeKernel:
    """A kernel stand-in: 30 us fixed per step, each slot 2 us per token plus 1 us per 1000 context."""

    kv_bytes_per_token = 131072

    def slot_work_many(self, slots, n_steps):
        fixed = np.zeros((n_steps, 5))
        fixed[:, 0] = 30.0
        slot = np.zeros((len(slots.step_index), 5))
        slot[:, 0] = 2.0 * np.asarray(slots.scheduled)
        slot[:, 1] = np.asarray(slots.computed) / 1000.0
        return fixed, slot


def test_kernel_weights_split_fixed_per_policy_and_price_bytes():
    batch = SlotBatch(
        np.array([0, 0]), 1, np.array([10, 1]), np.array([0, 4000]), np.array([10, 100])
    )
    fixed, slot = _FakeKernel().slot_work_many(batch.kernel_slots, batch.n_steps)
    assert kernel_work_us(fixed, slot, batch, "per_slot").tolist() == [35.0, 21.0]
    assert kernel_work_us(fixed, slot, batch, "per_token").tolist() == pytest.approx(
        [20 + 30 * 10 / 11, 6 + 30 / 11]
    )
    from pipeline.attribution.workmodel import KernelWeights

    pool = make_pool(alpha=1.0)
    log = _one_step_log(pool, slots=[("a", 10, 0, 1, 0), ("b", 1, 4000, 250, 0)])
    attributed = _attribute(pool, log, weights=KernelWeights(_FakeKernel(), "kernel-test"))
    amounts = dict(
        zip(
            attributed.ledger.request_costs["request_id"],
            attributed.ledger.request_costs["amount_nano"],
            strict=False,
        )
    )
    assert amounts == {"a": 31_250, "b": 18_750}  # 35 : 21
    assert attributed.request_details.filter(pl.col("request_id") == "b")[
        "kv_byte_seconds"
    ].item() == pytest.approx(250 * 0.05 * 16 * 131072)
    assert attributed.weights_version == "kernel-test"


def test_an_hour_without_steps_is_all_idle_and_still_sums():
    pool = make_pool(idle="spread")
    log = synthetic_log(pool, steps_per_replica=3)
    attributed = attribute_hour(
        HOUR, pool, log.steps.head(0), log.slots.head(0), log.holders.head(0), log.context, WEIGHTS
    )
    assert attributed.ledger.request_costs.height == 0
    assert attributed.step_count == 0
    assert attributed.ledger.ledger_lines.select(
        "tenant", "feature", "line_kind", "amount_nano"
    ).rows() == [("platform", "(idle)", "idle", 2 * PER_HOUR)]
