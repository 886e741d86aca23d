"""The recording scheduler on SGLang's real scheduling code (batches, schedule policy, prefill
adder, radix cache, memory pools; see tests/pipeline/hook/sglang_engine.py for what is driven and
what is not), on the CPU; every recorded value is checked against SGLang's own state at the
moment the batch was launched: its KV row of every request (`req_to_token` up to
`kv_allocated_len`), its cached-prefix count (`Req.cached_tokens`), its allocator and tree;
with EAGLE speculative decoding, each verify's drafts against the verify result SGLang settled
and every request's drafts against SGLang's own counters (`Req.spec_verify_ct`,
`spec_num_correct_drafts`)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.pipeline.hook.sglang_torchvision import declare_torchvision_operators

declare_torchvision_operators()
pytest.importorskip(
    "sglang.srt.managers.schedule_batch",
    reason="SGLang is not installed (make test installs it beside the venv)",
)

import sglang  # noqa: E402
from sglang.srt.managers.utils import GenerationBatchResult  # noqa: E402

import pipeline.hook.sglang as adapter  # noqa: E402
from pipeline.hook import recorder  # noqa: E402
from pipeline.hook.recorder import StepRecorder  # noqa: E402
from pipeline.hook.replica import ReplicaDescriptor  # noqa: E402
from pipeline.ingestion.decoder import read_segments, segment_header  # noqa: E402
from tests.pipeline.hook.recorded_steps import assert_steps_match  # noqa: E402
from tests.pipeline.hook.sglang_engine import (  # noqa: E402
    EAGLE_DRAFT_TOKENS,
    Engine,
    publish_rank,
    server_args,
    step_attention_ranks,
)

REPLICA = "chat-8b-r0"
# Too few KV slots for the two long decodes side by side: SGLang retracts one of them.
KV_TOKENS = 330
CHUNKED_PREFILL = 64


def expected_step(engine: Engine, batch: Any, cached_seen: dict[str, int]) -> dict[str, Any]:
    """What the step record must say, from SGLang's state right before the batch runs: KV
    shares counted from every request's row of req_to_token (not from the tree)."""
    page = engine.page_size
    pages = {
        req.rid: {
            slot // page
            for slot in engine.req_to_token_pool.req_to_token[
                req.kv.req_pool_idx, : req.kv.kv_allocated_len
            ].tolist()
        }
        for req in engine.requests.values()
        if req.kv.req_pool_idx is not None
    }
    holders_of = Counter(p for held in pages.values() for p in held)

    def share(request_id: str) -> float:
        # Rounded: the tracker sums the same fractions in another order.
        return round(sum(1 / holders_of[p] for p in pages.get(request_id, ())), 9)

    extend = batch.forward_mode.is_extend()
    # A decode batch verifies the drafts; its accepted ones are known once its result is.
    verify = not extend and not engine.spec_algorithm.is_none()
    # Decode rows of an extend batch (a decode batch viewed as one beside another
    # attention rank's prefill) compute one token each.
    decode_rows = set(batch.decoding_reqs or ()) if extend else set(batch.reqs)
    slots = []
    for req in batch.reqs:
        computes = req.extend_len if req not in decode_rows else 1
        new_tokens, context = computes, req.kv.kv_allocated_len - computes
        if verify:
            new_tokens, context = EAGLE_DRAFT_TOKENS, req.kv.kv_committed_len
        hit = req.cached_tokens - cached_seen.get(req.rid, 0) if req not in decode_rows else 0
        cached_seen[req.rid] = req.cached_tokens
        slots.append(
            {
                "request_id": req.rid,
                "new_tokens": new_tokens,
                "context_tokens": context,
                "kv_blocks": share(req.rid),
                "prompt_tokens": len(req.origin_input_ids),
                "prefix_hit_tokens": hit,
                "spec_drafted": EAGLE_DRAFT_TOKENS - 1 if verify else 0,
                "spec_accepted": 0,
            }
        )
    scheduled = {req.rid for req in batch.reqs}
    allocator = engine.token_to_kv_pool_allocator
    return {
        "slots": slots,
        "holders": sorted(
            (request_id, share(request_id), "waiting")
            for request_id in pages
            if request_id not in scheduled and share(request_id) > 0
        ),
        "admission_blocked": bool(engine.retracted)
        or (
            len(decode_rows) == len(batch.reqs)
            and bool(engine.waiting_queue)
            and len(batch.reqs) < engine.max_running_requests
        ),
        "free_blocks": (allocator.available_size() + engine.tree_cache.evictable_size()) // page,
        "total_blocks": allocator.size // page,
        "mode": batch.forward_mode.name,
        "decode_viewed_as_extend": extend and len(decode_rows) == len(batch.reqs),
        "retracted": sorted(req.rid for req in engine.retracted),
        "chunked": engine.chunked_req is not None,
        # Left out of the batch by the overlap loop because their queued result finishes them.
        "finishing_in_flight": sorted(
            req.rid
            for queued, _ in engine.result_queue
            for req in queued.reqs
            if req.rid not in scheduled and req.kv.req_pool_idx is not None
        ),
    }


