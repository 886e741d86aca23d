"""One replica's timeline: the scheduler's batches, priced by the kernel, logged by the StepRecorder.

Simulated time advances in chunks. At the start of a chunk the scheduler sees every request
that has arrived by then and runs a few steps; the kernel prices the chunk in one
`price_many` call (one call per step would cost more than the rest of the simulation), and
each step's duration becomes its NoOverlap estimate times (1 + noise), plus any host stall.
The scheduler ends a chunk after the step in which the next request is predicted to arrive
(a least-squares model of step time on tokens, context and attention pairs, refitted on every
priced chunk), so a request usually waits for the step in progress, as it would in vLLM;
when the prediction runs short it waits a step or two more. `ReplicaRun` reports that wait
(`mean_admission_lag_steps`).

Logging goes through the real StepRecorder with simulated clocks. One recorder is opened per
5-minute rotation window (continuing the sequence numbers), with both clocks frozen at the
window's start: the recorder's writer thread reads its clocks asynchronously, and freezing
them makes segment boundaries and (mono, wall) anchors independent of thread timing, so a
seed gives the same log every time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.hook.recorder import StepRecorder
from pipeline.simulator.engine import FINISHED, N_STEP_FEATURES, Engine, EngineConfig, StepBatch
from pipeline.simulator.faults import DRIVER_VERSION, ReplicaFaults
from pricing import Kernel, Slots
from schemas.config import Pool, Replica
from schemas.records import SegmentHeader

ROTATE_NS = 300_000_000_000
MAX_CHUNK_STEPS = 128
# Host-side scheduling time between two steps: a floor plus an exponential tail.
GAP_FLOOR_NS = 40_000
GAP_MEAN_EXTRA_NS = 40_000
# From an idle engine's first sight of a request to its first step.
WAKE_NS = 200_000
# Monotonic clocks start at boot; replicas booted days before the span.
BOOT_AGE_NS = 3 * 86_400_000_000_000


@dataclass
class ReplicaRun:
    """What happened on one replica; times are ns since the span start."""

    replica: str
    requests: int  # routed to the replica
    finished: int  # whose last token was produced before the simulation stopped
    steps: int  # steps started in the span (recorded or dropped)
    recorded_steps: int
    dropped_steps: int
    busy_ns: int  # sum of step durations, host stalls included
    preemptions: int
    admission_blocked_steps: int
    prefix_hit_tokens: int
    mean_admission_lag_steps: float
    gpu_busy_start_ns: np.ndarray  # when the GPU ran kernels (DCGM's view)
    gpu_busy_end_ns: np.ndarray
    segments: list[Path]


class _StepTimeModel:
    """Least squares of step time (gap included) on the engine's step features, weighted
    towards recent chunks so it follows the load; only used to decide where chunks end."""

    FORGET = 0.9
    RIDGE = 1e-6

    def __init__(self) -> None:
        self.gram = np.zeros((N_STEP_FEATURES, N_STEP_FEATURES))
        self.moment = np.zeros(N_STEP_FEATURES)
        self.coefficients: np.ndarray = np.zeros(N_STEP_FEATURES)
        self.coefficients[0] = 20_000_000.0

    def update(self, features: np.ndarray, elapsed_ns: np.ndarray) -> None:
        self.gram = self.FORGET * self.gram + features.T @ features
        self.moment = self.FORGET * self.moment + features.T @ elapsed_ns
        scale = np.maximum(np.diag(self.gram), 1.0)
        solved = np.linalg.solve(self.gram + self.RIDGE * np.diag(scale), self.moment)
        if np.all(np.isfinite(solved)):
            self.coefficients = solved


class _FrozenClock:
    """The (mono, wall) pair a recorder reads when it opens a segment."""

    def __init__(self, mono_ns: int, wall_ns: int) -> None:
        self.mono_ns = mono_ns
        self.wall_ns = wall_ns

    def mono(self) -> int:
        return self.mono_ns

    def wall(self) -> int:
        return self.wall_ns


def simulate_replica(
    pool: Pool,
    replica: Replica,
    kernel: Kernel,
    *,
    request_ids: np.ndarray,
    arrival_ns: np.ndarray,
    prompt_tokens: np.ndarray,
    output_tokens: np.ndarray,
    feature: np.ndarray,
    prefix_tokens: np.ndarray,
    span_ns: int,
    start_wall_ns: int,
    outbox: Path,
    faults: ReplicaFaults,
    rng: np.random.Generator,
    step_noise: float,
    progress: Callable[[int], None] | None = None,
    rotate_ns: int = ROTATE_NS,
) -> ReplicaRun:
    """Run one replica over [0, span_ns) and log its steps into `outbox`, a segment per
    `rotate_ns` of simulated time.

    Steps that start before the span ends are logged, even when they end after it.
    `progress` is called with the simulated ns advanced since its previous call.
    """
    engine = _engine(pool, arrival_ns, prompt_tokens, output_tokens, feature, prefix_tokens, rng)
    log = _Log(outbox, _header(pool, replica, faults), start_wall_ns, faults, rotate_ns)
    arrivals = engine.arrival_ns
    total_blocks = pool.engine.total_kv_blocks
    tally = _Tally()
    step_model = _StepTimeModel()
    now = 0
    reported = 0
    while now < span_ns:
        if not engine.has_work:
            upcoming = engine.next_arrival_ns
            if upcoming is None or upcoming >= span_ns:
                break
            now = max(now, upcoming + WAKE_NS)
        # End the chunk in the step the next request is predicted to arrive in (or the span to end).
        following = int(np.searchsorted(arrivals, now, side="right"))
        budget_ns = float(span_ns - now)
        if following < arrivals.shape[0]:
            budget_ns = min(budget_ns, float(arrivals[following] - now))
        batch = engine.run(
            MAX_CHUNK_STEPS,
            visible_until_ns=now,
            time_budget_ns=budget_ns,
            step_model=step_model.coefficients,
        )
        if batch.steps == 0:
            if engine.has_work:
                raise RuntimeError(
                    f"replica {replica.id}: requests are waiting but none can be scheduled"
                )
            continue
        stall_ns, step_ns, gap_ns = _durations(
            kernel, batch, rng, step_noise, faults.host_stall_fraction
        )
        starts = now + np.concatenate([[0], np.cumsum(step_ns + gap_ns)[:-1]])
        ends = starts + step_ns
        keep = int(np.searchsorted(starts, span_ns, side="left"))
        log.record(batch, keep, starts, ends, request_ids, total_blocks, faults.drop_window_ns)
        # Requests arriving during the chunk become visible at its end.
        arrived = arrivals[following : np.searchsorted(arrivals, ends[-1], side="right")]
        tally.add(batch, keep, starts, stall_ns, step_ns, ends, arrived)
        step_model.update(batch.step_features, step_ns + gap_ns)
        now = int(ends[-1] + gap_ns[-1])
        if progress is not None and now - reported >= 10_000_000_000:
            progress(min(now, span_ns) - reported)
            reported = min(now, span_ns)
    log.close()
    if progress is not None:
        progress(span_ns - reported)
    finished = int((engine.status == FINISHED).sum())
    return tally.replica_run(replica.id, int(arrival_ns.shape[0]), finished, log)


def _engine(
    pool: Pool,
    arrival_ns: np.ndarray,
    prompt_tokens: np.ndarray,
    output_tokens: np.ndarray,
    feature: np.ndarray,
    prefix_tokens: np.ndarray,
    rng: np.random.Generator,
) -> Engine:
    settings = pool.engine
    return Engine(
        EngineConfig(
            block_size=pool.kv_block_size,
            total_blocks=settings.total_kv_blocks,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            num_spec_tokens=settings.num_spec_tokens,
        ),
        arrival_ns=arrival_ns,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        feature=feature,
        prefix_blocks=prefix_tokens // pool.kv_block_size,
        seed=int(rng.integers(0, 2**31)),
    )


def _header(pool: Pool, replica: Replica, faults: ReplicaFaults) -> SegmentHeader:
    """`replica` is one of the pool's streams: with attention data parallelism, one rank's."""
    ranks = pool.data_parallel
    rank = [s.id for s in pool.streams].index(replica.id) % ranks if ranks > 1 else None
    return SegmentHeader(
        pool=pool.name,
        replica=replica.id,
        engine_name=pool.engine.name,
        engine_version=faults.engine_version,
        driver_version=DRIVER_VERSION,
        model=pool.model,
        gpu_type=pool.gpu_type,
        gpus_per_replica=pool.gpus_per_stream,
        kv_block_size=pool.kv_block_size,
        attn_dp_rank=rank,
        attn_dp_size=ranks if ranks > 1 else None,
    )


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


@dataclass
class _Tally:
    """What a replica's run adds up to, chunk by chunk (steps kept inside the span only)."""

    busy_start: list[np.ndarray] = field(default_factory=list)
    busy_end: list[np.ndarray] = field(default_factory=list)
    busy_ns: int = 0
    preemptions: int = 0
    blocked_steps: int = 0
    prefix_hit_tokens: int = 0
    steps: int = 0
    lag_steps: int = 0
    lag_requests: int = 0

    def add(
        self,
        batch: StepBatch,
        keep: int,
        starts: np.ndarray,
        stall_ns: np.ndarray,
        step_ns: np.ndarray,
        ends: np.ndarray,
        arrived: np.ndarray,
    ) -> None:
        # `arrived`: requests that arrived during the chunk; count the steps that started after
        # they arrived (in vLLM they would have joined the first of those).
        self.lag_steps += int((keep - np.searchsorted(starts[:keep], arrived, side="left")).sum())
        self.lag_requests += arrived.shape[0]
        self.busy_start.append(starts[:keep] + stall_ns[:keep])
        self.busy_end.append(ends[:keep])
        self.busy_ns += int(step_ns[:keep].sum())
        self.preemptions += int(batch.preempted[:keep].sum())
        self.blocked_steps += int(batch.admission_blocked[:keep].sum())
        kept_slots = int(batch.step_num_slots[:keep].sum())
        self.prefix_hit_tokens += int(batch.prefix_hit_tokens[:kept_slots].sum())
        self.steps += keep

    def replica_run(self, replica: str, requests: int, finished: int, log: _Log) -> ReplicaRun:
        return ReplicaRun(
            replica=replica,
            requests=requests,
            finished=finished,
            steps=self.steps,
            recorded_steps=self.steps - log.dropped,
            dropped_steps=log.dropped,
            busy_ns=self.busy_ns,
            preemptions=self.preemptions,
            admission_blocked_steps=self.blocked_steps,
            prefix_hit_tokens=self.prefix_hit_tokens,
            mean_admission_lag_steps=self.lag_steps / self.lag_requests
            if self.lag_requests
            else 0.0,
            gpu_busy_start_ns=_joined(self.busy_start),
            gpu_busy_end_ns=_joined(self.busy_end),
            segments=log.segments,
        )


