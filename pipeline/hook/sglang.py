"""Record every forward batch SGLang's scheduler runs with a StepRecorder, through SGLang's
plugin hooks (`sglang.srt.plugins`): the scheduler class is replaced by a subclass that
records.

Supported: sglang 0.5.23 (`SUPPORTED_SGLANG`), the normal and the overlap event loop, data-parallel
attention (each rank's scheduler records its own batches as a stream of its own,
`rank_stream_id`), without pipeline parallelism; speculative decoding with the
algorithms of `SPECULATIVE_ALGORITHMS` in the normal loop without mixed chunks. Followed
there: `sglang/srt/managers/scheduler.py` (`Scheduler.run_batch`, `process_batch_result`,
`_add_request_to_queue`, `running_batch`, `chunked_req`, `waiting_queue`,
`event_loop_overlap`: results are processed in launch order, on a copy of the batch),
`managers/schedule_batch.py` (`ScheduleBatch.forward_mode`, `reqs`, `seq_lens_cpu` and
`prefix_lens`/`extend_lens`/`decoding_reqs`, new objects each step; `prepare_for_extend`:
`Req.cached_tokens` and `retracted_stain`; `ReqKvInfo`: a request's KV is its row of
`req_to_token` up to its sequence length, the tree owning `[0, cache_protected_len)`),
`mem_cache/common.py` (`checkpoint_kv_cache`, `release_kv_cache`: when that tree-owned part
changes), `mem_cache/radix_cache.py` (`evictable_size`), `speculative/eagle_utils.py`
(`eagle_prepare_for_decode`: a verify batch's KV is allocated, with a reserve, before it runs),
`speculative/eagle_worker_common.py` (a verify advances the batch's sequence lengths by the
tokens it accepts), `scheduler_components/batch_result_processor.py`
(`_resolve_spec_v2_tokens`: a verify result's `num_correct_drafts_per_req_cpu` grows
`Req.spec_num_correct_drafts`; `GenerationBatchResult.speculative_num_draft_tokens`) and
`srt/plugins` (`HookRegistry`).
The scheduler is not a stable SGLang API: an unsupported release is refused when the recording
scheduler is built, before the server serves.

The engine thread keeps each batch's own per-step objects and, for the rows of prefill (extend)
batches only, copies the tree-owned part of their KV row (for the rows of a verify batch, their
allocated KV length); the recorder's writer thread mirrors every live request from those and
builds the step (`RequestMirror`).

Use: install stepledger in SGLang's environment (its `sglang.srt.plugins` entry point is
`register_plugin`), set STEPLEDGER_OUTBOX, STEPLEDGER_HOOK_CONFIG (the replica descriptor
`stepledger hook-config` writes) and optionally STEPLEDGER_DRIVER_VERSION, and start `python -m sglang.launch_server` as usual. Without
STEPLEDGER_OUTBOX the plugin does nothing. SGLang is imported only when the recording
scheduler class is built.
"""

from __future__ import annotations

import logging
import operator
import os
import re
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
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

ENGINE_NAME = "sglang"
# (major, minor, patch) releases whose scheduler this module follows: SGLang changes its
# scheduler's internals between patch releases of the 0.5 series.
SUPPORTED_SGLANG = ((0, 5, 23),)
SUPPORTED_RANGE = ">=0.5.23,<0.5.24"
SCHEDULER_TARGET = "sglang.srt.managers.scheduler.Scheduler"
# In the overlap loop one batch is launched while the previous one's result is processed; more
# outstanding batches than this means a result will never come for the oldest.
_MAX_OUTSTANDING_STEPS = 8
# Speculative algorithms whose decode SGLang prepares with `eagle_prepare_for_decode` and whose
# verify result `_resolve_spec_v2_tokens` settles with one bonus token per request (DFLASH,
# DSPARK and UNO prepare their own; FROZEN_KV_MTP is not yet scheduled by SGLang itself).
SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "STANDALONE", "NGRAM")


class UnsupportedSglangVersion(HookConfigError):
    """The installed SGLang is outside SUPPORTED_RANGE."""


