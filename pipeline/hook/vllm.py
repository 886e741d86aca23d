"""Record every vLLM engine step with a StepRecorder, through vLLM's `scheduler_cls` option.

Supported: vLLM 0.33.x and 0.34.x (`SUPPORTED_VLLM`), the v1 engine with synchronous or
asynchronous scheduling. Followed there: `vllm/v1/core/sched/scheduler.py` (`Scheduler.schedule`,
`update_from_output`, `running`, `waiting`, `kv_holding_waiting`, `max_num_active_reqs`),
`vllm/v1/core/sched/async_scheduler.py`, `vllm/v1/core/sched/output.py` (`SchedulerOutput`,
`NewRequestData`, `CachedRequestData`), `vllm/v1/request.py` (`Request.prefill_stats`,
`num_preemptions`), `vllm/v1/outputs.py` (`ModelRunnerOutput`),
`vllm/v1/core/kv_cache_manager.py` and `single_type_kv_cache_manager.py` (`get_block_ids`,
`block_pool`, which managers change block lists in place), `vllm/v1/worker/gpu_model_runner.py`
(`_update_states`: what the V1 model runner does to the lists it is sent) and
`vllm/config/parallel.py` (the world size). The scheduler interface is not a stable vLLM API:
an unsupported release is refused when the class is requested, before the engine starts.

The engine thread keeps each step's SchedulerOutput and copies only what may change before the
recorder's writer thread reads it (`scheduled_step`); the writer thread mirrors every live
request's KV blocks from the outputs and builds the step (`RequestMirror`).

Use: `vllm serve ... --async-scheduling --scheduler-cls pipeline.hook.vllm.AsyncRecordingScheduler`
(or `RecordingScheduler` with synchronous scheduling), with STEPLEDGER_OUTBOX (directory for
segments), STEPLEDGER_HOOK_CONFIG (the replica descriptor `stepledger hook-config` writes) and
optionally STEPLEDGER_DRIVER_VERSION set. vLLM is imported only when one of those two classes
is requested; the rest is the standard library and numpy, loaded into the engine's process.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import chain, repeat
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from pipeline.hook.recorder import StepColumns, StepRecorder
from pipeline.hook.replica import (
    HOOK_CONFIG_ENV,
    EngineFacts,
    HookConfigError,
    ReplicaDescriptor,
    checked_header,
    driver_version,
    read_descriptor,
)
from schemas.records import SegmentHeader

log = logging.getLogger(__name__)

ENGINE_NAME = "vllm"
# (major, minor) release series whose scheduler this module follows.
SUPPORTED_VLLM = ((0, 33), (0, 34))
SUPPORTED_RANGE = ">=0.33.0,<0.35.0"
# With async scheduling one step is scheduled while the previous one runs; more outstanding
# steps than this means update_from_output will never come for the oldest.
_MAX_OUTSTANDING_STEPS = 8


class UnsupportedVllmVersion(HookConfigError):
    """The installed vLLM is outside SUPPORTED_RANGE."""


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM release whose scheduler this module does not follow."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or (int(match[1]), int(match[2])) not in SUPPORTED_VLLM:
        raise UnsupportedVllmVersion(
            f"the step-recording scheduler does not support vLLM {version}; "
            f"supported: vllm{SUPPORTED_RANGE} (0.33.x, 0.34.x)"
        )


# --- one shim per attribute that differs between supported releases -----------------------


def sampled_counts(model_runner_output: Any) -> dict[str, int]:
    """Request id -> tokens sampled for it: 0.33 indexes the rows of `sampled_token_ids` by
    `req_id_to_index`; 0.34 removed it, the rows following `req_ids`."""
    sampled = model_runner_output.sampled_token_ids
    if not sampled:
        return {}
    index = getattr(model_runner_output, "req_id_to_index", None)
    if index is not None:
        return dict(zip(index, map(len, map(sampled.__getitem__, index.values())), strict=True))
    return dict(zip(model_runner_output.req_ids, map(len, sampled), strict=True))


def resumed_request_ids(cached_requests: Any) -> Collection[str]:
    """Preempted requests scheduled again among the cached requests, their whole block lists
    in `new_block_ids`: 0.33 (with the V1 model runner) names them in `resumed_req_ids`;
    0.34 removed it and sends them as new requests."""
    return getattr(cached_requests, "resumed_req_ids", ())


def drafts_trimmed_in_place(vllm_config: Any) -> bool:
    """Whether the model runner may trim rejected drafts from the SchedulerOutput itself
    (`num_scheduled_tokens`, `scheduled_spec_decode_tokens`), which it shares with the
    scheduler under a uniprocess executor: 0.33's V1 runner does with the GPU n-gram drafter
    (`update_scheduler_for_invalid_drafts`); 0.34's runners never do."""
    speculative = vllm_config.speculative_config
    return speculative is not None and speculative.method == "ngram_gpu"


