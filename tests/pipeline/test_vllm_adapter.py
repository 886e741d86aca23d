"""The adapter's own logic (block shares, header, version check) and one test per shim of an
attribute that moved between vLLM releases. The mapping from the scheduler's state is tested
on vLLM's real scheduler in test_vllm_conformance.py."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import vllm
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm import SamplingParams
from vllm.config import ParallelConfig
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

import pipeline.vllm_adapter as adapter
from pipeline.steplog import StepRecorder, read_segments
from schemas.config import ConfigError, load_pools
from tests.pipeline.vllm_engine import HAS_REQ_ID_TO_INDEX


@dataclass
class KVCacheManager:
    """Per-group request -> KVCacheBlock lists, as `coordinator.single_type_managers[g]
    .req_to_blocks` in vllm/v1/core/kv_cache_coordinator.py; block 0 is the null block."""

    held: dict[str, tuple[list[int], ...]]
    num_gpu_blocks: int = 64
    coordinator: SimpleNamespace = field(init=False)
    block_pool: SimpleNamespace = field(init=False)

    def __post_init__(self) -> None:
        ref_counts: dict[int, int] = {}
        for groups in self.held.values():
            for block in (b for group in groups for b in group if b):
                ref_counts[block] = ref_counts.get(block, 0) + 1
        blocks = [
            SimpleNamespace(block_id=i, ref_cnt=ref_counts.get(i, 0), is_null=i == 0)
            for i in range(self.num_gpu_blocks)
        ]
        self.block_pool = SimpleNamespace(null_block=blocks[0])
        groups = max(len(g) for g in self.held.values())
        self.coordinator = SimpleNamespace(
            single_type_managers=[
                SimpleNamespace(
                    req_to_blocks={
                        request: [blocks[b] for b in lists[group]]
                        for request, lists in self.held.items()
                        if group < len(lists)
                    }
                )
                for group in range(groups)
            ]
        )


def test_block_shares_split_shared_prefixes_and_skip_null_blocks():
    kv = KVCacheManager(
        held={
            "a": ([1, 2, 3, 4],),
            "b": ([1, 2, 5],),
            "c": ([1, 6],),
            "window": ([0, 0, 7, 8],),
            "window-twin": ([0, 7, 9],),
        }
    )
    shares = adapter.block_snapshot(kv)
    # Block 1 is held by three requests, block 2 by two, block 7 by two.
    assert shares.held(["a", "b", "c", "window", "window-twin", "none"]).tolist() == [
        1 / 3 + 1 / 2 + 2,
        1 / 3 + 1 / 2 + 1,
        1 / 3 + 1,
        1 / 2 + 1,
        1 / 2 + 1,
        0.0,
    ]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 4)), min_size=1, max_size=8))
def test_block_shares_of_all_holders_sum_to_the_blocks_held(requests):
    """Requests share prefixes of one cached chain (blocks 1-6), then own private blocks."""
    held, next_private = {}, 100
    for index, (shared, private) in enumerate(requests):
        held[f"r{index}"] = (
            list(range(1, shared + 1)) + list(range(next_private, next_private + private)),
        )
        next_private += private
    kv = KVCacheManager(held=held, num_gpu_blocks=200)
    shares = adapter.block_snapshot(kv).held(list(held))
    distinct = {block for groups in held.values() for block in groups[0]}
    assert math.isclose(shares.sum(), len(distinct), rel_tol=1e-12)
    expected = [
        sum(1 / sum(b in other[0] for other in held.values()) for b in groups[0])
        for groups in held.values()
    ]
    assert np.allclose(shares, expected, rtol=1e-12, atol=0)


def test_block_snapshot_keeps_the_shares_of_the_moment_it_was_taken():
    kv = KVCacheManager(held={"a": ([1, 2, 3],), "b": ([1, 2],), "c": ([1, 4],)})
    snapshot = adapter.block_snapshot(kv)
    lists = kv.coordinator.single_type_managers[0].req_to_blocks
    # What vLLM does to the live lists after schedule() returns: a new block appended, a
    # shared block replaced in place by a private copy, a request's list freed.
    lists["a"].append(SimpleNamespace(block_id=5))
    lists["b"][1] = SimpleNamespace(block_id=6)
    del lists["c"]
    assert snapshot.held(["a", "b", "c"]).tolist() == [1 / 3 + 1 / 2 + 1, 1 / 3 + 1 / 2, 1 / 3 + 1]


def test_header_checks_the_pools_file():
    pool = load_pools().pools[0]
    replica = pool.replicas[0].id
    header = adapter.header_for(pool, replica, "0.11.0", "550.54.15", pool.gpus_per_replica, 16)
    assert (header.pool, header.replica, header.model, header.gpu_type) == (
        pool.name,
        replica,
        pool.model,
        pool.gpu_type,
    )
    with pytest.raises(ConfigError, match="runs on 3 GPUs"):
        adapter.header_for(pool, replica, "0.11.0", "550", 3, 16)
    with pytest.raises(ConfigError, match="not listed in pool"):
        adapter.header_for(pool, "nope", "0.11.0", "550", pool.gpus_per_replica, 16)


def test_driver_version_from_environment(monkeypatch):
    monkeypatch.setenv("STEPLEDGER_DRIVER_VERSION", "550.54.15")
    assert adapter.driver_version() == "550.54.15"


@pytest.mark.parametrize("version", ["0.33.0", "0.33.4", "0.34.0", "0.34.1rc1"])
def test_supported_versions_start(version):
    adapter.check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.11.0", "0.32.1", "0.35.0", "1.0.0", "dev"])
def test_unsupported_versions_are_refused_by_name(version):
    with pytest.raises(adapter.UnsupportedVllmVersion) as refused:
        adapter.check_vllm_version(version)
    assert str(refused.value) == (
        f"the step-recording scheduler does not support vLLM {version}; "
        "supported: vllm>=0.33.0,<0.35.0 (0.33.x, 0.34.x)"
    )


def test_an_unsupported_vllm_is_refused_when_the_class_is_requested(monkeypatch):
    monkeypatch.setattr(adapter, "_BUILT", {})
    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    with pytest.raises(adapter.UnsupportedVllmVersion, match="vLLM 0.32.0"):
        adapter.AsyncRecordingScheduler  # noqa: B018
    with pytest.raises(AttributeError):
        adapter.NotAScheduler  # noqa: B018


def test_recording_classes_subclass_vllms_schedulers():
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    assert adapter.RecordingScheduler.__bases__ == (Scheduler,)
    assert adapter.AsyncRecordingScheduler.__bases__ == (AsyncScheduler,)
    assert adapter.AsyncRecordingScheduler.__name__ == "RecordingAsyncScheduler"


@pytest.mark.skipif(not HAS_REQ_ID_TO_INDEX, reason="this vLLM has no req_id_to_index")
def test_sampled_index_from_req_id_to_index_as_in_0_33():
    output = ModelRunnerOutput(
        req_ids=["x", "y"], req_id_to_index={"x": 1, "y": 0}, sampled_token_ids=[[1], [2, 3]]
    )
    assert adapter.sampled_index(output) == {"x": 1, "y": 0}


def test_sampled_index_from_req_ids_as_in_0_34():
    # vLLM 0.34's ModelRunnerOutput has no req_id_to_index: rows follow req_ids.
    shaped_as_0_34 = SimpleNamespace if HAS_REQ_ID_TO_INDEX else ModelRunnerOutput
    output = shaped_as_0_34(req_ids=["x", "y", "z"], sampled_token_ids=[[1], [2, 3], []])
    assert adapter.sampled_index(output) == {"x": 0, "y": 1, "z": 2}
    step = adapter.ScheduledStep(
        request_ids=["z", "y", "x"],
        new_tokens=[1, 3, 1],
        context_tokens=[5, 5, 5],
        blocks=adapter.block_snapshot(KVCacheManager(held={"x": ([1],)})),
        prompt_tokens=[4, 4, 4],
        prefix_hit_tokens=[0, 0, 0],
        spec_drafted=[0, 2, 0],
    )
    assert adapter.accepted_tokens(step, output) == [0, 1, 0]


def test_prefix_hit_tokens_from_prefill_stats():
    request = Request("r", list(range(40)), SamplingParams(max_tokens=1), None)
    assert adapter.prefix_hit_tokens(request) == 0
    request.prefill_stats.set(
        num_prompt_tokens=40, num_local_cached_tokens=16, num_external_cached_tokens=16
    )
    assert adapter.prefix_hit_tokens(request) == 32
    request.take_prefill_stats()
    assert adapter.prefix_hit_tokens(request) == 0


@pytest.mark.parametrize(("pp", "tp", "pcp", "gpus"), [(1, 1, 1, 1), (2, 4, 1, 8), (2, 2, 2, 8)])
def test_gpus_per_replica_is_pipeline_tensor_and_prefill_context_parallel(pp, tp, pcp, gpus):
    parallel = ParallelConfig(
        pipeline_parallel_size=pp, tensor_parallel_size=tp, prefill_context_parallel_size=pcp
    )
    assert adapter.gpus_per_replica(parallel) == gpus == parallel.world_size


def test_a_step_whose_columns_fail_to_build_is_rejected_and_left_as_a_drop(
    tmp_path, header, caplog
):
    outbox = tmp_path / "outbox"
    step = adapter.ScheduledStep(
        request_ids=["x"],
        new_tokens=[1],
        context_tokens=[5],
        blocks=adapter.block_snapshot(KVCacheManager(held={"x": ([1, 2],), "h": ([1],)})),
        prompt_tokens=[4],
        prefix_hit_tokens=[0],
        spec_drafted=[0],
        holder_ids=["h"],
    )

    def unbuildable() -> adapter.StepColumns:
        raise KeyError("cmpl-9")

    with caplog.at_level(logging.ERROR), StepRecorder(outbox, header) as recorder:
        recorder.record_step_later(10, 20, partial(step.columns, [0]))
        recorder.record_step_later(20, 30, unbuildable)
    assert recorder.rejected_steps == 1
    decoded = read_segments(outbox.glob("*.seg"))
    assert decoded.steps.column("seq").to_pylist() == [0]
    assert decoded.slots.select(["request_id", "kv_blocks"]).to_pylist() == [
        {"request_id": "x", "kv_blocks": 1.5}
    ]
    assert decoded.holders.select(["request_id", "kv_blocks"]).to_pylist() == [
        {"request_id": "h", "kv_blocks": 0.5}
    ]
    assert [(d["first_seq"], d["last_seq"]) for d in decoded.drops.to_pylist()] == [(1, 1)]
    assert any(
        "step 1 not recorded" in r.getMessage() and "cmpl-9" in r.getMessage()
        for r in caplog.records
    )