class UnsupportedSglangSetup(HookConfigError):
    """SGLang runs with an option whose steps this module cannot record faithfully."""


def check_sglang_version(version: str) -> None:
    """Refuse an SGLang release whose scheduler this module does not follow (post releases of
    a supported one are accepted)."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if match is None or tuple(map(int, match.groups())) not in SUPPORTED_SGLANG:
        raise UnsupportedSglangVersion(
            f"the step-recording scheduler does not support SGLang {version}; "
            f"supported: sglang{SUPPORTED_RANGE} (0.5.23 and its post releases)"
        )


@dataclass(frozen=True, slots=True)
class Parallelism:
    """The scheduler's place in SGLang's parallel layout (`get_parallel()`)."""

    tp_size: int
    pp_size: int
    moe_ep_size: int
    attn_dp_size: int
    attn_tp_rank: int
    # The attention data-parallel rank whose batches this scheduler runs (0 without it).
    attn_dp_rank: int = 0
    attn_cp_size: int = 1


def check_setup(
    parallel: Parallelism,
    speculative_algorithm: str | None,
    overlap: bool = False,
    mixed_chunk: bool = False,
) -> None:
    """Refuse what a step record cannot say yet: pipeline parallelism runs another event loop;
    under attention context parallelism each context rank's scheduler runs the same batch over
    its part of every sequence, which neither its stream nor its pool prices; a speculative
    algorithm outside SPECULATIVE_ALGORITHMS prepares and settles its drafts in its own way;
    with one, the overlap loop relays verify lengths through SGLang's future map and mixed
    chunks decode running requests beside a prefill with KV left from their verifies, neither
    of which this module follows. `speculative_algorithm`: SGLang's name for it
    (`SpeculativeAlgorithm.name`)."""
    if parallel.pp_size > 1:
        raise UnsupportedSglangSetup(
            f"pipeline parallelism (pp_size={parallel.pp_size}) is not supported"
        )
    if parallel.attn_cp_size > 1:
        raise UnsupportedSglangSetup(
            f"attention context parallelism (attn_cp_size={parallel.attn_cp_size}) is not supported"
        )
    if speculative_algorithm is None:
        return
    if speculative_algorithm not in SPECULATIVE_ALGORITHMS:
        raise UnsupportedSglangSetup(
            f"speculative decoding with {speculative_algorithm} is not supported; supported: "
            f"{', '.join(SPECULATIVE_ALGORITHMS)}"
        )
    if overlap:
        raise UnsupportedSglangSetup(
            f"speculative decoding ({speculative_algorithm}) is recorded only without the "
            "overlap scheduler: start the server with --disable-overlap-schedule"
        )
    if mixed_chunk:
        raise UnsupportedSglangSetup(
            f"speculative decoding ({speculative_algorithm}) is recorded only without mixed "
            "chunks: start the server without --enable-mixed-chunk"
        )


# --- the engine thread's part of a step -----------------------------------------------------


@dataclass(slots=True)
class TreeOwned:
    """The part of a request's KV the radix tree owns (`[0, cache_protected_len)` of its
    row), copied: other requests that matched the same prefix hold the same slots."""

    request_id: str
    slots: Any  # torch int32 tensor, a copy


@dataclass(slots=True)
class ExtendRow:
    """A prefill (extend) row of a batch, as prepare_for_extend left it."""

    request_id: str
    prompt_tokens: int
    # SGLang's own count of the request's cached-prefix tokens so far, or None once the
    # request was retracted (SGLang stops counting then).
    cached_tokens: int | None
    tree_owned: TreeOwned


@dataclass(slots=True)
class VerifiedRows:
    """A speculative decode (verify) batch's rows, from SGLang's own counts: each row's KV
    length once `eagle_prepare_for_decode` allocated the step's drafts (at launch); from the
    result SGLang processed, the tokens verified per row (`speculative_num_draft_tokens`: the
    token sampled last and the drafts after it) and each row's accepted drafts
    (`num_correct_drafts_per_req_cpu`, what SGLang adds to `Req.spec_num_correct_drafts`),
    kept as the result says and checked on the writer thread. In the normal event loop every
    row's result is settled: finished and retracted requests leave the batch before it runs."""

    kv_allocated: Sequence[int]
    num_draft_tokens: Any = None
    accepted: Any = None


