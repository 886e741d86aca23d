"""The allocator: vectorised step splitting against the reference per-step Python allocator.

Both split the same steps (mixed prefill chunks and decodes, 1-64 slots each) with the
reference work model in micro-dollars. The vectorised side is what the hourly attribution
runs to split a batch of a fitted pool's steps: every slot's work from the coefficients
(`FittedWeights.compute_work`), then the blended largest-remainder split with each slot's
exact real share (`blend_and_allocate`). The compute/KV breakdown of each share, which the
reference does not make, is a second pass (`BlendedSplit.parts`) and is not timed. Shares
must equal the reference ones except where two slots' remainders tie within float rounding
(either may take the unit; the vectorised path follows the reference's arithmetic step by
step, so none are expected).
Times are this process's CPU time (one core: numpy and the compiled kernels run
single-threaded), so other work on a shared machine does not distort the figures.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np

from benchmarks.figure import Figure
from pipeline.attribution.allocator import allocate_step, blend_and_allocate
from pipeline.attribution.workmodel import Coefficients, FittedWeights, SlotBatch

COEFFICIENTS = Coefficients(12.0, 0.05, 0.00005)
ALPHA = 0.8
RATE_MICRO_PER_MS = 1.0  # $3.60 per GPU-hour
ROUNDS = 5


@dataclass
class _Slot:
    request_id: str
    new_tokens: int
    context: int
    kv_blocks: float


def _steps(n_slots: int, seed: int) -> tuple[dict[str, np.ndarray], int, np.ndarray, np.ndarray]:
    """(slot columns, step count, KV blocks, step ms) of about n_slots slots."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 65, n_slots // 32 + 1)
    sizes = sizes[: np.searchsorted(np.cumsum(sizes), n_slots) + 1]
    n = int(sizes.sum())
    prefill = rng.random(n) < 0.1
    columns = {
        "step_index": np.repeat(np.arange(sizes.shape[0]), sizes),
        "new_tokens": np.where(prefill, rng.integers(16, 2049, n), 1),
        "context_tokens": rng.integers(0, 8000, n),
        "prompt_tokens": np.zeros(n, dtype=np.int64),
    }
    kv_blocks = np.ceil((columns["context_tokens"] + columns["new_tokens"]) / 16) / rng.integers(
        1, 4, n
    )
    step_ms = np.round(rng.uniform(10, 120, sizes.shape[0]), 3)
    return columns, sizes.shape[0], kv_blocks, step_ms


def _vectorised(
    columns: dict[str, np.ndarray], n_steps: int, kv_blocks: np.ndarray, totals: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    # From the slot columns as the hourly attribution reads them: the batch's construction
    # (which checks the step order and finds each step's rows) is timed too.
    batch = SlotBatch(n_steps=n_steps, **columns)
    work = FittedWeights(COEFFICIENTS).compute_work(batch, "per_slot")
    split = blend_and_allocate(totals, batch.steps, work, kv_blocks, ALPHA)
    return split.shares, split.exact


def _reference_inputs(
    columns: dict[str, np.ndarray], n_steps: int, kv_blocks: np.ndarray
) -> list[list[_Slot]]:
    bounds = np.searchsorted(columns["step_index"], np.arange(n_steps + 1)).tolist()
    new_tokens, context = columns["new_tokens"].tolist(), columns["context_tokens"].tolist()
    blocks = kv_blocks.tolist()
    return [
        [
            _Slot(str(i), new_tokens[i], context[i], blocks[i])
            for i in range(bounds[step], bounds[step + 1])
        ]
        for step in range(n_steps)
    ]


def _reference(steps: list[list[_Slot]], step_ms: list[float]) -> list[dict[str, int]]:
    c0, a, b = COEFFICIENTS.c0_ms, COEFFICIENTS.a_ms, COEFFICIENTS.b_ms
    return [
        allocate_step(slots, ms, RATE_MICRO_PER_MS, c0, a, b, ALPHA)
        for slots, ms in zip(steps, step_ms, strict=False)
    ]


def _best_of(repeats: int, run) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        run()
        best = min(best, time.process_time() - started)
    return best


def figures(quick: bool) -> list[Figure]:
    columns, n_steps, kv_blocks, step_ms = _steps(200_000 if quick else 1_200_000, seed=7)
    totals = np.array([round(ms * RATE_MICRO_PER_MS) for ms in step_ms], dtype=np.int64)
    vectorised = functools.partial(_vectorised, columns, n_steps, kv_blocks, totals)
    vectorised()  # compile once outside the timing

    # The reference gets its slots ready-made: only the allocation itself is timed. Each round
    # times the reference and then the vectorised path, and the figure is the median of the
    # rounds' ratios, so a burst of load on a shared machine moves one round, not the figure.
    reference_steps, reference_ms = _reference_inputs(columns, n_steps, kv_blocks), step_ms.tolist()
    ratios = []
    for _ in range(ROUNDS):
        started = time.process_time()
        reference_splits = _reference(reference_steps, reference_ms)
        reference_s = time.process_time() - started
        ratios.append(reference_s / _best_of(3, vectorised))
    reference = np.array(
        [share for split in reference_splits for share in split.values()], dtype=np.int64
    )
    shares, exact = vectorised()

    step_index = columns["step_index"]
    differ = np.flatnonzero(shares != reference)
    remainders = exact - np.floor(exact)
    for row in differ:
        step = step_index == step_index[row]
        if np.isclose(remainders[step], remainders[row], rtol=0, atol=1e-9).sum() < 2:
            raise AssertionError(
                f"slot {row}: vectorised {shares[row]} vs reference {reference[row]} is not a tie"
            )

    big, big_steps, big_kv, big_ms = _steps(2_000_000 if quick else 10_000_000, seed=11)
    big_totals = np.round(big_ms * 1000 * RATE_MICRO_PER_MS).astype(np.int64)  # nano-dollars
    rows_s = _best_of(3, lambda: _vectorised(big, big_steps, big_kv, big_totals))
    return [
        Figure("allocator_speedup_vs_seed", float(np.median(ratios)), "x", 50.0, "min"),
        Figure(
            "allocator_slot_rows_per_s", big["step_index"].shape[0] / rows_s, "rows/s", 2e7, "min"
        ),
    ]


if __name__ == "__main__":
    for figure in figures(quick=False):
        print(figure.line())