def gpus_per_replica(parallel_config: Any) -> int:
    """GPUs one engine occupies: pipeline × tensor × prefill-context parallel size, as vLLM's
    `ParallelConfig.world_size` (which also multiplies in data parallelism under an external
    launcher, where each engine is still one replica)."""
    return int(
        parallel_config.pipeline_parallel_size
        * parallel_config.tensor_parallel_size
        * getattr(parallel_config, "prefill_context_parallel_size", 1)
    )


def prefix_hit_tokens(request: Any) -> int:
    """Prompt tokens found in the prefix cache (local or external) when the request was first
    scheduled: `Request.prefill_stats`, set by schedule() and cleared once output is emitted
    (`Request.num_cached_tokens` no longer exists)."""
    stats = request.prefill_stats
    return int(stats.num_cached_tokens) if stats is not None else 0


def mirrored_groups(kv_cache_manager: Any) -> tuple[int, ...]:
    """KV-cache groups whose block lists change only as the SchedulerOutputs say: those of
    `FullAttentionManager` itself. Its subclasses (sinks, ring buffers, sparse attention) and
    the sliding-window, chunked-local and Mamba managers free or replace blocks in place
    (`remove_skipped_blocks`), which no SchedulerOutput reports."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    managers = kv_cache_manager.coordinator.single_type_managers
    return tuple(g for g, m in enumerate(managers) if type(m) is FullAttentionManager)


def _group_blocks(block_ids: tuple[list[int], ...], groups: tuple[int, ...]) -> list[int]:
    """The block ids of `groups`, one list: a request's share does not depend on the group."""
    return list(chain.from_iterable(map(block_ids.__getitem__, groups)))


@dataclass(slots=True)
class NewRequest:
    """A request sent to the workers whole (first schedule, a streaming session's next input,
    a preempted request resumed): its blocks copied, because vLLM's V1 model runner keeps the
    SchedulerOutput's lists as its block table and extends them in place on later steps."""

    request_id: str
    context_tokens: int
    prompt_tokens: int
    prefix_hit_tokens: int
    blocks: list[int]


@dataclass(slots=True)
class ScheduledStep:
    """What the engine thread keeps of one schedule(): the SchedulerOutput (a new object each
    step, which the scheduler does not touch once schedule() returns) and copies of the little
    in it or around it that may change before the writer thread reads it."""

    index: int
    output: Any
    # The output's own dicts, or copies where the model runner may trim them.
    scheduled: dict[str, int]
    drafts: dict[str, list[int]]
    new_requests: Sequence[NewRequest]
    resumed_blocks: Mapping[str, list[int]]
    # Waiting requests that hold blocks (streaming sessions between inputs, requests waiting
    # for remote KV, whose blocks no SchedulerOutput has shown yet), copied.
    waiting_holders: Mapping[str, list[int]]
    # Groups outside the mirror: every request's KVCacheBlock list, copied.
    unmirrored_owners: Sequence[str]
    unmirrored_blocks: Sequence[list[Any]]
    admission_blocked: bool
    free_blocks: int


# Shared by the steps that have none: each allocation on the engine thread counts.
_NOTHING: Mapping[str, list[int]] = MappingProxyType({})
_NO_SAMPLES: Mapping[str, int] = MappingProxyType({})


def _new_requests(scheduler: Any, output: Any, groups: tuple[int, ...]) -> list[NewRequest]:
    requests = scheduler.requests
    new_requests = []
    for new in output.scheduled_new_reqs:
        request = requests[new.req_id]
        new_requests.append(
            NewRequest(
                new.req_id,
                new.num_computed_tokens,
                request.num_prompt_tokens,
                prefix_hit_tokens(request) if request.num_preemptions == 0 else 0,
                _group_blocks(new.block_ids, groups),
            )
        )
    return new_requests


def _resumed_blocks(cached: Any, groups: tuple[int, ...]) -> Mapping[str, list[int]]:
    resumed = resumed_request_ids(cached)
    if not resumed:
        return _NOTHING
    return {
        request_id: _group_blocks(blocks, groups)
        for request_id, blocks in zip(cached.req_ids, cached.new_block_ids, strict=True)
        if request_id in resumed
    }