@dataclass(slots=True)
class LaunchedStep:
    """What the engine thread keeps of one batch at launch: its per-step objects (each a new
    object every step, which SGLang does not change afterwards) and copies of the little that
    may change before the writer thread reads it."""

    start_ns: int
    reqs: Sequence[Any]
    decoding: bool
    # Each a new object per batch: row sequence lengths after this step's KV is allocated,
    # and, for extend and mixed batches, the rows' cached lengths and tokens computed.
    seq_lens: Any
    prefix_lens: Sequence[int]
    extend_lens: Sequence[int]
    extend_rows: Sequence[ExtendRow]
    holders: Sequence[Any]
    admission_blocked: bool
    free_blocks: int
    verified: VerifiedRows | None = None
    end_ns: int = 0


@dataclass(slots=True)
class Checkpointed:
    """After a batch's result: the tree-owned part of its prefill rows, which
    `checkpoint_kv_cache` extended over what they computed."""

    tree_owned: Sequence[TreeOwned]


_NO_ROWS: tuple[()] = ()
# What a verify batch reads of each request: its KV once the step's drafts were allocated.
_KV_ALLOCATED = operator.attrgetter("kv.kv_allocated_len")


def tree_owned(req: Any, req_to_token: Any) -> TreeOwned:
    kv = req.kv
    return TreeOwned(req.rid, req_to_token[kv.req_pool_idx, : kv.cache_protected_len].clone())


def launched_step(
    start_ns: int,
    batch: Any,
    running_batch: Any,
    chunked_req: Any,
    retracted: bool,
    waiting: int,
    max_running_requests: int,
    free_blocks: int,
    req_to_token: Any,
    in_flight: Sequence[Any] = (),
    speculative: bool = False,
) -> LaunchedStep:
    """The engine thread's part of a launched batch: per request it touches only the prefill
    rows (nothing in a batch of decoding requests). admission_blocked: requests were retracted
    for KV since the last batch, or a decode batch ran while requests waited although the
    batch was below `max_running_requests`: SGLang runs a prefill whenever one fits, so free
    KV stopped them (its other admission limits, such as LoRA slots, are counted here too).
    `in_flight`: the requests of the batch launched before whose result is not processed yet
    (the overlap loop). `speculative`: decode batches verify drafts, and their rows' KV
    lengths are read from the requests."""
    # SGLang 0.5.23 rebinds a batch's request list rather than change it (filter_batch,
    # merge_batch), so the lists are kept as they are, not copied.
    reqs = batch.reqs
    # An idle batch (data-parallel attention) is a step without rows.
    decoding = batch.forward_mode.is_decode() or batch.forward_mode.is_idle()
    # A mixed batch appends the running requests' decode rows after the prefill rows; with
    # data-parallel attention a decode batch may run viewed as an extend batch of decode rows
    # only (`convert_decode_to_extend`, while another rank runs a prefill).
    prefill_rows = 0 if decoding else len(reqs) - len(batch.decoding_reqs or ())
    verified = None
    if decoding:
        extend_rows: Sequence[ExtendRow] = _NO_ROWS
        prefix_lens: Sequence[int] = _NO_ROWS
        extend_lens: Sequence[int] = _NO_ROWS
        if speculative:
            verified = VerifiedRows(list(map(_KV_ALLOCATED, reqs)))
    else:
        extend_rows = [
            ExtendRow(
                req.rid,
                len(req.origin_input_ids),
                None if req.retracted_stain else req.cached_tokens,
                tree_owned(req, req_to_token),
            )
            for req in reqs[:prefill_rows]
        ]
        prefix_lens, extend_lens = batch.prefix_lens, batch.extend_lens
    holders: Sequence[Any] = running_batch.reqs if running_batch is not batch else _NO_ROWS
    if chunked_req is not None and chunked_req not in reqs:
        holders = [*holders, chunked_req]
    if in_flight and in_flight is not reqs and in_flight != reqs:
        # Under overlap, requests whose queued result will finish them are left out of the
        # batch but keep their KV until that result is processed.
        scheduled = set(reqs)
        holders = [
            *holders,
            *(req for req in in_flight if req not in scheduled and req.kv.req_pool_idx is not None),
        ]
    return LaunchedStep(
        start_ns,
        reqs,
        decoding,
        batch.seq_lens_cpu,
        prefix_lens,
        extend_lens,
        extend_rows,
        holders,
        retracted or (not prefill_rows and waiting > 0 and len(reqs) < max_running_requests),
        free_blocks,
        verified,
    )


