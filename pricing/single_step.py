"""One step priced in a single compiled pass: the live path prices steps one at a time as they
arrive, where numpy's per-call overhead, not the arithmetic, would set the cost.

`price_step` evaluates exactly the laws `Kernel.price_many` composes with numpy (the features of
`Kernel._features`, the linear terms, the collectives, the distinct experts' reads, the host
and `laws.compose_step`), over the constants `Kernel` packs once (`StepConstants`); the property
test `test_many_steps_match_one_step_at_a_time` holds the two to the same numbers.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

# Rows of StepConstants.bounds: how a decode row's cached tokens are read (`laws.decode_read_tokens`
# and `laws.context_shard`); -1 marks an absent window, top_k or ratio.
BOUND_SPARSE, BOUND_WINDOW, BOUND_TOP_K, BOUND_RATIO, BOUND_RANKS = range(5)
# StepConstants.collectives columns, and the features a step's flags and counts occupy
# (kernel.ACTIVE ... kernel.DECODE_TOKENS, in that order).
COLL_BYTES, COLL_T0, COLL_RT, COLL_PEAK, COLL_ROWS = range(5)
ACTIVE, TOKENS, DECODING, PREFILLING, MIXED, ROWS, PREFILL_TOKENS, DECODE_TOKENS = range(8)
# StepConstants.host: graph costs of a uniform-decode and any other step, eager, the capture
# ceiling in tokens, kernels launched, dispatch per kernel, tokens of a uniform decode row; then
# the drafter's (`plan.Drafter`): its ceiling in rows, replay, eager and context-store costs.
HOST_DECODE, HOST_OTHER, HOST_EAGER, HOST_CEILING, HOST_KERNELS, HOST_DISPATCH, HOST_UNIFORM = (
    range(7)
)
DRAFTER_ROWS, DRAFTER_REPLAY, DRAFTER_EAGER, DRAFTER_STORE = range(7, 11)


class StepConstants(NamedTuple):
    """A kernel's constants in the layout `price_step` reads (built once by `Kernel`)."""

    decode_threshold: int
    bounds: np.ndarray  # (read bounds, 5)
    caps: np.ndarray  # (key caps,) keys a prefill query sees at most, -1 = no cap
    prefill_ramp: np.ndarray  # eps_max, m_half, 1 if per request else 0
    reads_at: int
    pairs_at: int
    linear: np.ndarray  # (outputs, features), `Kernel._linear`
    repeat: np.ndarray  # (kinds,)
    collectives: np.ndarray  # (collectives, 5)
    fabric_launches: np.ndarray  # (2 * kinds, collectives)
    # (parts, 4): a dense GEMM part's kind (kinds = the head), its arithmetic per token and
    # ramp overhead, its weight read (`Kernel._gemm_parts`); none under compat "go"
    gemm_parts: np.ndarray
    # (kinds, 5): tokens routed per step token, miss, local, us per expert, ranks whose busiest
    # one the layer waits for
    experts: np.ndarray
    host: np.ndarray  # (11,)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _read_tokens(context: float, bound: np.ndarray) -> float:
    ctx = max(context, 0.0)
    top_k = float(bound[BOUND_TOP_K])
    read: float
    if bound[BOUND_SPARSE] > 0:
        read = min(ctx, top_k)
        if bound[BOUND_RATIO] > 0:
            read += max(0.0, ctx - top_k) / bound[BOUND_RATIO]
    elif bound[BOUND_WINDOW] >= 0:
        read = min(ctx, float(bound[BOUND_WINDOW]))
    else:
        read = ctx
    if bound[BOUND_RANKS] > 1:
        read = float(np.ceil(read / bound[BOUND_RANKS]))
    return read


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _pairs(scheduled: float, computed: float, cap: float) -> float:
    if cap < 0:
        return scheduled * computed + scheduled * scheduled / 2.0
    x0 = min(max(cap - computed, 0.0), scheduled)
    return x0 * computed + x0 * x0 / 2.0 + (scheduled - x0) * cap


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _efficiency(tokens: float, eps_max: float, m_half: float) -> float:
    return eps_max * tokens / max(tokens + m_half, 1e-300) if tokens > 0 else 0.0