def _unmirrored_lists(
    kv_cache_manager: Any, unmirrored: tuple[int, ...]
) -> tuple[list[str], list[list[Any]]]:
    owners: list[str] = []
    blocks: list[list[Any]] = []
    for group in unmirrored:
        lists = kv_cache_manager.coordinator.single_type_managers[group].req_to_blocks
        owners.extend(lists)
        blocks.extend(map(list.copy, lists.values()))
    return owners, blocks


def scheduled_step(
    scheduler: Any,
    output: Any,
    index: int,
    groups: tuple[int, ...],
    unmirrored: tuple[int, ...],
    copy_drafts: bool,
) -> ScheduledStep:
    """The engine thread's part of a step: only what the writer thread could not read later.

    Per request it touches only the requests sent whole (new or resumed), the waiting requests
    that hold blocks and the groups outside the mirror: nothing in a step of running requests
    decoding with full attention. admission_blocked: the step preempted a request, or
    admissible requests were left waiting although neither `max_num_active_reqs` (streaming
    sessions included) nor the token budget was reached, so free KV blocks stopped them
    (vLLM's other admission limits, such as LoRA slots, are counted here too).
    """
    manager = scheduler.kv_cache_manager
    waiting = scheduler.kv_holding_waiting
    admissible_waiting = len(scheduler.waiting) + len(waiting) > len(scheduler.deferred_waiting)
    under_limits = (
        len(scheduler.running) + scheduler.num_waiting_for_streaming_input
        < scheduler.max_num_active_reqs
        and output.total_num_scheduled_tokens < scheduler.max_num_scheduled_tokens
    )
    scheduled, drafts = output.num_scheduled_tokens, output.scheduled_spec_decode_tokens
    owners, unmirrored_blocks = _unmirrored_lists(manager, unmirrored) if unmirrored else ((), ())
    # Positional: keyword construction costs the engine thread a microsecond more.
    return ScheduledStep(
        index,
        output,
        dict(scheduled) if copy_drafts else scheduled,
        dict(drafts) if copy_drafts else drafts,
        _new_requests(scheduler, output, groups) if output.scheduled_new_reqs else (),
        _resumed_blocks(output.scheduled_cached_reqs, groups),
        {r.request_id: _group_blocks(manager.get_block_ids(r.request_id), groups) for r in waiting}
        if waiting
        else _NOTHING,
        owners,
        unmirrored_blocks,
        bool((admissible_waiting and under_limits) or output.preempted_req_ids),
        manager.block_pool.get_num_free_blocks(),
    )


def kv_shares(
    owners: Sequence[str],
    blocks: Sequence[list[int]],
    null_block: int,
    num_blocks: int,
    request_ids: list[str],
) -> np.ndarray:
    """KV blocks held by each of `request_ids`, given every block list held (`blocks[i]` by
    `owners[i]`; an owner may have several lists; block ids below `num_blocks`): a block held
    by k requests counts 1/k to each, the null block (a placeholder for blocks a window
    dropped) 0."""
    lengths = np.fromiter(map(len, blocks), np.int64, len(blocks))
    ids = np.fromiter(chain.from_iterable(blocks), np.int64, int(lengths.sum()))
    weights = 1.0 / np.bincount(ids, minlength=num_blocks)[ids]
    weights[ids == null_block] = 0.0
    owner_rows = {owner: row for row, owner in enumerate(dict.fromkeys(owners))}
    owner_of_list = np.fromiter(map(owner_rows.__getitem__, owners), np.int64, len(owners))
    per_owner = np.bincount(
        np.repeat(owner_of_list, lengths), weights=weights, minlength=len(owner_rows)
    )
    rows = np.fromiter(map(owner_rows.get, request_ids, repeat(-1)), np.int64, len(request_ids))
    return np.where(rows >= 0, per_owner[rows], 0.0)


