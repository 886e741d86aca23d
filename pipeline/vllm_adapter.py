"""Record every vLLM engine step with a StepRecorder, through vLLM's `scheduler_cls` option.

Supported: vLLM 0.33.x and 0.34.x (`SUPPORTED_VLLM`), the v1 engine with synchronous or
asynchronous scheduling. Followed there: `vllm/v1/core/sched/scheduler.py` (`Scheduler.schedule`,
`update_from_output`, `running`, `waiting`, `kv_holding_waiting`, `max_num_active_reqs`),
`vllm/v1/core/sched/async_scheduler.py`, `vllm/v1/core/sched/output.py` (`SchedulerOutput`),
`vllm/v1/request.py` (`Request.prefill_stats`, `num_preemptions`), `vllm/v1/outputs.py`
(`ModelRunnerOutput`), `vllm/v1/core/kv_cache_manager.py` (`get_block_ids`, `block_pool`) and
`vllm/config/parallel.py` (the world size). The scheduler interface is not a stable vLLM API:
an unsupported release is refused when the class is requested, before the engine starts.

Use: `vllm serve ... --async-scheduling --scheduler-cls pipeline.vllm_adapter.AsyncRecordingScheduler`
(or `RecordingScheduler` with synchronous scheduling), with STEPLEDGER_OUTBOX (directory for
segments), STEPLEDGER_REPLICA (replica id in the pools file) and optionally STEPLEDGER_POOLS
(pools file) and STEPLEDGER_DRIVER_VERSION set. vLLM is imported only when one of those two
classes is requested.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from itertools import chain, repeat
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.steplog import SegmentHeader, StepRecorder
from pipeline.steplog.recorder import StepColumns
from schemas.config import DEFAULT_POOLS_PATH, ConfigError, Pool, load_pools

log = logging.getLogger(__name__)

ENGINE_NAME = "vllm"
# (major, minor) release series whose scheduler this module follows.
SUPPORTED_VLLM = ((0, 33), (0, 34))
SUPPORTED_RANGE = ">=0.33.0,<0.35.0"
# With async scheduling one step is scheduled while the previous one runs; more outstanding
# steps than this means update_from_output will never come for the oldest.
_MAX_OUTSTANDING_STEPS = 8
_PROMPT_TOKENS = attrgetter("num_prompt_tokens")


class UnsupportedVllmVersion(ConfigError):
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


def sampled_index(model_runner_output: Any) -> Mapping[str, int]:
    """Request id -> row of `sampled_token_ids`: 0.33 sends `req_id_to_index`; 0.34 removed
    it, the rows following `req_ids`."""
    index = getattr(model_runner_output, "req_id_to_index", None)
    if index is not None:
        return index  # type: ignore[no-any-return]
    return {request_id: row for row, request_id in enumerate(model_runner_output.req_ids)}


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


@dataclass
class BlockSnapshot:
    """Every request's KV block lists as they were when a step was scheduled, per KV-cache
    group: copies, because vLLM appends to the live lists, redirects a partial prefix hit to
    a private copy in place (`_apply_cow`) and nulls blocks that left a sliding window. Copying
    is all the engine thread does; the shares are counted later, on the recorder's thread."""

    null_block: Any
    owners: list[str]
    blocks: list[list[Any]]

    def held(self, request_ids: list[str]) -> np.ndarray:
        """KV blocks held by each of `request_ids`, a block held by k requests counting 1/k
        (the null block, a placeholder for blocks a window dropped, counting 0)."""
        lengths = np.fromiter(map(len, self.blocks), np.int64, len(self.blocks))
        identities = np.fromiter(
            map(id, chain.from_iterable(self.blocks)), np.int64, int(lengths.sum())
        )
        _, holders, counts = np.unique(identities, return_inverse=True, return_counts=True)
        weights = 1.0 / counts[holders]
        weights[identities == id(self.null_block)] = 0.0
        owner_rows = {owner: row for row, owner in enumerate(dict.fromkeys(self.owners))}
        owner_of_list = np.fromiter(map(owner_rows.__getitem__, self.owners), np.int64)
        per_owner = np.bincount(
            np.repeat(owner_of_list, lengths), weights=weights, minlength=len(owner_rows)
        )
        rows = np.fromiter(map(owner_rows.get, request_ids, repeat(-1)), np.int64)
        return np.where(rows >= 0, per_owner[rows], 0.0)