def checkpointed(step: LaunchedStep, req_to_token: Any) -> Checkpointed:
    """After the batch's result was processed: the tree-owned part of the prefill rows that
    still hold KV (finished ones released theirs)."""
    rows = step.reqs[: len(step.extend_rows)]
    return Checkpointed(
        [tree_owned(req, req_to_token) for req in rows if req.kv.req_pool_idx is not None],
    )


# --- the writer thread --------------------------------------------------------------------


def kv_page_shares(
    tree_pages: Sequence[np.ndarray], own_pages: np.ndarray, num_pages: int
) -> np.ndarray:
    """KV pages held by each request, given the tree-owned pages of each (`tree_pages[i]`,
    page ids below `num_pages`) and the pages it holds alone: a tree page held by k requests
    counts 1/k to each."""
    lengths = np.fromiter(map(len, tree_pages), np.int64, len(tree_pages))
    ids = np.concatenate(tree_pages) if tree_pages else np.empty(0, np.int64)
    weights = 1.0 / np.bincount(ids, minlength=num_pages)[ids]
    owner = np.repeat(np.arange(len(tree_pages)), lengths)
    return own_pages + np.bincount(owner, weights=weights, minlength=len(tree_pages))


def spec_counts(verified: VerifiedRows | None, slots: int) -> tuple[list[int], list[int]]:
    """Each slot's drafts verified (the tokens verified less the one sampled last, as
    SGLang counts proposed drafts) and drafts accepted; zeros outside a verify batch."""
    if verified is None:
        return [0] * slots, [0] * slots
    return [verified.num_draft_tokens - 1] * slots, list(verified.accepted)


@dataclass(slots=True)
class MirroredRequest:
    prompt_tokens: int
    tree_pages: np.ndarray
    # Tokens of KV in its row (its sequence length after its last scheduled step).
    kv_tokens: int
    cached_tokens: int


