"""The adapter's own logic (block shares, the request mirror, header, version check) and one test per shim of an
attribute that moved between vLLM releases. The mapping from the scheduler's state is tested
on vLLM's real scheduler in test_vllm_conformance.py."""

# vLLM is imported after the skip that says it is missing.
from __future__ import annotations

import logging
import math
from functools import partial
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

vllm = pytest.importorskip(
    "vllm", reason="the vLLM adapter's tests need vLLM (make test installs it)"
)

from hypothesis import given, settings
from hypothesis import strategies as st
from vllm import SamplingParams
from vllm.config import ParallelConfig, SchedulerConfig, SpeculativeConfig
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

import pipeline.hook.vllm as adapter
from pipeline.hook.recorder import StepRecorder
from pipeline.hook.replica import HookConfigError
from pipeline.ingestion.decoder import read_segments
from tests.pipeline.hook.vllm_engine import (
    HAS_REQ_ID_TO_INDEX,
    HAS_RESUMED_REQ_IDS,
    build_scheduler,
    request_factory,
    vllm_config,
)


def test_block_shares_split_shared_prefixes_and_skip_null_blocks():
    owners = ["a", "b", "c", "window", "window-twin", "a"]
    # The last list is a's in a second KV-cache group.
    blocks = [[1, 2, 3, 4], [1, 2, 5], [1, 6], [0, 0, 7, 8], [0, 7, 9], [10]]
    shares = adapter.kv_shares(owners, blocks, 0, 16, ["a", "b", "c", "window", "window-twin"])
    # Block 1 is held by three requests, block 2 by two, block 7 by two.
    assert shares.tolist() == [
        1 / 3 + 1 / 2 + 2 + 1,
        1 / 3 + 1 / 2 + 1,
        1 / 3 + 1,
        1 / 2 + 1,
        1 / 2 + 1,
    ]
    assert adapter.kv_shares(owners, blocks, 0, 16, ["none"]).tolist() == [0.0]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 4)), min_size=1, max_size=8))
def test_block_shares_of_all_holders_sum_to_the_blocks_held(requests):
    """Requests share prefixes of one cached chain (blocks 1-6), then own private blocks."""
    held, next_private = {}, 100
    for index, (shared, private) in enumerate(requests):
        held[f"r{index}"] = list(range(1, shared + 1)) + list(
            range(next_private, next_private + private)
        )
        next_private += private
    shares = adapter.kv_shares(list(held), list(held.values()), 0, next_private, list(held))
    distinct = {block for blocks in held.values() for block in blocks}
    assert math.isclose(shares.sum(), len(distinct), rel_tol=1e-12)
    expected = [
        sum(1 / sum(b in other for other in held.values()) for b in blocks)
        for blocks in held.values()
    ]
    assert np.allclose(shares, expected, rtol=1e-12, atol=0)


def scheduler_output(
    scheduled: dict[str, int],
    cached: dict[str, list[int] | None] | None = None,
    finished: tuple[str, ...] = (),
) -> SchedulerOutput:
    """vLLM's SchedulerOutput with the fields the mirror reads: tokens per request, the cached
    requests' new blocks (one KV-cache group) and the requests finished before the step."""
    output = SchedulerOutput.make_empty()
    output.num_scheduled_tokens = scheduled
    output.total_num_scheduled_tokens = sum(scheduled.values())
    output.finished_req_ids = set(finished)
    cached = cached or {}
    output.scheduled_cached_reqs = CachedRequestData.make_empty()
    output.scheduled_cached_reqs.req_ids = list(cached)
    output.scheduled_cached_reqs.new_block_ids = [
        None if blocks is None else (blocks,) for blocks in cached.values()
    ]
    output.scheduled_cached_reqs.num_computed_tokens = [16] * len(cached)
    return output


def step(index: int, output: SchedulerOutput, *new: tuple[str, list[int]]) -> adapter.ScheduledStep:
    return adapter.ScheduledStep(
        index,
        output,
        output.num_scheduled_tokens,
        output.scheduled_spec_decode_tokens,
        [adapter.NewRequest(request_id, 0, 20, 0, blocks) for request_id, blocks in new],
        {},
        {},
        (),
        (),
        False,
        3,
    )


def test_the_mirror_applies_unrecorded_steps_before_the_next_one_it_builds():
    mirror = adapter.RequestMirror((0,), null_block=0, total_blocks=16)
    steps = [
        step(1, scheduler_output({"a": 20, "b": 20}), ("a", [1, 2]), ("b", [1, 3])),
        # Not recorded (dropped): a gets a block, b is left out of the batch.
        step(2, scheduler_output({"a": 1}, cached={"a": [4]})),
        # Scheduled no tokens, but b finished: only its freeing is followed.
        step(3, scheduler_output({}, finished=("b",))),
        step(4, scheduler_output({"a": 1}, cached={"a": None})),
    ]
    for scheduled in steps:
        mirror.follow(scheduled)
    first = mirror.columns(steps[0], {})
    assert (first[0], first[3].tolist(), first[4]) == (["a", "b"], [1.5, 1.5], [20, 20])
    last = mirror.columns(steps[3], {})
    assert (last[0], last[2], last[3].tolist(), last[8]) == (["a"], [16], [3.0], [])
    with pytest.raises(ValueError, match="call 2 completed after call 4"):
        mirror.columns(steps[1], {})