def checked_engine(expected: list[dict[str, Any]], idle: list[int] | None = None) -> type:
    """Engine, noting each batch's expected record when it is handed to the model (in `idle`,
    the step each idle batch is recorded as, without rows), and each verify's accepted
    drafts from its result (the normal loop: the last batch launched)."""
    cached_seen: dict[str, int] = {}

    class CheckedEngine(Engine):
        def run_batch(self, batch: Any) -> Any:
            if batch.forward_mode.is_idle():
                assert idle is not None
                assert not batch.reqs
                idle.append(len(expected))
            expected.append(expected_step(self, batch, cached_seen))
            return super().run_batch(batch)

        def process_batch_result(self, batch: Any, result: Any) -> None:
            if isinstance(result, GenerationBatchResult):
                accept_lens = result.accept_lens.tolist()
                for slot, accept_len in zip(expected[-1]["slots"], accept_lens, strict=True):
                    slot["spec_accepted"] = accept_len - result.num_non_draft_tokens_per_req
            super().process_batch_result(batch, result)

    return CheckedEngine


def recorder_in(outbox: Path, replica: ReplicaDescriptor) -> Callable[[Any], StepRecorder]:
    """What `recorder_from_environment` builds for a scheduler of `replica` whose
    STEPLEDGER_OUTBOX is `outbox`: its header from SGLang's published parallel context."""

    def recorder_for(scheduler: Any) -> StepRecorder:
        header = adapter.header_for(
            replica,
            adapter.parallelism(),
            replica.model,
            scheduler.server_args.model_path,
            None,
            sglang.__version__,
            "550.54.15",
            scheduler.page_size,
        )
        return StepRecorder(adapter.rank_outbox(outbox, replica.replica, header), header)

    return recorder_for


def run_scenario(engine: Engine) -> None:
    """Chunked prefill, a radix-cache hit, an abort, requests waiting for KV, a short request
    finishing beside long ones, and a retraction under KV pressure whose request comes back."""
    engine.add_request("a", list(range(100, 200)), 30)
    engine.step()
    # Shares a's first 64 prompt tokens, which a's first chunk put in the radix tree.
    engine.add_request("b", list(range(100, 164)) + [900] * 20, 30)
    for _ in range(4):
        engine.step()
    engine.add_request("c", list(range(400, 440)), 200)
    engine.add_request("d", list(range(500, 540)), 200)
    # Finishes while the others decode with KV to spare.
    engine.add_request("e", list(range(600, 608)), 3)
    for _ in range(2):
        engine.step()
    engine.abort("b")
    for _ in range(400):
        if not engine.has_requests():
            break
        engine.step()
    assert not engine.has_requests(), "the scenario did not finish"


LOOPS = ["normal", "overlap", "normal-eagle"]