class RequestMirror:
    """The writer thread's view of every live request, built from the SchedulerOutputs in the
    order they were scheduled, the way vLLM's model runner builds its block table: block ids
    (mirrored groups) from new requests, appended from cached requests' `new_block_ids`,
    forgotten when a request is preempted or finished; prompt lengths until it finishes.

    Steps left unrecorded (dropped, or scheduling no tokens but freeing requests) are applied
    all the same, by the next step built.
    """

    def __init__(self, groups: tuple[int, ...], null_block: int, total_blocks: int) -> None:
        self.groups = groups
        self.null_block = null_block
        self.total_blocks = total_blocks
        # Engine thread appends, writer thread pops (deque operations are atomic).
        self._pending: deque[ScheduledStep] = deque()
        # Engine thread: queue a step's changes, in schedule order (the deque's own method,
        # no Python frame).
        self.follow = self._pending.append
        self._applied = 0
        self._blocks: dict[str, list[int]] = {}
        self._prompt_tokens: dict[str, int] = {}

    def _apply(self, step: ScheduledStep) -> None:
        output, blocks = step.output, self._blocks
        for request_id in output.finished_req_ids:
            blocks.pop(request_id, None)
            self._prompt_tokens.pop(request_id, None)
        for request_id in output.preempted_req_ids or ():
            blocks.pop(request_id, None)
        for new in step.new_requests:
            blocks[new.request_id] = new.blocks
            self._prompt_tokens[new.request_id] = new.prompt_tokens
        cached, resumed = output.scheduled_cached_reqs, step.resumed_blocks
        for request_id, new_blocks in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if request_id in resumed:
                blocks[request_id] = resumed[request_id]
            elif new_blocks is not None:
                held = blocks.get(request_id)
                if held is None:
                    raise ValueError(
                        f"request {request_id!r} got KV blocks in schedule() call "
                        f"{step.index} but was never scheduled as a new request"
                    )
                held.extend(_group_blocks(new_blocks, self.groups))
        self._applied = step.index

    def columns(self, step: ScheduledStep, sampled: Mapping[str, int]) -> StepColumns:
        """Writer thread: the step's record_step columns after the time span, in order."""
        pending = self._pending
        while pending and pending[0].index <= step.index:
            self._apply(pending.popleft())
        if self._applied != step.index:
            raise ValueError(
                f"schedule() call {step.index} completed after call {self._applied}: vLLM "
                "returned results out of schedule order, the KV shares of that moment are gone"
            )
        scheduled = step.scheduled
        request_ids = list(scheduled)
        live = {**self._blocks, **step.waiting_holders} if step.waiting_holders else self._blocks
        holder_ids = [request_id for request_id in live if request_id not in scheduled]
        owners = [*live, *step.unmirrored_owners]
        block_lists = [*live.values()]
        block_lists.extend([block.block_id for block in b] for b in step.unmirrored_blocks)
        held = kv_shares(
            owners, block_lists, self.null_block, self.total_blocks, request_ids + holder_ids
        )
        slots = len(request_ids)
        holder_blocks = held[slots:]
        holding = np.flatnonzero(holder_blocks > 0)

        cached = step.output.scheduled_cached_reqs
        computed = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        hits = {}
        for new in step.new_requests:
            computed[new.request_id] = new.context_tokens
            hits[new.request_id] = new.prefix_hit_tokens
        drafted = (
            list(map(len, map(step.drafts.get, request_ids, repeat(()))))
            if step.drafts
            else [0] * slots
        )
        accepted = [
            min(max(sampled.get(request_id, 0) - 1, 0), drafts)
            for request_id, drafts in zip(request_ids, drafted, strict=True)
        ]
        return (
            request_ids,
            list(scheduled.values()),
            list(map(computed.__getitem__, request_ids)),
            held[:slots],
            list(map(self._prompt_tokens.__getitem__, request_ids)),
            list(map(hits.get, request_ids, repeat(0))),
            drafted,
            accepted,
            [holder_ids[i] for i in holding],
            holder_blocks[holding],
            ["waiting"] * len(holding),
            step.admission_blocked,
            step.free_blocks,
            self.total_blocks,
        )


def gpu_name() -> str | None:
    """The GPU vLLM's platform reports for this engine's first device, or None where it reports
    none (the CPU platform, or no accelerator detected)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return None
    try:
        return str(current_platform.get_device_name(0))
    except NotImplementedError:
        return None


def header_for(
    replica: ReplicaDescriptor,
    vllm_config: Any,
    device: str | None,
    engine_version: str,
    driver: str,
    kv_block_size: int,
) -> SegmentHeader:
    """The segment header of `replica`, refused unless the engine runs what its pool declares
    (`checked_header`). vLLM knows its model by the first of `--served-model-name` (else the
    model) and by the model's path or repository."""
    gpus = gpus_per_replica(vllm_config.parallel_config)
    model_config = vllm_config.model_config
    engine = EngineFacts(
        engine_name=ENGINE_NAME,
        engine_version=engine_version,
        driver_version=driver,
        gpus=gpus,
        gpus_described=f"{gpus} GPUs",
        served_model_name=str(model_config.served_model_name),
        model=str(model_config.model),
        device=device,
        kv_block_size=kv_block_size,
    )
    return checked_header(replica, engine)


