"""SGLang's real scheduling code on the CPU: its request and batch objects (`Req`,
`ScheduleBatch`), schedule policy and prefill adder (`SchedulePolicy`, `PrefillAdder`), radix
cache (`RadixCache`), memory pools (`ReqToTokenPool`, `MHATokenToKVPool`,
`TokenToKVPoolAllocator`, `PagedTokenToKVPoolAllocator`), new-token ratio tracker and KV
release and checkpoint functions, published from a
`ServerArgs` for a tiny hand-written model config (no weights).

`Scheduler` itself is not built: its constructor starts the model worker (weights, the
attention backend, distributed groups) and its result processing needs the output streamer,
metrics and detokenizer channels. `Engine` calls SGLang's pieces in the order
`Scheduler.get_next_batch_to_run`, `update_running_batch` and `process_batch_result_prefill` /
`_decode` (sglang/srt/managers/scheduler.py, scheduler_components/batch_result_processor.py)
call them in the normal and the overlap event loop, without mixed chunks, LoRA, grammars,
hierarchical cache or disaggregation, and samples a fixed token in place of the model.

With EAGLE speculative decoding (normal loop only: SGLang runs it without the overlap loop on
the CPU), batches are built for SGLang's `SpeculativeAlgorithm.EAGLE`, carry SGLang's own
`EagleDraftInput` (filtered and merged with the batch), and decode batches are prepared by
SGLang's `eagle_prepare_for_decode` (its KV allocation with the draft reserve). That allocation
writes the new slots into `req_to_token` with a Triton kernel (`assign_req_to_token_pool`, or
sgl_kernel's CPU build of it, which is not published for this machine): the same writes in
torch stand in for it (`assign_req_to_token_pool_torch`). The draft and target models are
absent: in their place the verify pass accepts a fixed pattern of drafts and
returns SGLang's `GenerationBatchResult`, whose settling follows `_resolve_spec_v2_tokens` and
`process_batch_result_decode`.
"""

from __future__ import annotations

import json
from array import array
from collections import deque
from pathlib import Path
from typing import Any, cast

import torch

from tests.pipeline.hook.recorded_steps import TINY_LLAMA
from tests.pipeline.hook.sglang_torchvision import declare_torchvision_operators

declare_torchvision_operators()

from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req, ScheduleBatch  # noqa: E402
from sglang.srt.managers.schedule_policy import (  # noqa: E402
    AddReqResult,
    PrefillAdder,
    SchedulePolicy,
)
from sglang.srt.managers.scheduler_components.dp_attn import (  # noqa: E402
    SchedulerDPAttnAdapter,
)
from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import (  # noqa: E402
    NewTokenRatioTracker,
)
from sglang.srt.managers.utils import GenerationBatchResult  # noqa: E402
from sglang.srt.mem_cache import allocation  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: E402
from sglang.srt.runtime_context import SpawnRanks, publish  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.speculative.eagle_info import EagleDraftInput  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

SAMPLED_TOKEN = 7
# EAGLE's chain: 3 draft steps of one candidate each, verified as 4 tokens per request.
EAGLE_DRAFT_STEPS = 3
EAGLE_DRAFT_TOKENS = 4


def assign_req_to_token_pool_torch(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    batch_size: int,
) -> None:
    """SGLang's `assign_req_to_token_pool` kernel in torch: row i of the batch gets its
    slots `[start_offset[i], end_offset[i])` of req_to_token from out_cache_loc, where the
    rows before it took theirs."""
    taken = 0
    for row in range(batch_size):
        start, end = int(start_offset[row]), int(end_offset[row])
        req_to_token[int(req_pool_indices[row]), start:end] = out_cache_loc[
            taken : taken + end - start
        ]
        taken += end - start


# Only the speculative decode allocation (`alloc_for_spec_decode`) calls it.
allocation.assign_req_to_token_pool_func = assign_req_to_token_pool_torch