def block_snapshot(kv_cache_manager: Any) -> BlockSnapshot:
    """The block lists of every request in every KV-cache group, as they are now
    (`coordinator.single_type_managers[g].req_to_blocks`, in 0.33 and 0.34)."""
    owners: list[str] = []
    blocks: list[list[Any]] = []
    for manager in kv_cache_manager.coordinator.single_type_managers:
        owners.extend(manager.req_to_blocks)
        blocks.extend(map(list.copy, manager.req_to_blocks.values()))
    return BlockSnapshot(kv_cache_manager.block_pool.null_block, owners, blocks)


@dataclass
class ScheduledStep:
    """record_step arguments of one step, captured when it was scheduled; the KV-block
    shares are left as a snapshot, to be counted off the engine thread by columns()."""

    request_ids: list[str]
    new_tokens: list[int]
    context_tokens: list[int]
    blocks: BlockSnapshot
    prompt_tokens: list[int]
    prefix_hit_tokens: list[int]
    spec_drafted: list[int]
    holder_ids: list[str] = field(default_factory=list)
    admission_blocked: bool = False
    free_blocks: int = 0
    total_blocks: int = 0

    def columns(self, spec_accepted: list[int]) -> StepColumns:
        """The step's record_step columns after the time span, in order."""
        held = self.blocks.held(self.request_ids + self.holder_ids)
        slots = len(self.request_ids)
        holder_blocks = held[slots:]
        holding = np.flatnonzero(holder_blocks > 0)
        return (
            self.request_ids,
            self.new_tokens,
            self.context_tokens,
            held[:slots],
            self.prompt_tokens,
            self.prefix_hit_tokens,
            self.spec_drafted,
            spec_accepted,
            [self.holder_ids[i] for i in holding],
            holder_blocks[holding],
            ["waiting"] * len(holding),
            self.admission_blocked,
            self.free_blocks,
            self.total_blocks,
        )


def scheduled_step(scheduler: Any, output: Any) -> ScheduledStep:
    """Map a vLLM scheduler and the SchedulerOutput it just produced onto one step's slots.

    - new_tokens: `num_scheduled_tokens` (includes speculative drafts); spec_drafted: the
      length of `scheduled_spec_decode_tokens[req]`.
    - context_tokens: `num_computed_tokens` as sent to the workers (before this step).
    - prefix_hit_tokens: `prefix_hit_tokens(request)`, on the request's first schedule only.
    - holders: running requests not scheduled this step, and waiting requests that keep their
      KV blocks (`kv_holding_waiting`: streaming sessions between inputs, requests waiting for
      remote KV), all in state "waiting". A preempted request frees its blocks in vLLM
      (`_preempt_request`), so it holds nothing and is not a holder.
    - admission_blocked: the step preempted a request, or admissible requests were left
      waiting although neither `max_num_active_reqs` (streaming sessions included) nor the
      token budget was reached, so free KV blocks stopped them (vLLM's other admission limits,
      such as LoRA slots, are counted here too).
    """
    requests = scheduler.requests
    scheduled = output.num_scheduled_tokens
    request_ids = list(scheduled)
    cached = output.scheduled_cached_reqs
    computed = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
    computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
    first_hits = {
        new.req_id: prefix_hit_tokens(requests[new.req_id])
        for new in output.scheduled_new_reqs
        if requests[new.req_id].num_preemptions == 0
    }
    drafts = output.scheduled_spec_decode_tokens

    # Everything scheduled is in `running` once schedule() returns, so equal lengths mean
    # no running request was left out.
    running = scheduler.running
    holder_ids = (
        [r.request_id for r in running if r.request_id not in scheduled]
        if len(running) > len(scheduled)
        else []
    )
    holder_ids.extend(r.request_id for r in scheduler.kv_holding_waiting)

    block_pool = scheduler.kv_cache_manager.block_pool
    admissible_waiting = len(scheduler.waiting) + len(scheduler.kv_holding_waiting) > len(
        scheduler.deferred_waiting
    )
    active = len(running) + scheduler.num_waiting_for_streaming_input
    under_limits = (
        active < scheduler.max_num_active_reqs
        and output.total_num_scheduled_tokens < scheduler.max_num_scheduled_tokens
    )
    # The slot columns come from map() over C-level getters, outside the interpreter loop.
    slots = len(request_ids)
    return ScheduledStep(
        request_ids=request_ids,
        new_tokens=list(scheduled.values()),
        context_tokens=list(map(computed.__getitem__, request_ids)),
        blocks=block_snapshot(scheduler.kv_cache_manager),
        prompt_tokens=list(map(_PROMPT_TOKENS, map(requests.__getitem__, request_ids))),
        prefix_hit_tokens=(
            list(map(first_hits.get, request_ids, repeat(0))) if first_hits else [0] * slots
        ),
        spec_drafted=(
            list(map(len, map(drafts.get, request_ids, repeat(())))) if drafts else [0] * slots
        ),
        holder_ids=holder_ids,
        admission_blocked=bool((admissible_waiting and under_limits) or output.preempted_req_ids),
        free_blocks=block_pool.get_num_free_blocks(),
        total_blocks=block_pool.num_gpu_blocks,
    )