@pytest.fixture
def environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The writer thread idle until the recorder closes: every step is built after the whole
    scenario ran, so nothing it reads may have changed since its batch was launched. SGLang
    admits requests as if each running one would use 5% of its remaining max_new_tokens, so
    KV runs out while they decode and a request is retracted."""
    monkeypatch.setattr(recorder, "_POLL_SECONDS", 600.0)
    monkeypatch.setenv("SGLANG_INIT_NEW_TOKEN_RATIO", "0.05")
    return tmp_path / "outbox"


# SGLang's default page of one token, and pages of 4 (a KV page shared by requests holds
# their common prefix's whole pages).
# The normal event loop, the overlap one (SGLang's default): there a batch is launched
# before the previous one's result is processed, and EAGLE speculative decoding in the normal
# loop (SGLang runs it without the overlap loop on the CPU).
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(
    ("overlap", "eagle"), [(False, False), (True, False), (False, True)], ids=LOOPS
)
def test_recorded_steps_match_sglangs_own_state(
    overlap: bool,
    eagle: bool,
    page_size: int,
    environment: Path,
    replica: ReplicaDescriptor,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    args = server_args(
        tmp_path_factory.getbasetemp() / "tiny-llama",
        chunked_prefill_size=CHUNKED_PREFILL,
        max_running_requests=4,
        page_size=page_size,
        eagle=eagle,
    )

    expected: list[dict[str, Any]] = []
    recording = adapter.recording_scheduler_class(
        checked_engine(expected), recorder_in(environment, replica)
    )
    engine = recording(args, KV_TOKENS, overlap)
    run_scenario(engine)
    step_recorder = engine.step_tracker.recorder
    engine.release_host_resources()
    assert (step_recorder.dropped_steps, step_recorder.rejected_steps) == (0, 0)

    log = read_segments(environment.glob("*.seg"))
    segment = log.segments.to_pylist()[0]
    assert (segment["engine_name"], segment["engine_version"]) == ("sglang", "0.5.23")
    assert (segment["gpus_per_replica"], segment["kv_block_size"]) == (1, page_size)
    assert_steps_match(log, expected)
    slots, holders = log.slots.to_pylist(), log.holders.to_pylist()

    # The scenario reached every case it is meant to check.
    first: dict[str, dict[str, Any]] = {}
    for slot in slots:
        first.setdefault(slot["request_id"], slot)
    assert (first["a"]["new_tokens"], first["a"]["prompt_tokens"]) == (64, 100)
    assert [s["new_tokens"] for s in slots if s["request_id"] == "a"][:2] == [64, 36]
    assert (first["a"]["prefix_hit_tokens"], first["b"]["prefix_hit_tokens"]) == (0, 64)
    assert sum(s["prefix_hit_tokens"] for s in slots) == 64
    # b and a hold the same 64 prompt slots: half of their pages count to each.
    assert first["b"]["kv_blocks"] == pytest.approx((32 + 20) / page_size)
    assert any(want["chunked"] for want in expected)
    retractions = [seq for seq, want in enumerate(expected) if want["retracted"]]
    assert retractions, "no request was retracted"
    retracted = expected[retractions[0]]["retracted"][0]
    # The retracted request comes back with a prefill of what it had, and no new cache hit.
    readmitted = [
        s
        for s in slots
        if s["request_id"] == retracted
        and s["seq"] > retractions[0]
        and s["new_tokens"] > 1
        and not s["spec_drafted"]
    ]
    assert readmitted
    assert readmitted[0]["prefix_hit_tokens"] == 0
    assert any(want["admission_blocked"] and not want["retracted"] for want in expected)
    b_steps = [s["seq"] for s in slots if s["request_id"] == "b"]
    assert len(b_steps) < 30, "b ran to max_new_tokens instead of being aborted"
    assert {want["mode"] for want in expected} == {"EXTEND", "DECODE"}
    assert any(want["finishing_in_flight"] for want in expected) == overlap
    assert any(h["request_id"] for h in holders)
    if eagle:
        assert_drafts_match_sglangs_counters(engine, slots)
    else:
        assert not any(s["spec_drafted"] for s in slots)


def assert_drafts_match_sglangs_counters(engine: Engine, slots: list[dict[str, Any]]) -> None:
    """Every request's recorded verifies, drafts and accepted drafts are SGLang's own counts
    (proposed drafts as its tokenizer manager reports them: verifies × (draft tokens − 1))."""
    for request_id, req in engine.requests.items():
        verifies = [s for s in slots if s["request_id"] == request_id and s["spec_drafted"]]
        assert len(verifies) == req.spec_verify_ct > 0, request_id
        assert sum(s["spec_drafted"] for s in verifies) == req.spec_verify_ct * (
            EAGLE_DRAFT_TOKENS - 1
        )
        assert sum(s["spec_accepted"] for s in verifies) == req.spec_num_correct_drafts
        assert sum(req.spec_correct_drafts_histogram) == req.spec_verify_ct
    # The absent target model accepted none, some and all of the drafts.
    assert {s["spec_accepted"] for s in slots if s["spec_drafted"]} == {0, 1, 2, 3}


def run_attention_ranks_scenario(ranks: list[Engine], extend_view: bool) -> None:
    """Two attention data-parallel ranks stepping together: rank 0 a chunked prompt and a
    request hitting its prefix in rank 0's radix tree; rank 1 a short request, then nothing
    (idle batches while rank 0 works), then a prefill while rank 0 decodes."""
    first, second = ranks
    first.add_request("a", list(range(100, 200)), 12)
    second.add_request("x", list(range(300, 340)), 3)
    step_attention_ranks(ranks, extend_view)
    first.add_request("b", list(range(100, 164)) + [900] * 20, 10)
    for _ in range(6):
        step_attention_ranks(ranks, extend_view)
    second.add_request("y", list(range(350, 380)), 6)
    for _ in range(100):
        if not any(engine.has_requests() for engine in ranks):
            break
        step_attention_ranks(ranks, extend_view)
    assert not any(engine.has_requests() for engine in ranks), "the scenario did not finish"


# With data-parallel attention a rank decoding while another prefills may run its decode
# batch viewed as an extend batch (where the ranks can replay prefill CUDA graphs).
@pytest.mark.parametrize("extend_view", [False, True], ids=["decode", "decode-as-extend"])
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_each_attention_data_parallel_rank_records_its_own_stream(
    overlap: bool,
    extend_view: bool,
    environment: Path,
    replica: ReplicaDescriptor,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    args = server_args(
        tmp_path_factory.getbasetemp() / "tiny-llama",
        chunked_prefill_size=CHUNKED_PREFILL,
        max_running_requests=4,
        attention_ranks=2,
    )
    # The replica's pool declares its two GPUs as two attention data-parallel ranks.
    two_ranks = dataclasses.replace(replica, gpus_per_replica=2, data_parallel=2)
    replica_outbox = environment / REPLICA

    expected: list[list[dict[str, Any]]] = [[], []]
    idle: list[list[int]] = [[], []]
    ranks = []
    for rank in range(2):
        # Each rank's scheduler process publishes its own place before building its scheduler.
        publish_rank(args, rank)
        recording = adapter.recording_scheduler_class(
            checked_engine(expected[rank], idle[rank]), recorder_in(replica_outbox, two_ranks)
        )
        ranks.append(recording(args, KV_TOKENS, overlap))
    run_attention_ranks_scenario(ranks, extend_view)

    for rank, engine in enumerate(ranks):
        step_recorder = engine.step_tracker.recorder
        engine.release_host_resources()
        assert (step_recorder.dropped_steps, step_recorder.rejected_steps) == (0, 0)
        stream = f"{REPLICA}.dp{rank}"
        paths = sorted((environment / stream).glob("*.seg"))
        header = segment_header(paths[0])
        assert header is not None
        assert (header.replica, header.gpus_per_replica) == (stream, 1)
        assert (header.tp_size, header.ep_size, header.attn_dp_rank, header.attn_dp_size) == (
            2,
            1,
            rank,
            2,
        )
        log = read_segments(paths)
        assert_steps_match(log, expected[rank])
        slots = log.slots.to_pylist()
        assert {s["request_id"] for s in slots} == ({"a", "b"} if rank == 0 else {"x", "y"})
        assert not {s["seq"] for s in slots} & set(idle[rank])
    assert not list(replica_outbox.glob("*.seg"))
    # b hit a's prefix in rank 0's tree; rank 1 idled while rank 0 worked: steps without rows.
    assert (
        sum(
            s["prefix_hit_tokens"]
            for s in read_segments(
                sorted((environment / f"{REPLICA}.dp0").glob("*.seg"))
            ).slots.to_pylist()
        )
        == 64
    )
    assert idle[1], "rank 1 ran no idle batch"
    viewed = [want["decode_viewed_as_extend"] for want in expected[0] + expected[1]]
    assert any(viewed) == extend_view