def server_args(
    model_dir: Path,
    *,
    chunked_prefill_size: int,
    max_running_requests: int,
    page_size: int = 1,
    eagle: bool = False,
    attention_ranks: int = 1,
) -> Any:
    """The ServerArgs `python -m sglang.launch_server` would build for the model config in
    model_dir on the CPU (with `eagle`, EAGLE speculative decoding whose draft model has the
    same config; with `attention_ranks` > 1, `--tp N --dp N --enable-dp-attention`: N
    attention data-parallel ranks of one GPU each), published as the first scheduler process
    publishes it (`publish_rank` for the others)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    speculative: dict[str, Any] = {}
    if eagle:
        speculative = {
            "speculative_algorithm": "EAGLE",
            "speculative_draft_model_path": str(model_dir),
            "speculative_num_steps": EAGLE_DRAFT_STEPS,
            "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": EAGLE_DRAFT_TOKENS,
        }
    if attention_ranks > 1:
        speculative |= {
            "tp_size": attention_ranks,
            "dp_size": attention_ranks,
            "enable_dp_attention": True,
        }
    args = ServerArgs(
        model_path=str(model_dir),
        device="cpu",
        skip_tokenizer_init=True,
        chunked_prefill_size=chunked_prefill_size,
        max_running_requests=max_running_requests,
        page_size=page_size,
        **speculative,
    )
    publish_rank(args, 0)
    return args


def publish_rank(args: Any, tp_rank: int) -> None:
    """What `run_scheduler_process` publishes for the scheduler of TP rank `tp_rank` (with
    data-parallel attention, its attention DP rank follows from it): SGLang's parallel
    context, which its scheduler and the recording one read when they are built."""
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=tp_rank))


class Engine:
    """The scheduler's state and loop over SGLang's pieces (see the module doc), with the
    attribute and method names of `Scheduler` that the recording scheduler uses, so that
    `pipeline.hook.sglang.recording_scheduler_class(Engine)` records it: `run_batch` hands
    a batch to the (absent) model, `process_batch_result` processes its result,
    `_add_request_to_queue` queues a new or retracted request.
    """

    def __init__(self, server_args: Any, kv_tokens: int, overlap: bool = False) -> None:
        self.server_args = server_args
        self.kv_tokens = kv_tokens
        # `Scheduler.event_loop_overlap`: a batch is launched before the previous one's
        # result is processed.
        self.enable_overlap = overlap
        self.spec_algorithm = SpeculativeAlgorithm.from_string(server_args.speculative_algorithm)
        assert self.spec_algorithm.is_none() or not overlap, "EAGLE runs in the normal loop"
        self.result_queue: deque[tuple[Any, Any]] = deque()
        self.waiting_queue: list[Any] = []
        self.chunked_req: Any = None
        self.last_batch: Any = None
        # Requests retracted since the last batch was launched.
        self.retracted: list[Any] = []
        self._build()

    def _build(self) -> None:
        self.page_size = self.server_args.page_size
        self.max_running_requests = self.server_args.max_running_requests
        self.req_to_token_pool = ReqToTokenPool(
            size=self.max_running_requests,
            max_context_len=512,
            device="cpu",
            enable_memory_saver=False,
        )
        kv_cache = MHATokenToKVPool(
            size=self.kv_tokens,
            page_size=self.page_size,
            dtype=torch.float32,
            head_num=1,
            head_dim=4,
            layer_num=1,
            device="cpu",
            enable_memory_saver=False,
            enable_alt_stream=False,
        )
        # The allocator SGLang builds for its page size (`kv_cache_configurator`): slots one by
        # one, or page-aligned runs of them.
        if self.page_size == 1:
            self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(
                size=self.kv_tokens,
                dtype=torch.float32,
                device="cpu",
                kvcache=kv_cache,
                need_sort=False,
            )
        else:
            self.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(
                size=self.kv_tokens,
                page_size=self.page_size,
                dtype=torch.float32,
                device="cpu",
                kvcache=kv_cache,
                need_sort=False,
            )
        self.tree_cache = RadixCache(
            CacheInitParams(
                disable=False,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
                page_size=self.page_size,
            )
        )
        self.model_config = ModelConfig(model_path=self.server_args.model_path)
        self.policy = SchedulePolicy("lpm", self.tree_cache, False, False, False)
        self.new_token_ratio = NewTokenRatioTracker.from_config()
        self.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
        self.requests: dict[str, Any] = {}

    def add_request(self, rid: str, prompt: list[int], max_new_tokens: int) -> None:
        params = SamplingParams(max_new_tokens=max_new_tokens)
        params.normalize(None)
        req = Req(rid, "", array("q", prompt), params, vocab_size=TINY_LLAMA["vocab_size"])
        self.requests[rid] = req
        self._add_request_to_queue(req)

    def _add_request_to_queue(self, req: Any, is_retracted: bool = False) -> None:
        if is_retracted:
            self.retracted.append(req)
        self.waiting_queue.append(req)

    def abort(self, rid: str) -> None:
        """`Scheduler.abort_request` for a running request: it finishes at its next result."""
        self.requests[rid].to_finish = FINISH_ABORT()

    # --- Scheduler.get_next_batch_to_run -----------------------------------------------
    def next_batch(self) -> Any:
        exclude = []
        if self.chunked_req is not None:
            exclude.append(self.chunked_req)
            checkpoint_kv_cache(self.chunked_req, self.tree_cache)  # stash_chunked_request
        last = self.last_batch
        if last is not None and last.forward_mode.is_extend():
            last.filter_batch(reqs_to_exclude=exclude)
            if not last.is_empty() and last is not self.running_batch:
                if self.running_batch.is_empty():
                    self.running_batch = last
                else:
                    self.running_batch.merge_batch(last)
                    self.running_batch.batch_is_full = False
        running = self.running_batch
        running_bs = running.batch_size()
        running.filter_batch()
        if running.batch_size() < running_bs:
            running.batch_is_full = False
        prefill = self.new_prefill_batch()
        if prefill is not None:
            return prefill
        if running.is_empty():
            return None
        return self.update_running_batch(running)

    def new_prefill_batch(self) -> Any:
        """`Scheduler._get_new_batch_prefill_raw` without mixed chunks."""
        running = self.running_batch
        if running.is_empty():
            running.batch_is_full = False
        if (running.batch_is_full or not self.waiting_queue) and self.chunked_req is None:
            return None
        self.policy.calc_priority(self.waiting_queue, running)
        adder = PrefillAdder(
            self.page_size,
            self.tree_cache,
            self.token_to_kv_pool_allocator,
            running,
            self.new_token_ratio.current,
            self.server_args.max_prefill_tokens,
            self.server_args.chunked_prefill_size,
            max_running_requests=self.max_running_requests,
            waiting_queue_len=len(self.waiting_queue),
        )
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for req in self.waiting_queue:
            if adder.budget_state() == AddReqResult.OTHER:
                break
            if len(adder.can_run_list) >= self.max_running_requests - running.batch_size():
                running.batch_is_full = True
                break
            req.init_next_round_input(self.tree_cache)
            result = adder.add_one_req(
                req, has_chunked_req=self.chunked_req is not None, truncation_align_size=None
            )
            if result != AddReqResult.CONTINUE:
                if result == AddReqResult.NO_TOKEN:
                    running.batch_is_full = bool(adder.can_run_list) or not running.is_empty()
                break
        if not adder.can_run_list:
            return None
        admitted = set(adder.can_run_list)
        self.waiting_queue = [r for r in self.waiting_queue if r not in admitted]
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.inflight_middle_chunks += 1
        batch = ScheduleBatch.init_new(
            adder.can_run_list,
            self.req_to_token_pool,
            self.token_to_kv_pool_allocator,
            self.tree_cache,
            self.model_config,
            self.enable_overlap,
            self.spec_algorithm,
            chunked_req=self.chunked_req,
        )
        batch.prepare_for_extend()
        batch.decoding_reqs = None
        return batch

    def update_running_batch(self, batch: Any) -> Any:
        """`Scheduler.update_running_batch`: leave out requests whose queued result finishes
        them, retract under KV pressure, then prepare decode."""
        finishing = self.reqs_finishing_inflight(batch)
        batch.filter_batch(reqs_to_exclude=finishing)
        if batch.is_empty():
            batch.batch_is_full = False
            return None
        if not batch.check_decode_mem() and finishing:
            # The queued result frees the finishing requests' KV at the end of this step.
            batch.batch_is_full = False
            return None
        if not batch.check_decode_mem():
            retracted, ratio, to_abort = batch.retract_decode()
            assert not to_abort
            self.new_token_ratio.current = ratio
            for req in retracted:
                self._add_request_to_queue(req, is_retracted=True)
            batch.batch_is_full = False
        else:
            self.new_token_ratio.decay_step()
        if batch.is_empty():
            return None
        batch.prepare_for_decode()
        return batch

    def reqs_finishing_inflight(self, batch: Any) -> list[Any]:
        """`Scheduler._reqs_finishing_inflight`: under overlap, the requests the queued
        result finishes by length."""
        if not self.result_queue:
            return []
        queued = set(self.result_queue[0][0].reqs)
        return [req for req in batch.reqs if req in queued and req.next_output_finishes_by_length()]

    # --- Scheduler.run_batch and process_batch_result ---------------------------------
    def run_batch(self, batch: Any) -> Any:
        """The model's forward pass, absent: it samples SAMPLED_TOKEN for every request; with
        EAGLE, the verify pass of a decode batch (`verify`), and every batch leaves the next
        draft input on the batch (the non-overlap branch of `Scheduler.run_batch`)."""
        self.retracted.clear()
        if self.spec_algorithm.is_none():
            return SAMPLED_TOKEN
        result = self.verify(batch) if batch.forward_mode.is_decode() else SAMPLED_TOKEN
        batch.spec_info = self.draft_input(len(batch.reqs))
        return result

    def draft_input(self, rows: int) -> Any:
        """The next draft input the EAGLE worker leaves for `rows` requests: one candidate
        each, with its probability, hidden state and bonus token."""
        return EagleDraftInput(
            topk_p=torch.ones(rows, 1),
            topk_index=torch.full((rows, 1), SAMPLED_TOKEN, dtype=torch.int64),
            hidden_states=torch.zeros(rows, cast(int, TINY_LLAMA["hidden_size"])),
            bonus_tokens=torch.full((rows,), SAMPLED_TOKEN, dtype=torch.int64),
        )

    def verify(self, batch: Any) -> Any:
        """The target model's verify pass, absent: request i accepts `accepted_drafts` of its
        drafts plus the bonus token; the batch's sequence lengths advance by as many (the
        worker's `new_seq_lens`)."""
        accept_lens = torch.tensor(
            [accepted_drafts(req) + 1 for req in batch.reqs], dtype=torch.int32
        )
        batch.seq_lens = batch.seq_lens + accept_lens.to(batch.seq_lens.dtype)
        batch.seq_lens_cpu = batch.seq_lens.cpu()
        return GenerationBatchResult(
            next_token_ids=torch.full((len(batch.reqs) * EAGLE_DRAFT_TOKENS,), SAMPLED_TOKEN),
            accept_lens=accept_lens,
            new_seq_lens=batch.seq_lens,
            speculative_num_draft_tokens=EAGLE_DRAFT_TOKENS,
        )

    def settle_verify(self, batch: Any, result: Any) -> None:
        """`_resolve_spec_v2_tokens` and the KV bookkeeping of `process_batch_result_decode`
        for a verify result: each request commits its accepted run, counts a verify and its
        accepted drafts, and releases its KV once finished."""
        accept_lens = result.accept_lens.tolist()
        result.num_correct_drafts_per_req_cpu = [
            length - result.num_non_draft_tokens_per_req for length in accept_lens
        ]
        for req, accept_len, correct in zip(
            batch.reqs, accept_lens, result.num_correct_drafts_per_req_cpu, strict=True
        ):
            if req.is_retracted or req.finished():
                continue
            req.kv.kv_committed_len += accept_len
            req.spec_verify_ct += 1
            req.spec_num_correct_drafts += correct
            req.update_spec_correct_drafts_histogram(correct)
            req.output_ids.extend([SAMPLED_TOKEN] * accept_len)
            req.update_finish_state(accept_len)
            if req.finished():
                release_kv_cache(req, self.tree_cache, checkpoint=True)

    def process_batch_result(self, batch: Any, result: Any) -> None:
        """The KV bookkeeping of `process_batch_result_prefill` and `_decode`: a middle chunk
        only counts down; a finished request releases its KV into the tree, a prefilled one
        checkpoints what it computed."""
        prefill = batch.forward_mode.is_extend()
        if isinstance(result, GenerationBatchResult):
            self.settle_verify(batch, result)
            return
        for req in batch.reqs:
            if req.is_retracted or (req.finished() and req.inflight_middle_chunks <= 0):
                # Under overlap a request retracted or finished since reappears once.
                continue
            if prefill and req.inflight_middle_chunks > 0:
                req.inflight_middle_chunks -= 1
                continue
            req.output_ids.append(result)
            req.update_finish_state()
            if req.finished():
                release_kv_cache(req, self.tree_cache, checkpoint=True)
            elif prefill and req not in (batch.decoding_reqs or ()):
                # Decode rows of an extend batch (a decode batch viewed as one) computed
                # nothing to checkpoint.
                checkpoint_kv_cache(req, self.tree_cache)

    def release_host_resources(self) -> None:
        """What a scheduler process calls when it exits gracefully; nothing to release here."""

    def idle_batch(self) -> Any:
        """SGLang's idle batch (`SchedulerDPAttnAdapter.get_idle_batch`): what a data-parallel
        attention rank without requests runs while another rank runs a batch, since the MoE
        and MLP layers run across every rank's GPUs."""
        adapter = SchedulerDPAttnAdapter(
            model_runner=None,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            tree_cache=self.tree_cache,
            offload_tags=set(),
            model_config=self.model_config,
            enable_overlap=self.enable_overlap,
            spec_algorithm=self.spec_algorithm,
            get_require_mlp_sync=lambda: True,
        )
        return adapter.get_idle_batch()

    def step(self) -> Any:
        """One iteration of `Scheduler.event_loop_normal`, or of `event_loop_overlap`; the
        batch launched, or None."""
        return self.run_step(self.next_batch())

    def run_step(self, batch: Any) -> Any:
        """The rest of the loop's iteration once `batch` (None, an idle batch, or one that
        `next_batch` built) is the one to run."""
        if batch is not None and batch.is_empty() and not batch.forward_mode.is_idle():
            batch = None
        if not self.enable_overlap:
            if batch is not None:
                self.process_batch_result(batch, self.run_batch(batch))
        else:
            if batch is not None:
                result = self.run_batch(batch)
                self.result_queue.append((batch.copy(), result))
            if self.last_batch is not None:
                self.process_batch_result(*self.result_queue.popleft())
        self.last_batch = batch
        return batch

    def has_requests(self) -> bool:
        return bool(
            self.waiting_queue
            or self.chunked_req
            or not self.running_batch.is_empty()
            or self.result_queue
        )