def test_a_step_whose_columns_fail_to_build_is_rejected_and_left_as_a_drop(
    tmp_path, header, caplog
):
    outbox = tmp_path / "outbox"
    mirror = adapter.RequestMirror((0,), null_block=0, total_blocks=16)
    # The first step is not recorded; the second leaves h out of the batch, holding block 1.
    first = step(1, scheduler_output({"x": 4, "h": 4}), ("x", [1, 2]), ("h", [1]))
    built = step(2, scheduler_output({"x": 1}, cached={"x": None}))
    # A request vLLM never sent whole cannot be mirrored.
    unbuildable = step(3, scheduler_output({"x": 1}, cached={"cmpl-9": [5]}))
    for scheduled in (first, built, unbuildable):
        mirror.follow(scheduled)
    with caplog.at_level(logging.ERROR), StepRecorder(outbox, header) as recorder:
        recorder.record_step_later(10, 20, partial(mirror.columns, built, {}))
        recorder.record_step_later(20, 30, partial(mirror.columns, unbuildable, {}))
    assert recorder.rejected_steps == 1
    decoded = read_segments(outbox.glob("*.seg"))
    assert decoded.steps.column("seq").to_pylist() == [0]
    assert decoded.slots.select(["request_id", "kv_blocks"]).to_pylist() == [
        {"request_id": "x", "kv_blocks": 1.5}
    ]
    assert decoded.holders.select(["request_id", "kv_blocks", "state"]).to_pylist() == [
        {"request_id": "h", "kv_blocks": 0.5, "state": "waiting"}
    ]
    assert [(d["first_seq"], d["last_seq"]) for d in decoded.drops.to_pylist()] == [(1, 1)]
    assert any(
        "step 1 not recorded" in r.getMessage() and "'cmpl-9'" in r.getMessage()
        for r in caplog.records
    )


@pytest.fixture(scope="module")
def engine_configs(tmp_path_factory):
    """vLLM's own engine configs, models loaded from directories named as their Hugging Face
    repositories: the pool's model on one or two GPUs, and another model."""
    models = tmp_path_factory.mktemp("models")
    config = partial(
        vllm_config,
        num_gpu_blocks=64,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        async_scheduling=True,
        num_speculative_tokens=0,
    )
    return {
        "pool's model": config(models / "meta-llama" / "Llama-3.1-8B-Instruct"),
        "another model": config(models / "Qwen" / "Qwen3-32B"),
        "tensor parallel": config(
            models / "meta-llama" / "Llama-3.1-8B-Instruct", tensor_parallel_size=2
        ),
    }


def test_the_header_keeps_the_pools_names_and_the_engines_own(replica, engine_configs, caplog):
    config = engine_configs["pool's model"]
    header = adapter.header_for(replica, config, "NVIDIA H100 80GB HBM3", "0.33.0", "550.54.15", 16)
    assert (header.pool, header.replica, header.model, header.gpu_type) == (
        "chat-8b",
        "chat-8b-r0",
        "llama-3.1-8b-instruct",
        "h100",
    )
    assert (header.engine_model, header.engine_device) == (
        config.model_config.model,
        "NVIDIA H100 80GB HBM3",
    )
    # Where the platform names no GPU (the CPU), the pool's gpu_type stands, and it is said.
    with caplog.at_level(logging.WARNING):
        header = adapter.header_for(replica, config, None, "0.33.0", "550", 16)
    assert (header.gpu_type, header.engine_device) == ("h100", None)
    assert (
        "names no GPU here: replica 'chat-8b-r0' is recorded with gpu_type 'h100' from pool "
        "'chat-8b', unchecked" in caplog.text
    )


def test_an_engine_that_runs_other_than_its_pool_declares_is_refused(replica, engine_configs):
    with pytest.raises(HookConfigError) as refused:
        adapter.header_for(replica, engine_configs["another model"], None, "0.33.0", "550", 16)
    assert str(refused.value).startswith("replica 'chat-8b-r0' serves '")
    assert str(refused.value).endswith(
        "Qwen3-32B') but pool 'chat-8b' declares model 'llama-3.1-8b-instruct': serve it as "
        "--served-model-name llama-3.1-8b-instruct, or put the replica in the pool of the "
        "model it serves"
    )
    with pytest.raises(HookConfigError, match="runs on 'NVIDIA A100-SXM4-80GB' but pool 'chat-8b'"):
        adapter.header_for(
            replica,
            engine_configs["pool's model"],
            "NVIDIA A100-SXM4-80GB",
            "0.33",
            "550",
            16,
        )
    with pytest.raises(HookConfigError, match="runs on 2 GPUs"):
        adapter.header_for(replica, engine_configs["tensor parallel"], None, "0.33", "5", 16)