def _durations(
    kernel: Kernel,
    batch: StepBatch,
    rng: np.random.Generator,
    step_noise: float,
    host_stall_fraction: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host stall, duration (GPU time plus stall) and the following gap of every step in the
    batch, in ns."""
    step_index = np.repeat(np.arange(batch.steps), batch.step_num_slots)
    prices = kernel.price_many(
        Slots(step_index, batch.new_tokens, batch.context_tokens, batch.prompt_tokens), batch.steps
    )
    noise = np.clip(1.0 + step_noise * rng.standard_normal(batch.steps), 0.5, None)
    gpu_ns = np.rint(prices.nooverlap_us * 1000.0 * noise).astype(np.int64)
    stall_ns = np.rint(gpu_ns * host_stall_fraction).astype(np.int64)
    gap_ns = GAP_FLOOR_NS + np.rint(rng.exponential(GAP_MEAN_EXTRA_NS, batch.steps)).astype(
        np.int64
    )
    return stall_ns, gpu_ns + stall_ns, gap_ns


class _Log:
    """Feeds steps to one StepRecorder per rotation window, continuing sequence numbers. Steps
    starting in the faults' lost window get recorders of their own whose segments are never
    delivered."""

    def __init__(
        self,
        outbox: Path,
        header: SegmentHeader,
        start_wall_ns: int,
        faults: ReplicaFaults,
        rotate_ns: int,
    ) -> None:
        self.outbox = outbox
        self.rotate_ns = rotate_ns
        self.header = header
        self.start_wall_ns = start_wall_ns
        self.wall_rate = faults.wall_rate
        self.wall_jump = faults.wall_jump
        self.lost_window = faults.lost_window_ns
        self.kv_factor = faults.kv_factor
        self.recorder: StepRecorder | None = None
        self.window: tuple[int, bool, bool] = (-1, False, False)
        self.next_seq = 0
        self.dropped = 0
        self.segments: list[Path] = []

    def _recorder_for(self, start_ns: int) -> StepRecorder:
        jumped = self.wall_jump is not None and start_ns >= self.wall_jump[0]
        lost = (
            self.lost_window is not None and self.lost_window[0] <= start_ns < self.lost_window[1]
        )
        window = (start_ns // self.rotate_ns, jumped, lost)
        if window != self.window:
            self.close()
            opened = window[0] * self.rotate_ns
            wall_ns = self.start_wall_ns + round(opened * self.wall_rate)
            if jumped and self.wall_jump is not None:
                # The recorder rotates where the clock stepped, so the new segment is anchored on it.
                opened = max(opened, self.wall_jump[0])
                wall_ns = self.start_wall_ns + round(opened * self.wall_rate) + self.wall_jump[1]
            # A skewed wall clock is read, like the real one, when the segment opens.
            clock = _FrozenClock(BOOT_AGE_NS + opened, wall_ns)
            self.recorder = StepRecorder(
                self.outbox,
                self.header,
                overflow="block",
                rotate_seconds=1e9,
                mono_clock=clock.mono,
                wall_clock=clock.wall,
                first_seq=self.next_seq,
            )
            self.window = window
        assert self.recorder is not None  # opened for this window above, or for it earlier
        return self.recorder

    def record(
        self,
        batch: StepBatch,
        keep: int,
        starts: np.ndarray,
        ends: np.ndarray,
        request_ids: np.ndarray,
        total_blocks: int,
        drop_window_ns: tuple[int, int] | None,
    ) -> None:
        slot_end = np.cumsum(batch.step_num_slots)
        holder_end = np.cumsum(batch.step_num_holders)
        slot_ids = request_ids[batch.slot_request]
        holder_ids = request_ids[batch.holder_request]
        for j in range(keep):
            start = int(starts[j])
            recorder = self._recorder_for(start)
            self.next_seq += 1
            if drop_window_ns is not None and drop_window_ns[0] <= start < drop_window_ns[1]:
                recorder.drop_step()
                self.dropped += 1
                continue
            a, b = slot_end[j] - batch.step_num_slots[j], slot_end[j]
            h0, h1 = holder_end[j] - batch.step_num_holders[j], holder_end[j]
            recorder.record_step(
                BOOT_AGE_NS + start,
                BOOT_AGE_NS + int(ends[j]),
                slot_ids[a:b].tolist(),
                batch.new_tokens[a:b],
                batch.context_tokens[a:b],
                batch.kv_blocks[a:b] * self.kv_factor,
                batch.prompt_tokens[a:b],
                batch.prefix_hit_tokens[a:b],
                batch.spec_drafted[a:b],
                batch.spec_accepted[a:b],
                holder_ids=holder_ids[h0:h1].tolist(),
                holder_blocks=batch.holder_kv_blocks[h0:h1],
                holder_states=["waiting"] * int(h1 - h0),
                admission_blocked=bool(batch.admission_blocked[j]),
                free_blocks=int(batch.free_blocks[j]),
                total_blocks=total_blocks,
            )

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
            if self.window[2]:
                for segment in self.recorder.shipped_segments:
                    segment.unlink()
            else:
                self.segments.extend(self.recorder.shipped_segments)
            self.recorder = None