def accepted_drafts(req: Any) -> int:
    """How many of its drafts the absent target model accepts for `req` in its next verify:
    a pattern over 0 to all of them."""
    return int(req.spec_verify_ct + len(req.origin_input_ids)) % EAGLE_DRAFT_TOKENS


def step_attention_ranks(engines: list[Engine], extend_view: bool = False) -> list[Any]:
    """One iteration of data-parallel attention ranks' loops side by side: each rank builds its
    own batch (`get_next_batch_to_run`), and, as `prepare_mlp_sync_batch` has the ranks agree,
    a rank without one runs SGLang's idle batch while any other runs a batch. With
    `extend_view`, a rank decoding while another runs a prefill views its decode batch as an
    extend (`convert_decode_to_extend`), as `maybe_convert_decode_to_extend` does where the
    ranks can replay the prefill CUDA graphs. The batches run, None where every rank idled."""
    batches = [engine.next_batch() for engine in engines]
    batches = [None if b is not None and b.is_empty() else b for b in batches]
    if all(batch is None for batch in batches):
        return [engine.run_step(None) for engine in engines]
    prefilling = any(b is not None and b.forward_mode.is_extend() for b in batches)
    ran = []
    for engine, batch in zip(engines, batches, strict=True):
        if batch is None:
            batch = engine.idle_batch()
        elif extend_view and prefilling and batch.forward_mode.is_decode():
            batch.convert_decode_to_extend()
        ran.append(engine.run_step(batch))
    return ran
