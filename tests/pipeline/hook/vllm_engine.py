"""vLLM's real v1 scheduler on the CPU: a tiny hand-written model config (no weights), and an
engine loop that calls the scheduler as `vllm/v1/engine/core.py` does, with synthetic model
outputs in place of the workers."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import CachedRequestData
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tests.pipeline.hook.recorded_steps import TINY_LLAMA

BLOCK_SIZE = 16
# vLLM 0.34 removed ModelRunnerOutput.req_id_to_index.
HAS_REQ_ID_TO_INDEX = "req_id_to_index" in {f.name for f in fields(ModelRunnerOutput)}
# vLLM 0.34 removed CachedRequestData.resumed_req_ids (resumed requests are sent as new).
HAS_RESUMED_REQ_IDS = "resumed_req_ids" in {f.name for f in fields(CachedRequestData)}
SAMPLED_TOKEN = 7
DRAFT_TOKENS = [5, 6]


def vllm_config(
    model_dir: Path,
    *,
    num_gpu_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    async_scheduling: bool,
    num_speculative_tokens: int = 2,
    served_model_name: str | None = None,
    tensor_parallel_size: int = 1,
) -> VllmConfig:
    """An engine config as `vllm serve` would build it, for the model config in model_dir."""
    config_file = model_dir / "config.json"
    if not config_file.exists():
        model_dir.mkdir(parents=True, exist_ok=True)
        config_file.write_text(json.dumps(TINY_LLAMA))
    model = ModelConfig(
        model=str(model_dir),
        served_model_name=served_model_name,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=2048,
    )
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_gpu_blocks
    speculative = (
        SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=num_speculative_tokens,
            prompt_lookup_max=3,
            prompt_lookup_min=2,
        )
        if num_speculative_tokens
        else None
    )
    return VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=2048,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            async_scheduling=async_scheduling,
        ),
        cache_config=cache,
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
        speculative_config=speculative,
    )


def kv_cache_config(num_blocks: int, sliding_window: int | None = None) -> KVCacheConfig:
    """One full-attention KV-cache group; with `sliding_window`, layer 1 is a second group
    attending to that many tokens (a hybrid model, as Gemma 3 or gpt-oss)."""
    shape: dict[str, Any] = {
        "block_size": BLOCK_SIZE,
        "num_kv_heads": 2,
        "head_size": 16,
        "dtype": torch.float32,
    }
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], FullAttentionSpec(**shape))]
    if sliding_window is not None:
        groups.append(
            KVCacheGroupSpec(
                ["model.layers.1.self_attn.attn"],
                SlidingWindowSpec(**shape, sliding_window=sliding_window),
            )
        )
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def build_scheduler(
    scheduler_class: type, config: VllmConfig, sliding_window: int | None = None
) -> Any:
    """The scheduler vLLM's EngineCore builds from `scheduler_cls`, with the same arguments."""
    num_blocks = config.cache_config.num_gpu_blocks
    assert num_blocks is not None
    return scheduler_class(
        vllm_config=config,
        kv_cache_config=kv_cache_config(num_blocks, sliding_window),
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
    )


def request_factory(config: VllmConfig) -> Callable[..., Request]:
    """Requests as EngineCore makes them: prefix-cache block hashes from the configured hash."""
    hash_function = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_function)
    hasher = get_request_block_hasher(BLOCK_SIZE, hash_function)

    def make(
        request_id: str, prompt: list[int], max_tokens: int, resumable: bool = False
    ) -> Request:
        return Request(
            request_id,
            prompt,
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            None,
            block_hasher=hasher,
            resumable=resumable,
        )

    return make


@dataclass
class Engine:
    """EngineCore's loop over one scheduler: `step` (synchronous scheduling: drafts handed
    back by update_draft_token_ids) or `step_with_batch_queue` (async: two batches in flight).

    The synthetic model samples one token for every request that is not a non-final prefill
    chunk (vLLM's `is_prefill_chunk`), and accepts the first draft of each request that had
    drafts. Before that it keeps block tables as vLLM's V1 model runner does in the
    scheduler's process (uniprocess executor), which writes into the SchedulerOutput's lists.
    `on_schedule` sees each SchedulerOutput right after schedule() returned it, before
    anything else changes.
    """

    scheduler: Any
    async_scheduling: bool
    on_schedule: Callable[[Any, Any], None] = lambda scheduler, output: None
    batch_queue: deque[tuple[Any, ModelRunnerOutput]] = field(default_factory=deque)
    block_tables: dict[str, tuple[list[int], ...]] = field(default_factory=dict)

    def update_block_tables(self, output: Any) -> None:
        """The block-id bookkeeping of `GPUModelRunner._update_states`
        (vllm/v1/worker/gpu_model_runner.py): a new request's lists are kept as they are sent
        and later extended in place; a resumed request's lists replace its old ones."""
        for request_id in output.finished_req_ids:
            self.block_tables.pop(request_id, None)
        for new in output.scheduled_new_reqs:
            self.block_tables[new.req_id] = new.block_ids
        cached = output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", ())
        for request_id, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if request_id in resumed:
                self.block_tables[request_id] = new_ids
            elif new_ids is not None:
                for held, added in zip(self.block_tables[request_id], new_ids, strict=True):
                    held.extend(added)

    def model_output(self, output: Any) -> ModelRunnerOutput:
        self.update_block_tables(output)
        request_ids = list(output.num_scheduled_tokens)
        sampled = []
        for request_id in request_ids:
            request = self.scheduler.requests[request_id]
            drafts = output.scheduled_spec_decode_tokens.get(request_id, ())
            sampled.append(
                [] if request.is_prefill_chunk else [SAMPLED_TOKEN] * (1 + min(len(drafts), 1))
            )
        # vLLM 0.33's output also maps each request to its row; 0.34's rows follow req_ids.
        fields: dict[str, Any] = {"req_ids": request_ids, "sampled_token_ids": sampled}
        if HAS_REQ_ID_TO_INDEX:
            fields["req_id_to_index"] = {r: i for i, r in enumerate(request_ids)}
        return ModelRunnerOutput(**fields)

    def step(self) -> None:
        if self.async_scheduling:
            self._step_with_batch_queue()
            return
        if not self.scheduler.has_requests():
            return
        output = self.scheduler.schedule(False)
        self.on_schedule(self.scheduler, output)
        model_output = self.model_output(output)
        self.scheduler.update_from_output(output, model_output)
        if output.total_num_scheduled_tokens:
            drafted = [r for r in output.num_scheduled_tokens if self.scheduler.requests.get(r)]
            self.scheduler.update_draft_token_ids(
                DraftTokenIds(drafted, [list(DRAFT_TOKENS) for _ in drafted])
            )

    def _step_with_batch_queue(self) -> None:
        if self.scheduler.has_requests():
            output = self.scheduler.schedule(False)
            self.on_schedule(self.scheduler, output)
            self.batch_queue.appendleft((output, self.model_output(output)))
            if len(self.batch_queue) < 2 and output.total_num_scheduled_tokens:
                return
        if self.batch_queue:
            output, model_output = self.batch_queue.pop()
            self.scheduler.update_from_output(output, model_output)

    def drain(self) -> None:
        while self.batch_queue:
            output, model_output = self.batch_queue.pop()
            self.scheduler.update_from_output(output, model_output)