def recorder_from_environment(scheduler: Any) -> StepRecorder:
    """A StepRecorder for the replica described by the file STEPLEDGER_HOOK_CONFIG names."""
    import vllm

    missing = [name for name in ("STEPLEDGER_OUTBOX", HOOK_CONFIG_ENV) if not os.environ.get(name)]
    if missing:
        raise HookConfigError(f"the step-recording scheduler needs environment variables {missing}")
    header = header_for(
        read_descriptor(Path(os.environ[HOOK_CONFIG_ENV])),
        scheduler.vllm_config,
        gpu_name(),
        vllm.__version__,
        driver_version(),
        scheduler.block_size,
    )
    return StepRecorder(Path(os.environ["STEPLEDGER_OUTBOX"]), header)


def recording_scheduler_class(
    base: type, recorder_factory: Callable[[Any], StepRecorder] = recorder_from_environment
) -> type:
    """A subclass of vLLM scheduler class `base` that records each step it schedules.

    A step spans from the moment schedule() hands the batch to the workers to the moment
    update_from_output() receives its result (host time around the forward pass).
    """

    # The base is vLLM's class, known only at run time.
    class RecordingScheduler(base):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.step_recorder = recorder_factory(self)
            manager = self.kv_cache_manager
            groups = mirrored_groups(manager)
            self._unmirrored = tuple(
                g for g in range(len(manager.coordinator.single_type_managers)) if g not in groups
            )
            block_pool = manager.block_pool
            self._mirror = RequestMirror(
                groups, block_pool.null_block.block_id, block_pool.num_gpu_blocks
            )
            self._schedules = 0
            self._copy_drafts = drafts_trimmed_in_place(self.vllm_config)
            # Bound once: the engine thread pays for every attribute lookup, every step.
            self._follow = self._mirror.follow
            self._columns = self._mirror.columns
            self._record_later = self.step_recorder.record_step_later
            # id(SchedulerOutput) -> (start ns, step): update_from_output receives the same
            # object schedule() returned, so pairing is exact under async scheduling too.
            self._outstanding: dict[int, tuple[int, ScheduledStep]] = {}

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            output = super().schedule(*args, **kwargs)
            start_ns = time.monotonic_ns()
            recorded = output.total_num_scheduled_tokens > 0
            if recorded or output.finished_req_ids or output.preempted_req_ids:
                self._schedules += 1
                step = scheduled_step(
                    self,
                    output,
                    self._schedules,
                    self._mirror.groups,
                    self._unmirrored,
                    self._copy_drafts,
                )
                self._follow(step)
                if recorded:
                    if len(self._outstanding) >= _MAX_OUTSTANDING_STEPS:
                        del self._outstanding[next(iter(self._outstanding))]
                        self.step_recorder.drop_step()
                    self._outstanding[id(output)] = (start_ns, step)
            return output

        def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
            end_ns = time.monotonic_ns()
            outstanding = self._outstanding.pop(id(scheduler_output), None)
            if outstanding is not None:
                start_ns, step = outstanding
                # Counted now: update_from_output trims the sampled lists at a stop token.
                sampled = sampled_counts(model_runner_output) if step.drafts else _NO_SAMPLES
                self._record_later(start_ns, end_ns, partial(self._columns, step, sampled))
            return super().update_from_output(scheduler_output, model_runner_output)

        def shutdown(self) -> None:
            try:
                super().shutdown()
            finally:
                self.step_recorder.close()

    RecordingScheduler.__name__ = RecordingScheduler.__qualname__ = f"Recording{base.__name__}"
    return RecordingScheduler


def _vllm_scheduler(name: str) -> type:
    import vllm

    check_vllm_version(vllm.__version__)
    log.info(
        "stepledger records steps of vLLM %s (supported: vllm%s)", vllm.__version__, SUPPORTED_RANGE
    )
    if name == "RecordingScheduler":
        from vllm.v1.core.sched.scheduler import Scheduler

        return recording_scheduler_class(Scheduler)
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    return recording_scheduler_class(AsyncScheduler)


_BUILT: dict[str, type] = {}


def __getattr__(name: str) -> type:
    # vLLM resolves `--scheduler-cls module.Name` with getattr; build the class on demand.
    if name not in ("RecordingScheduler", "AsyncRecordingScheduler"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _BUILT:
        _BUILT[name] = _vllm_scheduler(name)
    return _BUILT[name]