def test_gpu_name_is_none_where_vllms_platform_names_no_gpu():
    # This CPU-only machine: vLLM's platform has no device name.
    assert adapter.gpu_name() is None


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


@pytest.mark.parametrize(
    ("scheduler_cls", "placeholders"),
    [("RecordingScheduler", 0), ("AsyncRecordingScheduler", 1)],
)
def test_vllm_builds_the_named_recording_scheduler_and_it_schedules_as_vllms_own(
    scheduler_cls, placeholders, engine_configs, descriptor_path, tmp_path, monkeypatch
):
    monkeypatch.setenv("STEPLEDGER_OUTBOX", str(tmp_path / "outbox"))
    monkeypatch.setenv("STEPLEDGER_HOOK_CONFIG", str(descriptor_path))
    # `--scheduler-cls pipeline.hook.vllm.<name>`, resolved as vLLM resolves it.
    scheduler_class = SchedulerConfig.default_factory(
        scheduler_cls=f"pipeline.hook.vllm.{scheduler_cls}"
    ).get_scheduler_cls()
    assert scheduler_class is getattr(adapter, scheduler_cls)
    config = engine_configs["pool's model"]
    scheduler = build_scheduler(scheduler_class, config)
    request = request_factory(config)("a", list(range(20)), max_tokens=4)
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.shutdown()
    assert output.num_scheduled_tokens == {"a": 20}
    # vLLM's async scheduler holds a place for the token being sampled, so that it can schedule
    # the next step before the output arrives; the synchronous one waits for it.
    assert request.num_output_placeholders == placeholders


@pytest.mark.skipif(not HAS_REQ_ID_TO_INDEX, reason="this vLLM has no req_id_to_index")
def test_sampled_counts_from_req_id_to_index_as_in_0_33():
    output = ModelRunnerOutput(
        req_ids=["x", "y"], req_id_to_index={"x": 1, "y": 0}, sampled_token_ids=[[1], [2, 3]]
    )
    assert adapter.sampled_counts(output) == {"x": 2, "y": 1}


def test_sampled_counts_from_req_ids_as_in_0_34():
    # vLLM 0.34's ModelRunnerOutput has no req_id_to_index: rows follow req_ids.
    # Typed as either: the installed release decides which class builds it.
    shaped_as_0_34: Any = SimpleNamespace if HAS_REQ_ID_TO_INDEX else ModelRunnerOutput
    output = shaped_as_0_34(req_ids=["x", "y", "z"], sampled_token_ids=[[1], [2, 3], []])
    assert adapter.sampled_counts(output) == {"x": 1, "y": 2, "z": 0}
    assert adapter.sampled_counts(shaped_as_0_34(req_ids=[], sampled_token_ids=[])) == {}


def test_resumed_requests_among_cached_ones_as_in_0_33_and_none_in_0_34():
    cached = CachedRequestData.make_empty()
    if HAS_RESUMED_REQ_IDS:
        cached.resumed_req_ids = {"r"}
        assert adapter.resumed_request_ids(cached) == {"r"}
    else:
        assert adapter.resumed_request_ids(cached) == ()


def test_prefix_hit_tokens_from_prefill_stats():
    request = Request("r", list(range(40)), SamplingParams(max_tokens=1), None)
    assert adapter.prefix_hit_tokens(request) == 0
    assert request.prefill_stats is not None
    request.prefill_stats.set(
        num_prompt_tokens=40, num_local_cached_tokens=16, num_external_cached_tokens=16
    )
    assert adapter.prefix_hit_tokens(request) == 32
    request.take_prefill_stats()
    assert adapter.prefix_hit_tokens(request) == 0


@pytest.mark.parametrize(
    ("method", "trimmed"), [(None, False), ("ngram", False), ("ngram_gpu", True)]
)
def test_drafts_are_copied_only_where_the_model_runner_trims_them(method, trimmed):
    speculative = (
        SpeculativeConfig(
            method=method, num_speculative_tokens=2, prompt_lookup_max=3, prompt_lookup_min=2
        )
        if method
        else None
    )
    config = SimpleNamespace(speculative_config=speculative)
    assert adapter.drafts_trimmed_in_place(config) is trimmed


@pytest.mark.parametrize(("pp", "tp", "pcp", "gpus"), [(1, 1, 1, 1), (2, 4, 1, 8), (2, 2, 2, 8)])
def test_gpus_per_replica_is_pipeline_tensor_and_prefill_context_parallel(pp, tp, pcp, gpus):
    parallel = ParallelConfig(
        pipeline_parallel_size=pp, tensor_parallel_size=tp, prefill_context_parallel_size=pcp
    )
    assert adapter.gpus_per_replica(parallel) == gpus == parallel.world_size
