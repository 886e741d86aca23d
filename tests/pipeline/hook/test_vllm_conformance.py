"""The recording scheduler on vLLM's real v1 Scheduler and AsyncScheduler, driven on the CPU
through the engine's own call sequence; every recorded value is checked against the
scheduler's state at the moment it scheduled the step."""

from __future__ import annotations

# vLLM is imported after the skip that says it is missing.
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip(
    "vllm", reason="the conformance test drives vLLM's real scheduler (make test installs it)"
)

from vllm.v1.request import RequestStatus

import pipeline.hook.vllm as adapter
from pipeline.hook import recorder
from pipeline.hook.replica import HookConfigError, ReplicaDescriptor
from pipeline.ingestion.decoder import read_segments
from schemas.config import load_pools
from schemas.records import FRAME_PREFIX, HeaderFrame
from tests.helpers.steplog_samples import frame_spans
from tests.pipeline.hook.recorded_steps import assert_steps_match
from tests.pipeline.hook.vllm_engine import (
    BLOCK_SIZE,
    HAS_RESUMED_REQ_IDS,
    Engine,
    build_scheduler,
    request_factory,
    vllm_config,
)

# 13 usable blocks (one is vLLM's null block): too few for the scenario's requests to decode
# side by side, so a running request is preempted, and the last arrival waits for blocks.
NUM_GPU_BLOCKS = 14
# A hybrid model's second KV-cache group attends to the last 32 tokens; both groups draw on one
# pool, and 24 blocks bring the same preemption, blocked admission and waiting session.
SLIDING_WINDOW = 32
HYBRID_NUM_GPU_BLOCKS = 24


def expected_step(scheduler: Any, output: Any) -> dict[str, Any]:
    """What the step record must say, from the scheduler's state right after schedule():
    block shares counted from every request's block list (not from the pool's ref counts)."""
    manager = scheduler.kv_cache_manager
    null_block = manager.block_pool.null_block.block_id
    blocks = {
        request_id: [b for group in manager.get_block_ids(request_id) for b in group]
        for request_id, request in scheduler.requests.items()
        if not request.is_finished()
    }
    holders_of = Counter(b for held in blocks.values() for b in held if b != null_block)

    def share(request_id: str) -> float:
        # Rounded: the adapter sums the same fractions in another order.
        total = sum(1 / holders_of[b] for b in blocks.get(request_id, ()) if b != null_block)
        return round(total, 9)

    scheduled = output.num_scheduled_tokens
    slots = []
    for request_id, new_tokens in scheduled.items():
        request = scheduler.requests[request_id]
        drafted = len(output.scheduled_spec_decode_tokens.get(request_id, ()))
        # vLLM fills prefill_stats on a request's first schedule only (not after a
        # preemption, nor for a streaming session's later inputs, where it is None).
        stats = request.prefill_stats
        first = (
            stats is not None
            and request.num_preemptions == 0
            and request_id in {new.req_id for new in output.scheduled_new_reqs}
        )
        slots.append(
            {
                "request_id": request_id,
                "new_tokens": new_tokens,
                # schedule() has already advanced num_computed_tokens by the step's tokens.
                "context_tokens": request.num_computed_tokens - new_tokens,
                "kv_blocks": share(request_id),
                "prompt_tokens": request.num_prompt_tokens,
                "prefix_hit_tokens": stats.num_cached_tokens if first else 0,
                "spec_drafted": drafted,
                # The synthetic model accepts one draft of every request that samples.
                "spec_accepted": int(drafted > 0 and not request.is_prefill_chunk),
            }
        )
    holders = sorted(
        (request_id, share(request_id), "waiting")
        for request_id in blocks
        if request_id not in scheduled and share(request_id) > 0
    )
    admissible_waiting = len(scheduler.waiting) + len(scheduler.kv_holding_waiting) > len(
        scheduler.deferred_waiting
    )
    active = len(scheduler.running) + scheduler.num_waiting_for_streaming_input
    below_limits = (
        active < scheduler.max_num_active_reqs
        and sum(scheduled.values()) < scheduler.max_num_scheduled_tokens
    )
    return {
        "slots": slots,
        "holders": holders,
        "admission_blocked": bool(output.preempted_req_ids)
        or (admissible_waiting and below_limits),
        "free_blocks": manager.block_pool.get_num_free_blocks(),
        "total_blocks": manager.block_pool.num_gpu_blocks,
        "preempted": sorted(output.preempted_req_ids or ()),
        "window_dropped": any(null_block in held for held in blocks.values()),
        "resumed": sorted(adapter.resumed_request_ids(output.scheduled_cached_reqs)),
        "waiting_sessions": sorted(
            r.request_id
            for r in scheduler.kv_holding_waiting
            if r.status == RequestStatus.WAITING_FOR_STREAMING_REQ
        ),
    }


