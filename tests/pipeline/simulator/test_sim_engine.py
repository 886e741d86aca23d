"""The simulated scheduler behaves like a continuous-batching engine with paged, shared KV blocks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.simulator.engine import FINISHED, Engine, EngineConfig, StepBatch

STEP_NS = 10_000_000


@dataclass
class Trace:
    engine: Engine
    batches: list[StepBatch]

    def steps(self):
        """(slots, holders, batch, step index within batch) per step, in order."""
        for batch in self.batches:
            slot_end = np.cumsum(batch.step_num_slots)
            holder_end = np.cumsum(batch.step_num_holders)
            for j in range(batch.steps):
                a, b = slot_end[j] - batch.step_num_slots[j], slot_end[j]
                h0, h1 = holder_end[j] - batch.step_num_holders[j], holder_end[j]
                yield slice(a, b), slice(h0, h1), batch, j


def run_to_completion(engine: Engine, chunk: int = 16, max_batches: int = 100_000) -> Trace:
    """Drive the engine with a clock that advances STEP_NS per step until every request finished."""
    now = 0
    batches: list[StepBatch] = []
    for _ in range(max_batches):
        if not engine.has_work:
            upcoming = engine.next_arrival_ns
            if upcoming is None:
                return Trace(engine, batches)
            now = max(now, upcoming)
        batch = engine.run(chunk, visible_until_ns=now)
        batches.append(batch)
        now += max(batch.steps, 1) * STEP_NS
    raise AssertionError("engine did not finish its requests")


def make_engine(
    n: int,
    seed: int,
    *,
    total_blocks: int = 2000,
    prefix_blocks=(8, 0),
    max_num_seqs: int = 64,
    budget: int = 2048,
    spec: int = 0,
    prompt_max: int = 1500,
    output_max: int = 300,
    rate_per_s: float = 50.0,
) -> Engine:
    rng = np.random.default_rng(seed)
    prefix = np.asarray(prefix_blocks, np.int64)
    feature = rng.integers(0, prefix.shape[0], n)
    prompt = prefix[feature] * 16 + rng.integers(1, prompt_max, n)
    output = rng.integers(1, output_max, n)
    arrival = np.cumsum(rng.exponential(1e9 / rate_per_s, n)).astype(np.int64)
    config = EngineConfig(
        block_size=16,
        total_blocks=total_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        num_spec_tokens=spec,
        spec_accept_prob=0.6,
    )
    return Engine(config, arrival, prompt, output, feature, prefix, seed=seed)


def check_invariants(trace: Trace) -> None:
    engine = trace.engine
    cfg = engine.config
    # Each request's context length after its latest step.
    context: dict[int, int] = {}
    for slots, holders, batch, j in trace.steps():
        requests = batch.slot_request[slots]
        assert len(set(requests.tolist())) == requests.shape[0], "a request twice in one step"
        assert requests.shape[0] <= cfg.max_num_seqs
        assert batch.new_tokens[slots].sum() <= cfg.max_num_batched_tokens
        assert (batch.new_tokens[slots] >= 1).all()
        # Every block in use is held by a slot or a holder; shared blocks split 1/k.
        held = batch.kv_blocks[slots].sum() + batch.holder_kv_blocks[holders].sum()
        assert batch.free_blocks[j] >= 0
        assert abs(held - (cfg.total_blocks - batch.free_blocks[j])) < 1e-6
        drafted, accepted = batch.spec_drafted[slots], batch.spec_accepted[slots]
        assert (drafted <= cfg.num_spec_tokens).all()
        assert (accepted <= drafted).all()
        assert (drafted < batch.new_tokens[slots]).all() | (drafted == 0).all()
        for r, new, ctx, d, a, hit in zip(
            requests.tolist(),
            batch.new_tokens[slots].tolist(),
            batch.context_tokens[slots].tolist(),
            drafted.tolist(),
            accepted.tolist(),
            batch.prefix_hit_tokens[slots].tolist(),
            strict=False,
        ):
            expected = context.get(r)
            if expected is None or ctx != expected:
                # A (re)start: context is the cached system prompt or nothing.
                prefix_tokens = int(engine.prefix_blocks[engine.feature[r]]) * cfg.block_size
                assert ctx in (0, prefix_tokens), (r, ctx, expected)
                assert hit in (0, ctx)
            context[r] = ctx + new - (d - a)
    assert (engine.status == FINISHED).all()
    assert (engine.generated == engine.output_tokens).all()
    # The KV cache of a finished request holds prompt + output - 1 tokens (the last sample is never fed back).
    final = np.array([context[r] for r in range(engine.arrival_ns.shape[0])])
    assert (final == engine.prompt_tokens + engine.output_tokens - 1).all()
    assert engine.used_blocks == 0


def test_requests_finish_with_exact_token_counts_and_no_overcommit():
    trace = run_to_completion(make_engine(300, seed=1, total_blocks=8000))
    check_invariants(trace)
    assert trace.engine.total_preemptions == 0


def test_prefix_hits_reduce_prefill_work_by_exactly_the_hit_tokens():
    shared = run_to_completion(make_engine(200, seed=2, prefix_blocks=(32,), total_blocks=8000))
    check_invariants(shared)
    hits = sum(int(b.prefix_hit_tokens.sum()) for b in shared.batches)
    computed = sum(
        int((b.new_tokens - b.spec_drafted + b.spec_accepted).sum()) for b in shared.batches
    )
    needed = int((shared.engine.prompt_tokens + shared.engine.output_tokens - 1).sum())
    assert shared.engine.total_preemptions == 0
    # All but the request that wrote the prefix (and any admitted while it was still being
    # written) hit the whole 512-token system prompt.
    assert hits >= 512 * 190
    assert computed == needed - hits


def test_shared_prefix_blocks_count_one_kth_to_each_holder():
    engine = make_engine(40, seed=3, prefix_blocks=(10,), rate_per_s=1e6, output_max=50)
    trace = run_to_completion(engine)
    checked = 0
    for slots, holders, batch, _ in trace.steps():
        fractions = np.round(
            np.concatenate([batch.kv_blocks[slots], batch.holder_kv_blocks[holders]]) % 1, 9
        )
        shared = fractions[fractions > 0]
        if shared.shape[0]:
            # Every sharer carries private blocks plus 10/k of the prefix, k = number of sharers.
            assert set(shared.tolist()) == {round(10 / shared.shape[0] % 1, 9)}
            checked += 1
    assert checked > 10


def test_preemption_and_blocked_admission_under_block_pressure():
    engine = make_engine(
        120,
        seed=4,
        total_blocks=400,
        prompt_max=3000,
        output_max=800,
        rate_per_s=200.0,
        max_num_seqs=32,
    )
    trace = run_to_completion(engine)
    check_invariants(trace)
    assert engine.total_preemptions > 0
    assert (engine.preemptions > 0).sum() > 0
    assert sum(int(b.admission_blocked.sum()) for b in trace.batches) > 0
    assert sum(int(b.preempted.sum()) for b in trace.batches) == engine.total_preemptions


def test_speculative_decoding_counts_drafts_in_new_tokens():
    engine = make_engine(80, seed=5, spec=3)
    trace = run_to_completion(engine)
    check_invariants(trace)
    drafted = sum(int(b.spec_drafted.sum()) for b in trace.batches)
    accepted = sum(int(b.spec_accepted.sum()) for b in trace.batches)
    assert drafted > 0
    assert 0 < accepted < drafted
    decode = np.concatenate(
        [
            b.new_tokens[b.spec_drafted > 0] - b.spec_drafted[b.spec_drafted > 0]
            for b in trace.batches
        ]
    )
    assert (decode == 1).all()


def test_holders_are_running_requests_left_out_by_the_token_budget():
    # Decoders that draft need 1 + 3 tokens each: more of them than the budget admits wait as holders.
    engine = make_engine(
        60,
        seed=6,
        budget=16,
        spec=3,
        rate_per_s=1e5,
        prompt_max=20,
        output_max=100,
        prefix_blocks=(0,),
    )
    trace = run_to_completion(engine)
    check_invariants(trace)
    held = sum(int(b.step_num_holders.sum()) for b in trace.batches)
    assert held > 0
    for slots, holders, batch, _ in trace.steps():
        assert not set(batch.holder_request[holders].tolist()) & set(
            batch.slot_request[slots].tolist()
        )


def test_the_same_seed_gives_the_same_schedule():
    first = run_to_completion(make_engine(100, seed=7, spec=2))
    second = run_to_completion(make_engine(100, seed=7, spec=2))
    for a, b in zip(first.batches, second.batches, strict=True):
        for name in (
            "slot_request",
            "new_tokens",
            "context_tokens",
            "kv_blocks",
            "spec_accepted",
            "free_blocks",
        ):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def test_a_request_larger_than_the_cache_is_refused_with_its_size():
    config = EngineConfig(block_size=16, total_blocks=10, max_num_seqs=4, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="needs 13 KV blocks but the replica has 10"):
        Engine(config, np.array([0]), np.array([200]), np.array([1]), np.array([0]), np.array([0]))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 60),
    seed=st.integers(0, 2**16),
    total_blocks=st.integers(200, 1500),
    max_num_seqs=st.integers(1, 48),
    budget=st.integers(16, 1024),
    spec=st.integers(0, 3),
    prefix=st.lists(st.integers(0, 6), min_size=1, max_size=3),
)
def test_scheduler_invariants_hold_for_any_workload(
    n, seed, total_blocks, max_num_seqs, budget, spec, prefix
):
    engine = make_engine(
        n,
        seed,
        total_blocks=total_blocks,
        prefix_blocks=prefix,
        max_num_seqs=max_num_seqs,
        budget=budget,
        spec=spec,
        prompt_max=1200,
        output_max=200,
        rate_per_s=500.0,
    )
    check_invariants(run_to_completion(engine, chunk=7))
