"""The allocator: vectorised step splitting against the reference per-step Python allocator.

Both split the same steps (mixed prefill chunks and decodes, 1-64 slots each) with the
reference work model in micro-dollars. The vectorised side is what the hourly attribution
runs for a batch of a fitted pool's steps: every slot's work from the coefficients
(`FittedWeights.compute_work`), then the blended largest-remainder split
(`blend_and_allocate`, weight parts included). Its shares must equal the reference ones
except where two slots' remainders tie within float rounding (either may take the unit; the
vectorised path follows the reference's arithmetic step by step, so none are expected).
Times are this process's CPU time (one core: numpy and the compiled kernels run
single-threaded), so other work on a shared machine does not distort the figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from benchmarks.figure import Figure
from pipeline.attribution import Coefficients, FittedWeights, SlotBatch, allocate_step, blend_and_allocate

COEFFICIENTS = Coefficients(12.0, 0.05, 0.00005)
ALPHA = 0.8
RATE_MICRO_PER_MS = 1.0  # $3.60 per GPU-hour


@dataclass
class _Slot:
    request_id: str
    new_tokens: int
    context: int
    kv_blocks: float


def _steps(n_slots: int, seed: int) -> tuple[SlotBatch, np.ndarray, np.ndarray]:
    """(batch, KV blocks, step ms) of about n_slots slots."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 65, n_slots // 32 + 1)
    sizes = sizes[: np.searchsorted(np.cumsum(sizes), n_slots) + 1]
    n = int(sizes.sum())
    step_index = np.repeat(np.arange(sizes.shape[0]), sizes)
    prefill = rng.random(n) < 0.1
    new_tokens = np.where(prefill, rng.integers(16, 2049, n), 1)
    context = rng.integers(0, 8000, n)
    kv_blocks = np.ceil((context + new_tokens) / 16) / rng.integers(1, 4, n)
    step_ms = np.round(rng.uniform(10, 120, sizes.shape[0]), 3)
    return SlotBatch(step_index, sizes.shape[0], new_tokens, context, np.zeros(n, dtype=np.int64)), kv_blocks, step_ms


def _vectorised(batch: SlotBatch, kv_blocks: np.ndarray, totals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    work = FittedWeights(COEFFICIENTS).compute_work(batch, "per_slot")
    split = blend_and_allocate(totals, batch.step_index, work, kv_blocks, ALPHA)
    return split.shares, split.exact


def _reference_inputs(batch: SlotBatch, kv_blocks: np.ndarray) -> list[list[_Slot]]:
    bounds = np.searchsorted(batch.step_index, np.arange(batch.n_steps + 1)).tolist()
    new_tokens, context, blocks = batch.new_tokens.tolist(), batch.context_tokens.tolist(), kv_blocks.tolist()
    return [
        [_Slot(str(i), new_tokens[i], context[i], blocks[i]) for i in range(bounds[step], bounds[step + 1])]
        for step in range(batch.n_steps)
    ]


def _reference(steps: list[list[_Slot]], step_ms: list[float]) -> list[dict[str, int]]:
    c0, a, b = COEFFICIENTS.c0_ms, COEFFICIENTS.a_ms, COEFFICIENTS.b_ms
    return [allocate_step(slots, ms, RATE_MICRO_PER_MS, c0, a, b, ALPHA) for slots, ms in zip(steps, step_ms)]


def _best_of(repeats: int, run) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        run()
        best = min(best, time.process_time() - started)
    return best


def figures(quick: bool) -> list[Figure]:
    batch, kv_blocks, step_ms = _steps(200_000 if quick else 1_200_000, seed=7)
    totals = np.array([round(ms * RATE_MICRO_PER_MS) for ms in step_ms], dtype=np.int64)
    _vectorised(batch, kv_blocks, totals)  # compile once outside the timing

    # The reference gets its slots ready-made: only the allocation itself is timed.
    reference_steps, reference_ms = _reference_inputs(batch, kv_blocks), step_ms.tolist()
    started = time.process_time()
    reference_splits = _reference(reference_steps, reference_ms)
    reference_s = time.process_time() - started
    reference = np.array([share for split in reference_splits for share in split.values()], dtype=np.int64)
    vectorised_s = _best_of(3, lambda: _vectorised(batch, kv_blocks, totals))
    shares, exact = _vectorised(batch, kv_blocks, totals)

    differ = np.flatnonzero(shares != reference)
    remainders = exact - np.floor(exact)
    for row in differ:
        step = batch.step_index == batch.step_index[row]
        if np.isclose(remainders[step], remainders[row], rtol=0, atol=1e-9).sum() < 2:
            raise AssertionError(f"slot {row}: vectorised {shares[row]} vs reference {reference[row]} is not a tie")

    big, big_kv, big_ms = _steps(2_000_000 if quick else 10_000_000, seed=11)
    big_totals = np.round(big_ms * 1000 * RATE_MICRO_PER_MS).astype(np.int64)  # nano-dollars
    rows_s = _best_of(3, lambda: _vectorised(big, big_kv, big_totals))
    return [
        Figure("allocator_speedup_vs_seed", reference_s / vectorised_s, "x", 50.0, "min"),
        Figure("allocator_slot_rows_per_s", big.step_index.shape[0] / rows_s, "rows/s", 2e7, "min"),
    ]


if __name__ == "__main__":
    for figure in figures(quick=False):
        print(figure.line())