def run_scenario(scheduler: Any, async_scheduling: bool, make_request: Any) -> list[dict[str, Any]]:
    """Chunked prefill, a prefix-cache hit, speculative decoding, a streaming session that
    waits between inputs with its KV, a preemption under KV pressure, and an abort."""
    expected: list[dict[str, Any]] = []

    def on_schedule(scheduler: Any, output: Any) -> None:
        if output.total_num_scheduled_tokens:
            expected.append(expected_step(scheduler, output))

    engine = Engine(scheduler, async_scheduling, on_schedule)
    scheduler.add_request(make_request("a", list(range(100, 200)), max_tokens=30))
    engine.step()
    # Shares a's first 64 prompt tokens: four full blocks, already in the prefix cache.
    scheduler.add_request(make_request("b", list(range(100, 164)) + [900] * 20, max_tokens=30))
    scheduler.add_request(make_request("s", list(range(300, 340)), max_tokens=2, resumable=True))
    for _ in range(6):
        engine.step()
    scheduler.add_request(make_request("c", list(range(400, 440)), max_tokens=4))
    for _ in range(6):
        engine.step()
    scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    # The session's next input: it resumes on the blocks it kept while waiting.
    scheduler.add_request(make_request("s", list(range(340, 350)), max_tokens=2, resumable=True))
    for _ in range(60):
        engine.step()
        if not scheduler.has_requests() and not engine.batch_queue:
            break
    engine.drain()
    scheduler.finish_requests("s", RequestStatus.FINISHED_ABORTED)
    return expected


@pytest.fixture
def environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, descriptor_path: Path) -> Path:
    """The recorder's environment, its writer thread idle until the recorder closes: every
    step is built after the whole scenario ran, so nothing it reads may have changed since
    its step was scheduled."""
    monkeypatch.setattr(recorder, "_POLL_SECONDS", 600.0)
    outbox = tmp_path / "outbox"
    monkeypatch.setenv("STEPLEDGER_OUTBOX", str(outbox))
    monkeypatch.setenv("STEPLEDGER_HOOK_CONFIG", str(descriptor_path))
    monkeypatch.setenv("STEPLEDGER_DRIVER_VERSION", "550.54.15")
    return outbox