def accepted_tokens(step: ScheduledStep, model_runner_output: Any) -> list[int]:
    """Draft tokens accepted per slot: vLLM samples accepted drafts plus one bonus token."""
    sampled = model_runner_output.sampled_token_ids
    if not sampled or not any(step.spec_drafted):
        return [0] * len(step.request_ids)
    index = sampled_index(model_runner_output)
    accepted = []
    for request_id, drafted in zip(step.request_ids, step.spec_drafted, strict=False):
        row = index.get(request_id)
        tokens = len(sampled[row]) if drafted and row is not None else 0
        accepted.append(min(max(tokens - 1, 0), drafted))
    return accepted


def driver_version() -> str:
    """The NVIDIA kernel driver version, from STEPLEDGER_DRIVER_VERSION or /proc."""
    configured = os.environ.get("STEPLEDGER_DRIVER_VERSION")
    if configured:
        return configured
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return "unknown"
    for word in text.split():
        if word.count(".") >= 1 and word.replace(".", "").isdigit():
            return word
    return "unknown"


def header_for(
    pool: Pool, replica: str, engine_version: str, driver: str, gpus: int, kv_block_size: int
) -> SegmentHeader:
    """The segment header of `replica`; the engine's parallelism must match the pools file."""
    if replica not in {r.id for r in pool.replicas}:
        raise ConfigError(f"replica {replica!r} is not listed in pool {pool.name!r}")
    if gpus != pool.gpus_per_replica:
        raise ConfigError(
            f"replica {replica!r} runs on {gpus} GPUs but pool {pool.name!r} declares gpus_per_replica={pool.gpus_per_replica}"
        )
    return SegmentHeader(
        pool=pool.name,
        replica=replica,
        engine_name=ENGINE_NAME,
        engine_version=engine_version,
        driver_version=driver,
        model=pool.model,
        gpu_type=pool.gpu_type,
        gpus_per_replica=gpus,
        kv_block_size=kv_block_size,
    )


def recorder_from_environment(scheduler: Any) -> StepRecorder:
    """A StepRecorder for the replica named by STEPLEDGER_REPLICA in STEPLEDGER_POOLS."""
    import vllm

    missing = [
        name for name in ("STEPLEDGER_OUTBOX", "STEPLEDGER_REPLICA") if not os.environ.get(name)
    ]
    if missing:
        raise ConfigError(f"the step-recording scheduler needs environment variables {missing}")
    replica = os.environ["STEPLEDGER_REPLICA"]
    pools = load_pools(os.environ.get("STEPLEDGER_POOLS", DEFAULT_POOLS_PATH))
    pool = next((p for p in pools.pools if replica in {r.id for r in p.replicas}), None)
    if pool is None:
        raise ConfigError(
            f"replica {replica!r} (STEPLEDGER_REPLICA) is in no pool of the pools file"
        )
    gpus = gpus_per_replica(scheduler.vllm_config.parallel_config)
    header = header_for(
        pool, replica, vllm.__version__, driver_version(), gpus, scheduler.block_size
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
            # id(SchedulerOutput) -> (start ns, step): update_from_output receives the same
            # object schedule() returned, so pairing is exact under async scheduling too.
            self._outstanding: dict[int, tuple[int, ScheduledStep]] = {}

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            output = super().schedule(*args, **kwargs)
            if output.total_num_scheduled_tokens:
                if len(self._outstanding) >= _MAX_OUTSTANDING_STEPS:
                    del self._outstanding[next(iter(self._outstanding))]
                    self.step_recorder.drop_step()
                self._outstanding[id(output)] = (time.monotonic_ns(), scheduled_step(self, output))
            return output

        def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
            end_ns = time.monotonic_ns()
            outstanding = self._outstanding.pop(id(scheduler_output), None)
            if outstanding is not None:
                start_ns, step = outstanding
                accepted = accepted_tokens(step, model_runner_output)
                self.step_recorder.record_step_later(
                    start_ns, end_ns, partial(step.columns, accepted)
                )
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
