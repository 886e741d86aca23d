"""A continuous-batching engine scheduler with paged, prefix-cached KV blocks (vLLM v1 style).

The scheduler follows vLLM v1's `Scheduler.schedule()`:

- Running requests are served first, in admission order, each taking what it still needs
  (the rest of its prompt, or one token plus its speculative drafts) from the step's token
  budget (`max_num_batched_tokens`); a prompt larger than the remaining budget is chunked.
- When a running request needs a KV block and none is free, the most recently admitted
  running request is preempted. Preemption is vLLM v1's *recompute* mode: the victim frees
  every block it holds, forgets its computed tokens and goes back to the front of the waiting
  queue; when it is admitted again it recomputes its prompt and the output produced so far.
  A preempted request therefore holds no blocks and never appears as a holder; holders are
  the running requests the token budget left out of a step, which keep their blocks
  (recorded with state "waiting").
- Waiting requests are admitted in FCFS order while the budget, `max_num_seqs` and the free
  blocks allow, and only in steps without a preemption. A request that could not be admitted
  for lack of blocks sets the step's `admission_blocked` flag.
- Prefix caching is modelled per feature: every request of a feature starts with the same
  system prompt, whose full blocks are cached once written. The first request to find the
  prefix absent writes it (taking the prefix's blocks when admitted); they become shareable
  when its prefill passes the prefix, and requests admitted before that compute their own copy.
  Later requests reuse them (a prefix-cache hit, skipping that prefill) and the blocks are
  reference counted: a shared block counts 1/k to each of its k holders. Blocks of a
  finished prefix stay cached (and count as free, as vLLM's free-block count does) until
  an allocation needs them; the least recently released prefix is evicted first. Only
  system-prompt blocks are reusable: a preempted request's own blocks are not found again.
- Speculative decoding: a decoding request schedules one token plus up to `num_spec_tokens`
  drafts (never more than its remaining output needs); each draft is accepted with
  probability `spec_accept_prob` until the first rejection. Rejected drafts are rolled back
  from the computed tokens, as vLLM does.

Token bookkeeping follows vLLM: a request's KV cache ends holding prompt + output - 1 tokens,
because the last sampled token is never fed back. The recorded `prefix_hit_tokens` is
non-zero only on a request's first scheduled step (vLLM's `num_cached_tokens`); a resumed
request that finds its system prompt cached starts with that context without reporting a hit.

The step loop is compiled with numba: it is the one place a loop per slot and per step is
unavoidable, and one replica-hour is a few hundred thousand steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numba import njit

# Request lifecycle states.
NOT_ARRIVED = 0
WAITING = 1
RUNNING = 2
PREEMPTED = 3
FINISHED = 4

# Indices into the `scalars` state vector.
S_RUNNING = 0  # number of running requests
S_WAIT_HEAD = 1  # waiting ring buffer: index of the first element
S_WAIT_LEN = 2  # waiting ring buffer: length
S_NEXT_ARRIVAL = 3  # first request not yet moved into the waiting queue
S_USED = 4  # blocks referenced by a request
S_EVICTABLE = 5  # cached prefix blocks with no holder (free, but still cached)
S_STEP = 6  # steps run so far
S_PREEMPTIONS = 7  # preemptions so far
N_SCALARS = 8

# Per-step features of the duration model: 1, scheduled tokens, context tokens read,
# attention pairs (new tokens times the context they attend to).
N_STEP_FEATURES = 4


@njit(cache=True)
def _seed(seed: int) -> None:
    np.random.seed(seed)


# Indices into the `blocks` tuple: the per-request and per-feature KV block state that the
# helpers freeing and taking blocks read and update (one tuple, as `scalars` is one vector).
B_FEATURE = 0  # each request's feature
B_PREFIX = 1  # each feature's shared prefix, in blocks
B_PRIVATE = 2  # blocks each request holds on its own
B_SHARES = 3  # whether each request holds its feature's prefix
B_REF = 4  # requests holding each feature's prefix
B_RESIDENT = 5  # whether each feature's prefix is cached
B_WRITER = 6  # the request writing each feature's prefix, or -1
B_RELEASED = 7  # step at which each feature's prefix lost its last holder


@njit(cache=True)
def _free_request(r: int, blocks: tuple[np.ndarray, ...], scalars: np.ndarray, step: int) -> None:
    """Release every block request `r` holds; returns nothing, updates the block counters."""
    prefix_blocks = blocks[B_PREFIX]
    private_blocks = blocks[B_PRIVATE]
    shares_prefix = blocks[B_SHARES]
    feature_ref = blocks[B_REF]
    feature_writer = blocks[B_WRITER]
    scalars[S_USED] -= private_blocks[r]
    private_blocks[r] = 0
    if shares_prefix[r]:
        f = blocks[B_FEATURE][r]
        shares_prefix[r] = False
        feature_ref[f] -= 1
        if feature_writer[f] == r:
            feature_writer[f] = -1
        if feature_ref[f] == 0:
            scalars[S_USED] -= prefix_blocks[f]
            if blocks[B_RESIDENT][f]:
                scalars[S_EVICTABLE] += prefix_blocks[f]
                blocks[B_RELEASED][f] = step


# Called for every slot and holder, so it takes its arrays: reading them out of the `blocks`
# tuple made the whole step loop 1.7 times slower.
@njit(cache=True)
def _held_blocks(
    r: int,
    feature: np.ndarray,
    prefix_blocks: np.ndarray,
    private_blocks: np.ndarray,
    shares_prefix: np.ndarray,
    feature_ref: np.ndarray,
) -> float:
    held = float(private_blocks[r])
    if shares_prefix[r]:
        f = feature[r]
        held += prefix_blocks[f] / feature_ref[f]
    return held


@njit(cache=True)
def _take_blocks(
    r: int,
    needed: int,
    needed_private: int,
    blocks: tuple[np.ndarray, ...],
    scalars: np.ndarray,
    total_blocks: int,
) -> None:
    """Give request `r` `needed` more blocks (`needed_private` of its own in all), first evicting
    unreferenced cached prefixes (least recently released first) until they are truly free."""
    prefix_blocks = blocks[B_PREFIX]
    feature_ref = blocks[B_REF]
    feature_resident = blocks[B_RESIDENT]
    feature_released_step = blocks[B_RELEASED]
    while total_blocks - scalars[S_USED] - scalars[S_EVICTABLE] < needed:
        victim = -1
        for f in range(prefix_blocks.shape[0]):
            if (
                feature_resident[f]
                and feature_ref[f] == 0
                and (victim < 0 or feature_released_step[f] < feature_released_step[victim])
            ):
                victim = f
        feature_resident[victim] = False
        scalars[S_EVICTABLE] -= prefix_blocks[victim]
    scalars[S_USED] += needed
    blocks[B_PRIVATE][r] = needed_private


@njit(cache=True)
def _run_steps(  # noqa: C901 (a numba kernel: one compiled loop over the steps)
    arrival_ns: np.ndarray,
    prompt_tokens: np.ndarray,
    output_tokens: np.ndarray,
    feature: np.ndarray,
    prefix_blocks: np.ndarray,
    computed: np.ndarray,
    generated: np.ndarray,
    status: np.ndarray,
    private_blocks: np.ndarray,
    shares_prefix: np.ndarray,
    scheduled_once: np.ndarray,
    preemptions: np.ndarray,
    feature_ref: np.ndarray,
    feature_resident: np.ndarray,
    feature_writer: np.ndarray,
    feature_released_step: np.ndarray,
    running: np.ndarray,
    waiting: np.ndarray,
    scalars: np.ndarray,
    block_size: int,
    total_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_spec_tokens: int,
    spec_accept_prob: float,
    visible_until_ns: int,
    max_steps: int,
    time_budget_ns: float,
    step_model: np.ndarray,
    step_features: np.ndarray,
    step_num_slots: np.ndarray,
    step_num_holders: np.ndarray,
    step_admission_blocked: np.ndarray,
    step_free_blocks: np.ndarray,
    step_preempted: np.ndarray,
    slot_request: np.ndarray,
    slot_new: np.ndarray,
    slot_context: np.ndarray,
    slot_kv: np.ndarray,
    slot_prompt: np.ndarray,
    slot_hit: np.ndarray,
    slot_drafted: np.ndarray,
    slot_accepted: np.ndarray,
    holder_request: np.ndarray,
    holder_kv: np.ndarray,
) -> tuple[int, int, int]:
    n_requests = arrival_ns.shape[0]
    capacity = waiting.shape[0]
    while (
        scalars[S_NEXT_ARRIVAL] < n_requests
        and arrival_ns[scalars[S_NEXT_ARRIVAL]] <= visible_until_ns
    ):
        r = scalars[S_NEXT_ARRIVAL]
        waiting[(scalars[S_WAIT_HEAD] + scalars[S_WAIT_LEN]) % capacity] = r
        scalars[S_WAIT_LEN] += 1
        status[r] = WAITING
        scalars[S_NEXT_ARRIVAL] += 1

    blocks = (
        feature,
        prefix_blocks,
        private_blocks,
        shares_prefix,
        feature_ref,
        feature_resident,
        feature_writer,
        feature_released_step,
    )
    n_slots_total = 0
    n_holders_total = 0
    steps_done = 0
    predicted_ns = 0.0
    while steps_done < max_steps:
        step = scalars[S_STEP]
        budget = max_num_batched_tokens
        first_slot = n_slots_total
        preempted_now = 0
        blocked = False

        # Running requests, in admission order.
        i = 0
        while i < scalars[S_RUNNING] and budget > 0:
            r = running[i]
            known = prompt_tokens[r] + generated[r]
            drafted = 0
            if computed[r] == known - 1 and generated[r] > 0:
                drafted = min(num_spec_tokens, output_tokens[r] - generated[r] - 1)
                new = min(1 + drafted, budget)
                drafted = new - 1
            else:
                new = min(known - computed[r], budget)
            f = feature[r]
            shared = prefix_blocks[f] if shares_prefix[r] else 0
            needed_private = max(0, (computed[r] + new + block_size - 1) // block_size - shared)
            extra = needed_private - private_blocks[r]
            scheduled = True
            while extra > total_blocks - scalars[S_USED]:
                victim = running[scalars[S_RUNNING] - 1]
                scalars[S_RUNNING] -= 1
                _free_request(victim, blocks, scalars, step)
                computed[victim] = 0
                status[victim] = PREEMPTED
                preemptions[victim] += 1
                scalars[S_WAIT_HEAD] = (scalars[S_WAIT_HEAD] - 1) % capacity
                waiting[scalars[S_WAIT_HEAD]] = victim
                scalars[S_WAIT_LEN] += 1
                preempted_now += 1
                if victim == r:
                    scheduled = False
                    break
            if not scheduled:
                break
            if extra > 0:
                _take_blocks(r, extra, needed_private, blocks, scalars, total_blocks)
            slot_request[n_slots_total] = r
            slot_new[n_slots_total] = new
            slot_context[n_slots_total] = computed[r]
            slot_prompt[n_slots_total] = prompt_tokens[r]
            slot_hit[n_slots_total] = 0
            slot_drafted[n_slots_total] = drafted
            n_slots_total += 1
            budget -= new
            i += 1
        # Running requests the budget left out hold their blocks through the step.
        first_unscheduled_running = i
        last_unscheduled_running = scalars[S_RUNNING]

        # Waiting requests, FCFS, only when nothing was preempted this step.
        if preempted_now == 0:
            while scalars[S_WAIT_LEN] > 0 and budget > 0 and scalars[S_RUNNING] < max_num_seqs:
                r = waiting[scalars[S_WAIT_HEAD]]
                f = feature[r]
                prefix = prefix_blocks[f]
                share = False
                hit = 0
                if prefix > 0 and feature_resident[f]:
                    share = True
                    hit = prefix * block_size
                elif prefix > 0 and feature_ref[f] == 0:
                    share = True  # this request writes the prefix
                known = prompt_tokens[r] + generated[r]
                new = min(known - hit, budget)
                needed_private = (hit + new + block_size - 1) // block_size
                if share:
                    needed_private = max(0, needed_private - prefix)
                shared_taken = prefix if share and feature_ref[f] == 0 else 0
                extra = needed_private + shared_taken
                if extra > total_blocks - scalars[S_USED]:
                    blocked = True
                    break
                if share:
                    if feature_ref[f] == 0 and feature_resident[f]:
                        scalars[S_EVICTABLE] -= prefix
                    if feature_ref[f] == 0 and not feature_resident[f]:
                        feature_writer[f] = r
                    feature_ref[f] += 1
                    shares_prefix[r] = True
                _take_blocks(r, extra, needed_private, blocks, scalars, total_blocks)
                scalars[S_WAIT_HEAD] = (scalars[S_WAIT_HEAD] + 1) % capacity
                scalars[S_WAIT_LEN] -= 1
                running[scalars[S_RUNNING]] = r
                scalars[S_RUNNING] += 1
                status[r] = RUNNING
                computed[r] = hit
                slot_request[n_slots_total] = r
                slot_new[n_slots_total] = new
                slot_context[n_slots_total] = hit
                slot_prompt[n_slots_total] = prompt_tokens[r]
                slot_hit[n_slots_total] = 0 if scheduled_once[r] else hit
                slot_drafted[n_slots_total] = 0
                scheduled_once[r] = True
                n_slots_total += 1
                budget -= new

        n_slots = n_slots_total - first_slot
        if n_slots == 0:
            n_slots_total = first_slot
            break

        # Blocks held while the step runs: a shared prefix counts 1/k to each of its k holders.
        for s in range(first_slot, n_slots_total):
            slot_kv[s] = _held_blocks(
                slot_request[s], feature, prefix_blocks, private_blocks, shares_prefix, feature_ref
            )
        first_holder = n_holders_total
        for j in range(first_unscheduled_running, last_unscheduled_running):
            r = running[j]
            holder_request[n_holders_total] = r
            holder_kv[n_holders_total] = _held_blocks(
                r, feature, prefix_blocks, private_blocks, shares_prefix, feature_ref
            )
            n_holders_total += 1

        # Predicted duration, so the caller can end the chunk when the next request arrives.
        tokens = 0.0
        context = 0.0
        pairs = 0.0
        for s in range(first_slot, n_slots_total):
            tokens += slot_new[s]
            context += slot_context[s]
            pairs += slot_new[s] * (slot_context[s] + 0.5 * slot_new[s])
        step_features[steps_done, 0] = 1.0
        step_features[steps_done, 1] = tokens
        step_features[steps_done, 2] = context
        step_features[steps_done, 3] = pairs
        for k in range(N_STEP_FEATURES):
            predicted_ns += step_model[k] * step_features[steps_done, k]

        step_num_slots[steps_done] = n_slots
        step_num_holders[steps_done] = n_holders_total - first_holder
        step_admission_blocked[steps_done] = blocked
        step_free_blocks[steps_done] = total_blocks - scalars[S_USED]
        step_preempted[steps_done] = preempted_now
        scalars[S_PREEMPTIONS] += preempted_now

        # The model ran: advance every scheduled request, sample, finish.
        any_finished = False
        for s in range(first_slot, n_slots_total):
            r = slot_request[s]
            computed[r] += slot_new[s]
            accepted = 0
            known = prompt_tokens[r] + generated[r]
            if computed[r] >= known:
                for _ in range(slot_drafted[s]):
                    if np.random.random() < spec_accept_prob:
                        accepted += 1
                    else:
                        break
                computed[r] -= slot_drafted[s] - accepted
                generated[r] += 1 + accepted
            slot_accepted[s] = accepted
            f = feature[r]
            if feature_writer[f] == r and computed[r] >= prefix_blocks[f] * block_size:
                feature_resident[f] = True
                feature_writer[f] = -1
            if generated[r] >= output_tokens[r]:
                _free_request(r, blocks, scalars, step)
                status[r] = FINISHED
                any_finished = True
        if any_finished:
            kept = 0
            for j in range(scalars[S_RUNNING]):
                r = running[j]
                if status[r] == RUNNING:
                    running[kept] = r
                    kept += 1
            scalars[S_RUNNING] = kept

        scalars[S_STEP] += 1
        steps_done += 1
        if predicted_ns >= time_budget_ns:
            break
    return steps_done, n_slots_total, n_holders_total


@dataclass
class StepBatch:
    """Steps run by one `Engine.run` call. Slot and holder rows are flat, in step order;
    `step_num_slots` / `step_num_holders` say how many belong to each step."""

    step_features: np.ndarray  # float64 (steps, N_STEP_FEATURES): the duration model's inputs
    step_num_slots: np.ndarray  # int64 per step
    step_num_holders: np.ndarray  # int64 per step
    admission_blocked: np.ndarray  # bool per step
    free_blocks: np.ndarray  # int64 per step
    preempted: np.ndarray  # int64 per step: requests preempted while scheduling it
    slot_request: np.ndarray  # int64 request index per slot
    new_tokens: np.ndarray  # int64
    context_tokens: np.ndarray  # int64
    kv_blocks: np.ndarray  # float64
    prompt_tokens: np.ndarray  # int64
    prefix_hit_tokens: np.ndarray  # int64
    spec_drafted: np.ndarray  # int64
    spec_accepted: np.ndarray  # int64
    holder_request: np.ndarray  # int64 request index per holder
    holder_kv_blocks: np.ndarray  # float64

    @property
    def steps(self) -> int:
        return int(self.step_num_slots.shape[0])


@dataclass
class EngineConfig:
    block_size: int
    total_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_spec_tokens: int = 0
    spec_accept_prob: float = 0.7


@dataclass
class Engine:
    """The scheduler state of one replica over a fixed, time-ordered list of requests.

    `prefix_blocks[f]` is the number of full system-prompt blocks of feature f;
    `feature[r]` the feature of request r. Requests must be sorted by arrival time.
    """

    config: EngineConfig
    arrival_ns: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    feature: np.ndarray
    prefix_blocks: np.ndarray
    seed: int = 0
    computed: np.ndarray = field(init=False)
    generated: np.ndarray = field(init=False)
    status: np.ndarray = field(init=False)
    private_blocks: np.ndarray = field(init=False)
    shares_prefix: np.ndarray = field(init=False)
    scheduled_once: np.ndarray = field(init=False)
    preemptions: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        n = self.arrival_ns.shape[0]
        if n and np.any(np.diff(self.arrival_ns) < 0):
            raise ValueError("requests must be sorted by arrival time")
        self.arrival_ns = np.ascontiguousarray(self.arrival_ns, dtype=np.int64)
        self.prompt_tokens = np.ascontiguousarray(self.prompt_tokens, dtype=np.int64)
        self.output_tokens = np.ascontiguousarray(self.output_tokens, dtype=np.int64)
        self.feature = np.ascontiguousarray(self.feature, dtype=np.int64)
        self.prefix_blocks = np.ascontiguousarray(self.prefix_blocks, dtype=np.int64)
        if n and (self.prompt_tokens.min() < 1 or self.output_tokens.min() < 1):
            raise ValueError("every request needs at least one prompt and one output token")
        largest = (
            self.prompt_tokens + self.output_tokens + self.config.block_size - 1
        ) // self.config.block_size
        if n and largest.max() > self.config.total_blocks:
            raise ValueError(
                f"a request needs {int(largest.max())} KV blocks but the replica has {self.config.total_blocks}"
            )
        if n and np.any(
            self.prefix_blocks[self.feature] * self.config.block_size >= self.prompt_tokens
        ):
            raise ValueError("a system prompt must be shorter than every prompt of its feature")
        self.computed = np.zeros(n, np.int64)
        self.generated = np.zeros(n, np.int64)
        self.status = np.zeros(n, np.int8)
        self.private_blocks = np.zeros(n, np.int64)
        self.shares_prefix = np.zeros(n, np.bool_)
        self.scheduled_once = np.zeros(n, np.bool_)
        self.preemptions = np.zeros(n, np.int64)
        n_features = self.prefix_blocks.shape[0]
        self.feature_ref = np.zeros(n_features, np.int64)
        self.feature_resident = np.zeros(n_features, np.bool_)
        self.feature_writer = np.full(n_features, -1, np.int64)
        self.feature_released_step = np.zeros(n_features, np.int64)
        self.running = np.zeros(max(n, 1), np.int64)
        self.waiting = np.zeros(max(n, 1), np.int64)
        self.scalars = np.zeros(N_SCALARS, np.int64)
        _seed(self.seed)

    @property
    def used_blocks(self) -> int:
        return int(self.scalars[S_USED])

    @property
    def total_preemptions(self) -> int:
        return int(self.scalars[S_PREEMPTIONS])

    @property
    def has_work(self) -> bool:
        """True while a request is running or waiting (ignores requests not yet arrived)."""
        return bool(self.scalars[S_RUNNING] > 0 or self.scalars[S_WAIT_LEN] > 0)

    @property
    def next_arrival_ns(self) -> int | None:
        """Arrival time of the first request not yet visible to the scheduler."""
        index = int(self.scalars[S_NEXT_ARRIVAL])
        return int(self.arrival_ns[index]) if index < self.arrival_ns.shape[0] else None

    def run(
        self,
        max_steps: int,
        visible_until_ns: int,
        time_budget_ns: float = np.inf,
        step_model: np.ndarray | None = None,
    ) -> StepBatch:
        """Make requests arrived by `visible_until_ns` visible, then run up to `max_steps` steps.

        Stops early when nothing is left to schedule (the engine would idle until the next
        arrival), or after the step in which the predicted time, `step_model` (ns per step
        feature, see N_STEP_FEATURES) summed over the steps run, reaches `time_budget_ns`. The seeded random stream (speculative acceptance) is numba's global one, so
        engines must run one after another, not interleaved, for results to be reproducible.
        """
        cfg = self.config
        model = (
            np.zeros(N_STEP_FEATURES)
            if step_model is None
            else np.ascontiguousarray(step_model, np.float64)
        )
        buffers = _StepBuffers.allocate(max_steps, max_steps * cfg.max_num_seqs)
        kernel_arguments = (
            *self._state(),
            cfg.block_size,
            cfg.total_blocks,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            cfg.num_spec_tokens,
            cfg.spec_accept_prob,
            visible_until_ns,
            max_steps,
            float(time_budget_ns),
            model,
            *buffers.kernel_outputs(),
        )
        steps, n_slots, n_holders = _run_steps(*kernel_arguments)
        return buffers.batch(steps, n_slots, n_holders)

    def _state(self) -> tuple[Any, ...]:
        """The scheduler's arrays, in `_run_steps`'s order; the kernel updates them in place."""
        return (
            self.arrival_ns,
            self.prompt_tokens,
            self.output_tokens,
            self.feature,
            self.prefix_blocks,
            self.computed,
            self.generated,
            self.status,
            self.private_blocks,
            self.shares_prefix,
            self.scheduled_once,
            self.preemptions,
            self.feature_ref,
            self.feature_resident,
            self.feature_writer,
            self.feature_released_step,
            self.running,
            self.waiting,
            self.scalars,
        )


@dataclass(frozen=True)
class _StepBuffers:
    """Fresh output buffers for one `Engine.run` call: the recorder keeps views of them."""

    features: np.ndarray
    per_step: np.ndarray
    per_slot: np.ndarray
    per_slot_float: np.ndarray

    @classmethod
    def allocate(cls, max_steps: int, slots_cap: int) -> _StepBuffers:
        return cls(
            features=np.empty((max_steps, N_STEP_FEATURES), np.float64),
            per_step=np.empty((5, max_steps), np.int64),
            per_slot=np.empty((8, slots_cap), np.int64),
            per_slot_float=np.empty((2, slots_cap), np.float64),
        )

    def kernel_outputs(self) -> tuple[Any, ...]:
        """The buffers in `_run_steps`'s order, from `step_features` to `holder_kv`."""
        num_slots, num_holders, blocked, free_blocks, preempted = self.per_step
        request, new, context, prompt, hit, drafted, accepted, holder_request = self.per_slot
        slot_kv, holder_kv = self.per_slot_float
        return (
            self.features,
            num_slots,
            num_holders,
            blocked,
            free_blocks,
            preempted,
            request,
            new,
            context,
            slot_kv,
            prompt,
            hit,
            drafted,
            accepted,
            holder_request,
            holder_kv,
        )

    def batch(self, steps: int, n_slots: int, n_holders: int) -> StepBatch:
        num_slots, num_holders, blocked, free_blocks, preempted = self.per_step
        request, new, context, prompt, hit, drafted, accepted, holder_request = self.per_slot
        slot_kv, holder_kv = self.per_slot_float
        return StepBatch(
            step_features=self.features[:steps],
            step_num_slots=num_slots[:steps],
            step_num_holders=num_holders[:steps],
            admission_blocked=blocked[:steps].astype(np.bool_),
            free_blocks=free_blocks[:steps],
            preempted=preempted[:steps],
            slot_request=request[:n_slots],
            new_tokens=new[:n_slots],
            context_tokens=context[:n_slots],
            kv_blocks=slot_kv[:n_slots],
            prompt_tokens=prompt[:n_slots],
            prefix_hit_tokens=hit[:n_slots],
            spec_drafted=drafted[:n_slots],
            spec_accepted=accepted[:n_slots],
            holder_request=holder_request[:n_holders],
            holder_kv_blocks=holder_kv[:n_holders],
        )