class RequestMirror:
    """The writer thread's view of every live request, built from the launched batches and
    their checkpoints in the order the engine thread saw them: prompt length, tree-owned KV
    pages, KV length and cached-prefix count; forgotten once a request is neither in a batch
    nor among its holders (finished, aborted or retracted: SGLang then freed its row)."""

    def __init__(self, page_size: int, total_pages: int) -> None:
        self.page_size = page_size
        self.total_pages = total_pages
        # Engine thread appends, writer thread pops (deque operations are atomic).
        self._pending: deque[LaunchedStep | Checkpointed] = deque()
        self.follow = self._pending.append
        self._requests: dict[str, MirroredRequest] = {}

    def _pages(self, slots: Any) -> np.ndarray:
        # The tree owns whole pages: their first slots name them.
        first_slots = np.asarray(slots.numpy()[:: self.page_size], np.int64)
        return first_slots // self.page_size

    def _checkpoint(self, update: Checkpointed) -> None:
        for owned in update.tree_owned:
            mirrored = self._requests.get(owned.request_id)
            if mirrored is not None:
                mirrored.tree_pages = self._pages(owned.slots)

    def _launch(self, step: LaunchedStep) -> tuple[list[str], list[int], list[int], list[int]]:
        """Apply a launched batch; its slots' ids, tokens computed, context and cached-prefix
        hit."""
        request_ids = [req.rid for req in step.reqs]
        requests = self._requests
        hits = [0] * len(request_ids)
        verified = step.verified
        seq_lens = step.seq_lens.tolist()
        if verified is not None:
            # A verify batch's sequence lengths are the tokens in KV before the step: the
            # token sampled last is verified with the drafts after it.
            new_tokens = [verified.num_draft_tokens] * len(request_ids)
            context, seq_lens = seq_lens, list(verified.kv_allocated)
        elif step.decoding:
            new_tokens = [1] * len(request_ids)
            context = [length - 1 for length in seq_lens]
        else:
            new_tokens, context = list(step.extend_lens), list(step.prefix_lens)
            for row, extend in enumerate(step.extend_rows):
                known = requests.get(extend.request_id)
                if extend.cached_tokens is not None:
                    hits[row] = extend.cached_tokens - (known.cached_tokens if known else 0)
                requests[extend.request_id] = MirroredRequest(
                    extend.prompt_tokens,
                    self._pages(extend.tree_owned.slots),
                    0,
                    extend.cached_tokens or 0,
                )
        for request_id, length in zip(request_ids, seq_lens, strict=True):
            requests[request_id].kv_tokens = length
        live = set(request_ids).union(req.rid for req in step.holders)
        for request_id in [r for r in requests if r not in live]:
            del requests[request_id]
        return request_ids, new_tokens, context, hits

    def columns(self, step: LaunchedStep) -> StepColumns:
        """Writer thread: the step's record_step columns after the time span, in order."""
        pending = self._pending
        while pending[0] is not step:
            update = pending.popleft()
            if isinstance(update, Checkpointed):
                self._checkpoint(update)
            else:
                # A batch whose record was dropped still changed the live requests.
                self._launch(update)
        pending.popleft()
        request_ids, new_tokens, context, hits = self._launch(step)
        slot_set = set(request_ids)
        holder_ids = [
            r for r in dict.fromkeys(req.rid for req in step.holders) if r not in slot_set
        ]
        owners = [self._requests[r] for r in request_ids + holder_ids]
        page = self.page_size
        own_pages = np.fromiter(
            (-(-m.kv_tokens // page) - len(m.tree_pages) for m in owners), np.float64, len(owners)
        )
        held = kv_page_shares([m.tree_pages for m in owners], own_pages, self.total_pages)
        slots = len(request_ids)
        holder_blocks = held[slots:]
        holding = np.flatnonzero(holder_blocks > 0)
        drafted, accepted = spec_counts(step.verified, slots)
        return (
            request_ids,
            new_tokens,
            context,
            held[:slots],
            [m.prompt_tokens for m in owners[:slots]],
            hits,
            drafted,
            accepted,
            [holder_ids[i] for i in holding],
            holder_blocks[holding],
            ["waiting"] * len(holding),
            step.admission_blocked,
            step.free_blocks,
            self.total_pages,
        )


class StepTracker:
    """The recording on SGLang's scheduler state: `launched` when a batch is handed to the
    model, `result_arrived` before its result is processed, `result_processed` after."""

    def __init__(
        self,
        recorder: StepRecorder,
        req_to_token: Any,
        page_size: int,
        total_pages: int,
        speculative: bool = False,
        records_idle: bool = False,
    ) -> None:
        self.recorder = recorder
        # Decode batches verify drafts (a speculative algorithm is on).
        self.speculative = speculative
        # With data-parallel attention a rank without requests runs idle batches while the
        # others run theirs (the MoE and MLP layers run across every rank's GPUs): its GPUs
        # are busy, so those steps are recorded, without rows.
        self.records_idle = records_idle
        self.req_to_token = req_to_token
        self.page_size = page_size
        self.mirror = RequestMirror(page_size, total_pages)
        self._follow = self.mirror.follow
        self._columns = self.mirror.columns
        self._record_later = recorder.record_step_later
        # Results are processed in launch order (the overlap loop queues them).
        self._outstanding: deque[LaunchedStep] = deque()

    def follows(self, batch: Any) -> bool:
        """Whether `batch` is recorded: every batch with requests, and idle ones where
        `records_idle`."""
        return bool(batch.reqs) or self.records_idle

    def launched(
        self,
        batch: Any,
        running_batch: Any,
        chunked_req: Any,
        retracted: bool,
        waiting: int,
        max_running_requests: int,
        free_tokens: int,
    ) -> None:
        start_ns = time.monotonic_ns()
        step = launched_step(
            start_ns,
            batch,
            running_batch,
            chunked_req,
            retracted,
            waiting,
            max_running_requests,
            free_tokens // self.page_size,
            self.req_to_token,
            self._outstanding[-1].reqs if self._outstanding else (),
            self.speculative,
        )
        if len(self._outstanding) >= _MAX_OUTSTANDING_STEPS:
            # Never raised into the scheduler: the oldest batch is counted as a drop.
            self._outstanding.popleft()
            self.recorder.drop_step()
        self._follow(step)
        self._outstanding.append(step)

    def result_arrived(self) -> LaunchedStep:
        step = self._outstanding.popleft()
        step.end_ns = time.monotonic_ns()
        return step

    def result_processed(self, step: LaunchedStep, result: Any) -> None:
        """Queue the step's record once SGLang processed its `result` (for a verify batch,
        only then does the result hold each row's accepted drafts)."""
        verified = step.verified
        if verified is not None:
            verified.num_draft_tokens = result.speculative_num_draft_tokens
            verified.accepted = result.num_correct_drafts_per_req_cpu
        self._record_later(step.start_ns, step.end_ns, partial(self._columns, step))
        if step.extend_rows:
            self._follow(checkpointed(step, self.req_to_token))


# --- the scheduler class --------------------------------------------------------------------


def header_for(
    replica: ReplicaDescriptor,
    parallel: Parallelism,
    served_model_name: str | None,
    model_path: str,
    device: str | None,
    engine_version: str,
    driver: str,
    page_size: int,
) -> SegmentHeader:
    """The segment header of `replica`, refused unless the server runs what its pool declares
    (`checked_header`): its GPUs are tensor × pipeline parallel size (expert parallelism splits
    the same GPUs), its attention data-parallel ranks the pool's `data_parallel`; SGLang's
    served name defaults to the model path. With several ranks the header is the rank's
    stream's, on its `tp_size / attn_dp_size` GPUs (SGLang places rank r's attention on TP
    ranks `[r * attn_tp_size, (r + 1) * attn_tp_size)`)."""
    gpus = parallel.tp_size * parallel.pp_size
    engine = EngineFacts(
        engine_name=ENGINE_NAME,
        engine_version=engine_version,
        driver_version=driver,
        gpus=gpus,
        gpus_described=f"{gpus} GPUs (tp_size={parallel.tp_size}, pp_size={parallel.pp_size})",
        served_model_name=served_model_name or model_path,
        model=model_path,
        device=device,
        kv_block_size=page_size,
        tp_size=parallel.tp_size,
        ep_size=parallel.moe_ep_size,
        attn_dp_rank=parallel.attn_dp_rank,
        attn_dp_size=parallel.attn_dp_size,
    )
    return checked_header(replica, engine)


def parallelism() -> Parallelism:
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return Parallelism(
        parallel.tp_size,
        parallel.pp_size,
        parallel.moe_ep_size,
        parallel.attn_dp_size,
        parallel.attn_tp_rank,
        parallel.attn_dp_rank,
        parallel.attn_cp_size,
    )


def gpu_name() -> str | None:
    import torch

    return str(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None


def rank_outbox(outbox: Path, replica: str, header: SegmentHeader) -> Path:
    """Where a scheduler's segments go: STEPLEDGER_OUTBOX is the replica's directory in the
    node's outbox (`OUTBOX/<replica>`, shipped and ingested by its name); an attention
    data-parallel rank's stream goes beside it, `OUTBOX/<stream>`."""
    return outbox if header.replica == replica else outbox.parent / header.replica


def recorder_from_environment(scheduler: Any) -> StepRecorder:
    """A StepRecorder for the replica described by the file STEPLEDGER_HOOK_CONFIG names (for
    its attention data-parallel rank's stream, with several)."""
    import sglang

    missing = [name for name in ("STEPLEDGER_OUTBOX", HOOK_CONFIG_ENV) if not os.environ.get(name)]
    if missing:
        raise HookConfigError(f"the step-recording scheduler needs environment variables {missing}")
    server_args = scheduler.server_args
    replica = read_descriptor(Path(os.environ[HOOK_CONFIG_ENV]))
    header = header_for(
        replica,
        parallelism(),
        server_args.served_model_name,
        server_args.model_path,
        gpu_name(),
        sglang.__version__,
        driver_version(),
        scheduler.page_size,
    )
    outbox = rank_outbox(Path(os.environ["STEPLEDGER_OUTBOX"]), replica.replica, header)
    return StepRecorder(outbox, header)


def recording_scheduler_class(
    base: type, recorder_factory: Callable[[Any], StepRecorder] = recorder_from_environment
) -> type:
    """A subclass of SGLang's scheduler class `base` that records each batch it runs.

    A step spans from the moment run_batch() launches the batch to the moment
    process_batch_result() receives its result (host time around the forward pass). Only the
    first rank of each attention tensor-parallel group records: its ranks schedule the same
    batches (with data-parallel attention, each group its own; `StepTracker.follows`).
    """

    # The base is SGLang's class, known only at run time.
    class RecordingScheduler(base):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            import sglang

            check_sglang_version(sglang.__version__)
            super().__init__(*args, **kwargs)
            parallel = parallelism()
            algorithm = self.spec_algorithm
            speculative = not algorithm.is_none()
            check_setup(
                parallel,
                algorithm.name if speculative else None,
                self.enable_overlap,
                self.server_args.enable_mixed_chunk,
            )
            self._retracted = False
            self.step_tracker: StepTracker | None = None
            if parallel.attn_tp_rank == 0:
                allocator = self.token_to_kv_pool_allocator
                self.step_tracker = StepTracker(
                    recorder_factory(self),
                    self.req_to_token_pool.req_to_token,
                    self.page_size,
                    allocator.size // self.page_size,
                    speculative,
                    records_idle=parallel.attn_dp_size > 1,
                )

        def _add_request_to_queue(self, req: Any, is_retracted: bool = False) -> None:
            self._retracted |= is_retracted
            super()._add_request_to_queue(req, is_retracted)

        def run_batch(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
            tracker = self.step_tracker
            if tracker is not None and tracker.follows(batch):
                tracker.launched(
                    batch,
                    self.running_batch,
                    self.chunked_req,
                    self._retracted,
                    len(self.waiting_queue),
                    self.max_running_requests,
                    self.token_to_kv_pool_allocator.available_size()
                    + self.tree_cache.evictable_size(),
                )
                self._retracted = False
            return super().run_batch(batch, *args, **kwargs)

        def process_batch_result(self, batch: Any, result: Any) -> Any:
            tracker = self.step_tracker
            if tracker is None or not tracker.follows(batch):
                return super().process_batch_result(batch, result)
            step = tracker.result_arrived()
            processed = super().process_batch_result(batch, result)
            tracker.result_processed(step, result)
            return processed

        def release_host_resources(self) -> None:
            try:
                super().release_host_resources()
            finally:
                if self.step_tracker is not None:
                    self.step_tracker.recorder.close()

    RecordingScheduler.__name__ = RecordingScheduler.__qualname__ = f"Recording{base.__name__}"
    return RecordingScheduler


def register_plugin() -> None:
    """The `sglang.srt.plugins` entry point, run by SGLang's `load_plugins()` in each of its
    processes: with STEPLEDGER_OUTBOX set, replace the scheduler class by the recording one
    (whose construction refuses an unsupported release, so the server fails to start rather
    than serve unrecorded)."""
    if not os.environ.get("STEPLEDGER_OUTBOX"):
        return
    import sglang
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    log.info(
        "stepledger records steps of SGLang %s (supported: sglang%s)",
        sglang.__version__,
        SUPPORTED_RANGE,
    )
    HookRegistry.register(SCHEDULER_TARGET, recording_scheduler_class(Scheduler), HookType.REPLACE)