@pytest.mark.parametrize(
    ("class_name", "async_scheduling", "v2_model_runner", "sliding_window"),
    [
        ("AsyncRecordingScheduler", True, True, None),
        ("RecordingScheduler", False, True, None),
        # vLLM 0.33 sends a resumed request among the cached ones for the V1 model runner.
        ("RecordingScheduler", False, False, None),
        # A sliding-window group frees blocks in place: copied each step, not mirrored.
        ("AsyncRecordingScheduler", True, True, SLIDING_WINDOW),
    ],
)
def test_recorded_steps_match_the_real_scheduler(
    class_name: str,
    async_scheduling: bool,
    v2_model_runner: bool,
    sliding_window: int | None,
    environment: Path,
    tmp_path_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", str(int(v2_model_runner)))
    config = vllm_config(
        tmp_path_factory.getbasetemp() / "tiny-llama",
        num_gpu_blocks=NUM_GPU_BLOCKS if sliding_window is None else HYBRID_NUM_GPU_BLOCKS,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        async_scheduling=async_scheduling,
        served_model_name=load_pools().pools[0].model,
    )
    scheduler_class = getattr(adapter, class_name)
    scheduler = build_scheduler(scheduler_class, config, sliding_window)
    expected = run_scenario(scheduler, async_scheduling, request_factory(config))
    scheduler.shutdown()

    log = read_segments(environment.glob("*.seg"))
    header = log.segments.to_pylist()[0]
    pool = load_pools().pools[0]
    assert (header["engine_version"], header["model"], header["gpu_type"]) == (
        vllm.__version__,
        pool.model,
        pool.gpu_type,
    )
    assert (header["gpus_per_replica"], header["kv_block_size"]) == (1, BLOCK_SIZE)
    # The engine's own names are in the header frame (not in the decoded segments table).
    data = Path(header["path"]).read_bytes()
    start, end = frame_spans(data)[0]
    frame = HeaderFrame.from_json(data[start + FRAME_PREFIX.size : end])
    assert (frame.engine_model, frame.engine_device) == (config.model_config.model, None)
    assert_steps_match(log, expected)
    slots, holders = log.slots.to_pylist(), log.holders.to_pylist()

    # The scenario reached every case it is meant to check.
    first: dict[str, dict[str, Any]] = {}
    for slot in slots:
        first.setdefault(slot["request_id"], slot)
    assert (first["a"]["new_tokens"], first["a"]["prompt_tokens"]) == (64, 100)
    assert (first["a"]["prefix_hit_tokens"], first["b"]["prefix_hit_tokens"]) == (0, 64)
    assert sum(s["prefix_hit_tokens"] for s in slots) == 64
    assert any(s["spec_drafted"] == 2 and s["spec_accepted"] == 1 for s in slots)
    assert any(want["preempted"] for want in expected)
    assert any(want["window_dropped"] for want in expected) == (sliding_window is not None)
    resumed_among_cached = HAS_RESUMED_REQ_IDS and not v2_model_runner
    assert any(want["resumed"] for want in expected) == resumed_among_cached
    assert any(want["admission_blocked"] and not want["preempted"] for want in expected)
    session_waits = [
        (seq, want)
        for seq, want in enumerate(expected)
        if want["waiting_sessions"] == ["s"] and any(h[0] == "s" for h in want["holders"])
    ]
    assert session_waits, "the session never waited with its KV"
    assert "b" not in {h["request_id"] for h in holders if h["seq"] >= len(expected) - 1}


def test_an_engine_that_runs_other_than_its_descriptor_declares_does_not_start(
    environment: Path,
    tmp_path: Path,
    tmp_path_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = vllm_config(
        tmp_path_factory.getbasetemp() / "tiny-llama",
        num_gpu_blocks=NUM_GPU_BLOCKS,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        async_scheduling=True,
        served_model_name="llama-3.1-8b-instruct",
    )
    two_gpus = tmp_path / "two-gpus.json"
    two_gpus.write_bytes(
        ReplicaDescriptor(
            pool="chat-8b",
            replica="chat-8b-r0",
            model="llama-3.1-8b-instruct",
            gpu_type="h100",
            gpus_per_replica=2,
        ).to_json()
    )
    monkeypatch.setenv("STEPLEDGER_HOOK_CONFIG", str(two_gpus))
    with pytest.raises(HookConfigError) as refused:
        build_scheduler(adapter.AsyncRecordingScheduler, config)
    assert str(refused.value) == (
        "replica 'chat-8b-r0' runs on 1 GPUs but pool 'chat-8b' declares gpus_per_replica=2"
    )
    monkeypatch.delenv("STEPLEDGER_HOOK_CONFIG")
    with pytest.raises(HookConfigError) as refused:
        build_scheduler(adapter.RecordingScheduler, config)
    assert str(refused.value) == (
        "the step-recording scheduler needs environment variables ['STEPLEDGER_HOOK_CONFIG']"
    )
    assert not environment.exists()