@numba.njit(cache=True, nogil=True, error_model="numpy")
def step_features(
    scheduled: np.ndarray,
    computed: np.ndarray,
    threshold: int,
    bounds: np.ndarray,
    caps: np.ndarray,
    prefill_ramp: np.ndarray,
    reads_at: int,
    pairs_at: int,
    uniform_tokens: float,
) -> tuple[np.ndarray, bool]:
    """One step's features (`Kernel._features`) and whether it is a uniform decode."""
    features = np.zeros(pairs_at + len(caps))
    uniform = True
    decoding = prefilling = False
    for i in range(len(scheduled)):
        s = float(scheduled[i])
        uniform = uniform and s == uniform_tokens
        features[TOKENS] += s
        if s > 0:
            features[ROWS] += 1.0
        if scheduled[i] > threshold:
            prefilling = True
            features[PREFILL_TOKENS] += s
        elif s > 0:
            decoding = True
            features[DECODE_TOKENS] += s
            for j in range(len(bounds)):
                features[reads_at + j] += _read_tokens(float(computed[i]) + s, bounds[j])
    if prefilling:
        eps_max, m_half = prefill_ramp[0], prefill_ramp[1]
        step_scale = 1.0 / _efficiency(features[TOKENS], eps_max, m_half)
        for i in range(len(scheduled)):
            if scheduled[i] <= threshold:
                continue
            s = float(scheduled[i])
            scale = 1.0 / _efficiency(s, eps_max, m_half) if prefill_ramp[2] > 0 else step_scale
            for j in range(len(caps)):
                features[pairs_at + j] += _pairs(s, float(computed[i]), caps[j]) * scale
    features[ACTIVE] = 1.0 if features[TOKENS] > 0 else 0.0
    features[DECODING] = 1.0 if decoding else 0.0
    features[PREFILLING] = 1.0 if prefilling else 0.0
    features[MIXED] = 1.0 if decoding and prefilling else 0.0
    return features, uniform


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _dot(weights: np.ndarray, values: np.ndarray) -> float:
    total = 0.0
    for i in range(len(values)):
        total += weights[i] * values[i]
    return total


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _busiest_rank_distinct(tokens: float, miss: float, n: int, ranks: float) -> float:
    """`laws.busiest_rank_distinct_experts` for one step."""
    reached = 1.0 - miss**tokens
    if reached <= 0.0:
        return 0.0
    missed = 1.0 - reached
    if missed <= 0.0:
        return float(n)
    log_reached, log_missed = np.log(reached), np.log(missed)
    cdf, expected, log_choose = 0.0, 0.0, 0.0
    for x in range(n):
        if x:
            log_choose += np.log((n - x + 1) / x)
        cdf = min(cdf + np.exp(log_choose + x * log_reached + (n - x) * log_missed), 1.0)
        expected += 1.0 - cdf**ranks
    return expected


