"""KV cache memory-time and the compute/memory blend.

Within a step every holder holds its blocks for the same duration, so a row's KV share of the
step is its blocks over the step's blocks; across steps the memory-time is blocks x duration
(block-seconds), or with the kernel bytes x duration (byte-seconds: blocks x block size x KV
bytes per token). Blocks shared by k requests are logged as 1/k to each.
"""

from __future__ import annotations

import numpy as np

from schemas.config import AlphaFromEvidence, Policies

# Holders in these states keep their blocks on the GPU and accrue memory-time; a swapped-out
# request holds none.
ACCRUING_STATES = ("waiting", "preempted")
NON_ACCRUING_STATES = ("swapped",)


def alpha_for_period(policies: Policies, admission_blocked: np.ndarray) -> tuple[float, float]:
    """(alpha, blocked fraction) for a billing period from its steps' admission_blocked flags.

    A fixed alpha is returned as is; `AlphaFromEvidence` maps the fraction of steps that waited
    on free KV blocks linearly from max_alpha (never blocked) to min_alpha (always blocked).
    """
    blocked = np.asarray(admission_blocked, dtype=bool)
    fraction = float(blocked.mean()) if blocked.size else 0.0
    alpha = policies.alpha
    if isinstance(alpha, AlphaFromEvidence):
        return alpha.max_alpha - (alpha.max_alpha - alpha.min_alpha) * fraction, fraction
    return float(alpha), fraction


def holder_blocks(kv_blocks: np.ndarray, states: np.ndarray) -> np.ndarray:
    """Blocks each holder is charged for: its blocks while waiting/preempted, none when swapped out."""
    states = np.asarray(states, dtype=object)
    known = np.isin(states, ACCRUING_STATES + NON_ACCRUING_STATES)
    if not known.all():
        bad = sorted({str(s) for s in states[~known]})
        raise ValueError(
            f"holder state(s) {bad} unknown; expected one of {ACCRUING_STATES + NON_ACCRUING_STATES}"
        )
    return np.where(np.isin(states, ACCRUING_STATES), np.asarray(kv_blocks, dtype=np.float64), 0.0)


def first_writer_blocks(
    context_tokens: np.ndarray,
    new_tokens: np.ndarray,
    request_prefix_hits: np.ndarray,
    block_size: int,
) -> np.ndarray:
    """Blocks a slot pays for when the first writer of a shared prefix pays for its memory.

    A request that found its prefix in the cache pays only for the blocks past that prefix; the
    request that wrote it is charged its whole footprint, shared or not.
    """
    footprint = np.ceil((context_tokens + new_tokens) / block_size)
    blocks: np.ndarray = np.maximum(footprint - np.floor(request_prefix_hits / block_size), 0.0)
    return blocks