@numba.njit(cache=True, nogil=True, error_model="numpy")
def compose_one(
    features: np.ndarray,
    uniform: bool,
    linear: np.ndarray,
    repeat: np.ndarray,
    collectives: np.ndarray,
    fabric_launches: np.ndarray,
    gemm_parts: np.ndarray,
    experts: np.ndarray,
    host: np.ndarray,
) -> np.ndarray:
    """One step composed as `laws.compose_step` composes it. Returns, flat: the five resource
    totals, overlap, nooverlap, the bottleneck's index, then per kind the layer's SM, HBM, NVLink
    and NIC (4 x kinds), the experts' SM and HBM (2 x kinds) and the stage (kinds), and the
    head's SM and HBM."""
    kinds = len(repeat)
    terms = np.empty(len(linear))
    for o in range(len(linear)):
        terms[o] = _dot(linear[o], features)
    launch_us = np.zeros(len(collectives))
    for c in range(len(collectives)):
        rows = features[int(collectives[c, COLL_ROWS])]
        if rows > 0:
            message = collectives[c, COLL_BYTES] * rows
            launch_us[c] = max(
                collectives[c, COLL_T0] + message / collectives[c, COLL_RT],
                message / collectives[c, COLL_PEAK],
            )
    tokens = features[TOKENS]
    # each dense GEMM part costs the larger of its arithmetic and its read (`laws.gemm_kernel_us`)
    gemm = np.zeros((2, kinds + 1))
    if tokens > 0:
        for p in range(len(gemm_parts)):
            kind = int(gemm_parts[p, 0])
            ramp = gemm_parts[p, 1] * tokens + gemm_parts[p, 2]
            if ramp >= gemm_parts[p, 3]:
                gemm[0, kind] += ramp
            else:
                gemm[1, kind] += gemm_parts[p, 3]
    out = np.zeros(8 + 7 * kinds + 2)
    layer_at, expert_at, stage_at, head_at = 8, 8 + 4 * kinds, 8 + 6 * kinds, 8 + 7 * kinds
    totals = np.zeros(5)
    staged = 0.0
    for k in range(kinds):
        sm = terms[k] + terms[kinds + k] + gemm[0, k]
        hbm = terms[2 * kinds + k] + gemm[1, k]
        nvlink = _dot(fabric_launches[k], launch_us)
        nic = _dot(fabric_launches[kinds + k], launch_us)
        routed = experts[k, 0] * tokens
        expert_sm = terms[3 * kinds + k]
        if experts[k, 4] > 1:
            touched = _busiest_rank_distinct(
                routed, experts[k, 1], int(experts[k, 2]), experts[k, 4]
            )
        else:
            touched = experts[k, 2] * (1.0 - experts[k, 1] ** routed)
        expert_hbm = touched * experts[k, 3]
        stage = max(max(sm, hbm), max(nvlink, nic)) + expert_sm + expert_hbm
        for r, value in enumerate((sm, hbm, nvlink, nic)):
            out[layer_at + r * kinds + k] = value
            totals[r] += repeat[k] * value
        out[expert_at + k] = expert_sm
        out[expert_at + kinds + k] = expert_hbm
        out[stage_at + k] = stage
        totals[0] += repeat[k] * expert_sm
        totals[1] += repeat[k] * expert_hbm
        staged += repeat[k] * stage
    head_sm = terms[4 * kinds] + gemm[0, kinds]
    head_hbm = terms[4 * kinds + 1] + gemm[1, kinds]
    out[head_at], out[head_at + 1] = head_sm, head_hbm
    totals[0] += head_sm
    totals[1] += head_hbm
    graph = host[HOST_DECODE] if uniform else host[HOST_OTHER]
    if tokens > host[HOST_CEILING]:
        graph = host[HOST_EAGER]
    totals[4] = graph + host[HOST_KERNELS] * host[HOST_DISPATCH]
    rows = features[ROWS]
    if rows > 0:
        drafter = host[DRAFTER_REPLAY] if rows <= host[DRAFTER_ROWS] else host[DRAFTER_EAGER]
        if features[PREFILLING] > 0:
            drafter += host[DRAFTER_STORE]
        totals[4] += drafter
    nooverlap = totals.sum()
    out[:5] = totals
    out[5] = min(staged + max(head_sm, head_hbm) + totals[4], nooverlap)
    out[6] = nooverlap
    out[7] = float(np.argmax(totals))
    return out


@numba.njit(cache=True, nogil=True, error_model="numpy")
def non_negative(counts: np.ndarray) -> bool:
    """No count is negative."""
    return counts.size == 0 or counts.min() >= 0


def price_step(scheduled: np.ndarray, computed: np.ndarray, constants: StepConstants) -> np.ndarray:
    """One step's composed price (`compose_one`'s layout) from its int64 per-request arrays."""
    features, uniform = step_features(
        scheduled,
        computed,
        constants.decode_threshold,
        constants.bounds,
        constants.caps,
        constants.prefill_ramp,
        constants.reads_at,
        constants.pairs_at,
        constants.host[HOST_UNIFORM],
    )
    return compose_one(
        features,
        uniform,
        constants.linear,
        constants.repeat,
        constants.collectives,
        constants.fabric_launches,
        constants.gemm_parts,
        constants.experts,
        constants.host,
    )
