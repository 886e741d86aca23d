"""The exact integer allocator: split integer totals among rows by weight, largest remainder.

Each group (one step, or one hour's idle) has an integer total. Every row gets the floor of
its exact real share, and the units left over (fewer than the group's row count) go to the
rows with the largest fractional remainders; equal remainders go to the earlier row (its
position in the group), so results are deterministic. Shares therefore sum to the group's
total exactly and each lies within one unit of its exact real share.

The hot path is one compiled pass per group: a sort over the whole table (the obvious numpy
formulation) is ten times slower than selecting the few largest remainders inside each
small group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol

import numba
import numpy as np

MICRO_PER_USD = 1_000_000
NANO_PER_USD = 1_000_000_000
MS_PER_HOUR = 3_600_000
# Kernel return code for a negative or non-finite weight (group indices are >= 0, -1 is success).
_BAD_VALUE = -2
# Boundary buckets of up to this many rows are ranked in place; bigger ones (many rows with
# near-equal remainders) by a sort.
_INSERTION_SORT_ROWS = 32


class AllocationError(ValueError):
    """A group cannot be split: a positive total with no positive weight, or bad inputs."""


# The kernels use numba's IEEE error model: every division below is by a sum checked to be
# positive, and the default model's zero-divisor check on each division adds a branch that
# keeps the loops from vectorising.

# Remainders are ranked by bucketing their leading bits (at least as many buckets as rows):
# every row in a bucket above the boundary bucket gets a unit, and only the boundary bucket,
# usually one row, is ranked exactly. Same rows as a stable sort by remainder, in linear time
# and without the mispredicted branches of a comparison sort.


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _bucket_count(size: int) -> int:
    n_buckets = 8
    while n_buckets < size:
        n_buckets *= 2
    return n_buckets


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _place(
    value: float, i: int, lo: int, n_buckets: int, exact: np.ndarray, shares: np.ndarray, buckets: np.ndarray,
    counts: np.ndarray,
) -> int:
    """Record row i's exact share and its floor, bucket its remainder; returns the floor."""
    exact[i] = value
    floor = np.int64(value)
    shares[i] = floor
    bucket = min(np.int64((value - floor) * n_buckets), n_buckets - 1)
    buckets[i - lo] = bucket
    counts[bucket] += 1
    return floor


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _top_up(
    left: int, lo: int, hi: int, n_buckets: int, exact: np.ndarray, shares: np.ndarray, buckets: np.ndarray,
    counts: np.ndarray,
) -> bool:
    """Give `left` units to the placed rows with the largest remainders, earliest on ties.

    False when `left` is outside 0..rows (the exact shares do not sum to the total).
    """
    size = hi - lo
    if left < 0 or left > size:
        return False
    if left == 0:
        return True
    above = 0
    boundary = n_buckets - 1
    while above + counts[boundary] < left:
        above += counts[boundary]
        boundary -= 1
    need = left - above
    whole_boundary = need == counts[boundary]
    for j in range(size):
        shares[lo + j] += (buckets[j] > boundary) | (whole_boundary & (buckets[j] == boundary))
    if whole_boundary:
        return True
    # The boundary bucket's rows, in position order, moved to the front of `buckets` (their
    # buckets are no longer needed), then ranked by remainder, earliest on ties.
    found = 0
    for j in range(size):
        if buckets[j] == boundary:
            buckets[found] = lo + j
            found += 1
    if found > _INSERTION_SORT_ROWS:
        negated = np.empty(found)
        for m in range(found):
            negated[m] = shares[buckets[m]] - exact[buckets[m]]
        # mergesort is stable: equal remainders keep their position order.
        ranked = np.argsort(negated, kind="mergesort")
        for m in range(need):
            shares[buckets[ranked[m]]] += 1
        return True
    # Usually two or three rows: a (stable) insertion sort, without allocating.
    for m in range(1, found):
        row = buckets[m]
        k = m
        while k > 0 and shares[buckets[k - 1]] - exact[buckets[k - 1]] > shares[row] - exact[row]:
            buckets[k] = buckets[k - 1]
            k -= 1
        buckets[k] = row
    for m in range(need):
        shares[buckets[m]] += 1
    return True


def _scratch(offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    largest = int(np.diff(offsets).max()) if offsets.shape[0] > 1 else 0
    return np.empty(max(largest, 1), dtype=np.int64), np.empty(max(64, 2 * largest), dtype=np.int64)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _largest_remainder_sorted(
    totals: np.ndarray,
    offsets: np.ndarray,
    weights: np.ndarray,
    shares: np.ndarray,
    exact: np.ndarray,
    buckets: np.ndarray,
    counts: np.ndarray,
) -> int:
    """Fill `shares`/`exact` for groups laid out contiguously.

    Returns -1 when done, a failing group's index, or _BAD_VALUE for a negative or non-finite weight.
    """
    for group in range(totals.shape[0]):
        lo = offsets[group]
        hi = offsets[group + 1]
        total = totals[group]
        weight_sum = 0.0
        for i in range(lo, hi):
            if not weights[i] >= 0.0:
                return _BAD_VALUE
            weight_sum += weights[i]
        if not weight_sum < np.inf:
            return _BAD_VALUE
        if total == 0:
            for i in range(lo, hi):
                shares[i] = 0
                exact[i] = 0.0
            continue
        if not weight_sum > 0.0:
            return group
        n_buckets = _bucket_count(hi - lo)
        counts[:n_buckets] = 0
        given = 0
        for i in range(lo, hi):
            given += _place(total * (weights[i] / weight_sum), i, lo, n_buckets, exact, shares, buckets, counts)
        if not _top_up(total - given, lo, hi, n_buckets, exact, shares, buckets, counts):
            return group
    return -1


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _blend_group(
    total: int,
    lo: int,
    hi: int,
    work: np.ndarray,
    work_offset: int,
    kv: np.ndarray,
    alpha: float,
    shares: np.ndarray,
    exact: np.ndarray,
    compute_part: np.ndarray,
    kv_part: np.ndarray,
    buckets: np.ndarray,
    counts: np.ndarray,
) -> int:
    """Blend and allocate one group (rows lo..hi, work[i - work_offset]); 0, _BAD_VALUE or 1 (cannot split).

    The arithmetic follows the reference allocator operation by operation, (alpha x work) /
    sum then x total, so its shares come out bit for bit the same.
    """
    compute_sum = 0.0
    kv_sum = 0.0
    for i in range(lo, hi):
        if not (work[i - work_offset] >= 0.0 and kv[i] >= 0.0):
            return _BAD_VALUE
        compute_sum += work[i - work_offset]
        kv_sum += kv[i]
    if not (compute_sum < np.inf and kv_sum < np.inf):
        return _BAD_VALUE
    # No blocks: compute alone; no compute (holders only): KV alone.
    group_alpha = alpha if kv_sum > 0.0 else 1.0
    if not compute_sum > 0.0:
        group_alpha = 0.0
    if total > 0 and not (compute_sum > 0.0 or kv_sum > 0.0):
        return 1
    with_parts = compute_part.shape[0] > 0
    n_buckets = _bucket_count(hi - lo)
    counts[:n_buckets] = 0
    # The exact shares first, in a loop of arithmetic alone (the compiler vectorises its
    # divisions), then their floors and buckets.
    compute_scale = group_alpha if compute_sum > 0.0 else 0.0
    kv_scale = 1.0 - group_alpha if kv_sum > 0.0 else 0.0
    compute_divisor = compute_sum if compute_sum > 0.0 else 1.0
    kv_divisor = kv_sum if kv_sum > 0.0 else 1.0
    if with_parts:
        for i in range(lo, hi):
            compute_part[i] = compute_scale * work[i - work_offset] / compute_divisor
            kv_part[i] = kv_scale * kv[i] / kv_divisor
            exact[i] = (compute_part[i] + kv_part[i]) * total
    else:
        for i in range(lo, hi):
            exact[i] = (compute_scale * work[i - work_offset] / compute_divisor + kv_scale * kv[i] / kv_divisor) * total
    given = 0
    for i in range(lo, hi):
        given += _place(exact[i], i, lo, n_buckets, exact, shares, buckets, counts)
    return 0 if _top_up(total - given, lo, hi, n_buckets, exact, shares, buckets, counts) else 1


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _blend_allocate_sorted(
    totals: np.ndarray,
    offsets: np.ndarray,
    compute: np.ndarray,
    kv: np.ndarray,
    alpha: np.ndarray,
    shares: np.ndarray,
    exact: np.ndarray,
    compute_part: np.ndarray,
    kv_part: np.ndarray,
    buckets: np.ndarray,
    counts: np.ndarray,
) -> int:
    """Blend compute and KV shares per group and allocate, in one pass. The weight parts are
    written only when `compute_part`/`kv_part` are not empty. Returns as _largest_remainder_sorted."""
    for group in range(totals.shape[0]):
        status = _blend_group(
            totals[group], offsets[group], offsets[group + 1], compute, 0, kv, alpha[group], shares, exact,
            compute_part, kv_part, buckets, counts,
        )
        if status != 0:
            return _BAD_VALUE if status == _BAD_VALUE else group
    return -1


# The fitted work model's per-row formula lives beside the kernels so the fused fitted path
# inlines it; workmodel.fitted_work_ms uses the same functions, so both paths agree bit for bit.
@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def fitted_slot_work(fixed: float, t: float, context: float, a: float, b: float) -> float:
    """fixed + (a t + b t (L + (t + 1) / 2)), in the reference allocator's operation order."""
    return fixed + (a * t + b * (t * (context + (t + 1.0) / 2.0)))


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def fitted_group_work(
    lo: int, hi: int, new_tokens: np.ndarray, context: np.ndarray, c0: float, a: float, b: float, per_token: bool,
    out: np.ndarray, out_offset: int,
) -> None:
    """Work of rows lo..hi of one step into out[i - out_offset]: c0 per slot or per token, plus own work."""
    token_sum = 0.0
    if per_token:
        for i in range(lo, hi):
            token_sum += new_tokens[i]
    for i in range(lo, hi):
        t = float(new_tokens[i])
        fixed = c0 * (t / token_sum) if token_sum > 0.0 else c0 / (hi - lo)
        out[i - out_offset] = fitted_slot_work(fixed, t, context[i], a, b)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _fitted_allocate_sorted(
    totals: np.ndarray,
    offsets: np.ndarray,
    new_tokens: np.ndarray,
    context: np.ndarray,
    kv: np.ndarray,
    coefficients: np.ndarray,
    per_token: bool,
    alpha: np.ndarray,
    shares: np.ndarray,
    exact: np.ndarray,
    buckets: np.ndarray,
    counts: np.ndarray,
    work: np.ndarray,
) -> int:
    """_blend_allocate_sorted with each step's fitted work computed in place (no work array)."""
    c0, a, b = coefficients[0], coefficients[1], coefficients[2]
    no_parts = np.empty(0)
    for group in range(totals.shape[0]):
        lo = offsets[group]
        hi = offsets[group + 1]
        fitted_group_work(lo, hi, new_tokens, context, c0, a, b, per_token, work, lo)
        status = _blend_group(
            totals[group], lo, hi, work, lo, kv, alpha[group], shares, exact, no_parts, no_parts, buckets, counts
        )
        if status != 0:
            return _BAD_VALUE if status == _BAD_VALUE else group
    return -1


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _offsets_if_ordered(groups: np.ndarray, offsets: np.ndarray) -> bool:
    """Fill `offsets` (n_groups + 1) when groups are non-decreasing and in range; else False."""
    n_groups = offsets.shape[0] - 1
    previous = 0
    offsets[0] = 0
    for i in range(groups.shape[0]):
        group = groups[i]
        if group < previous or group >= n_groups:
            return False
        while previous < group:
            previous += 1
            offsets[previous] = i
    for group in range(previous + 1, n_groups + 1):
        offsets[group] = groups.shape[0]
    return True



def _layout(totals: np.ndarray, groups: np.ndarray, arrays: dict[str, np.ndarray]) -> tuple[np.ndarray | None, np.ndarray]:
    """Check shapes and totals; returns (permutation to group order or None when already
    ordered, group offsets in that order)."""
    if (totals < 0).any():
        raise AllocationError(f"negative total in group {int(np.flatnonzero(totals < 0)[0])}")
    for name, values in arrays.items():
        if values.shape != groups.shape:
            raise AllocationError(f"group_index has {groups.shape[0]} rows but {name} has {values.shape[0]}")
    offsets = np.empty(totals.shape[0] + 1, dtype=np.int64)
    if _offsets_if_ordered(groups, offsets):
        return None, offsets
    if groups.size and (groups.min() < 0 or groups.max() >= totals.shape[0]):
        raise AllocationError(f"group_index outside 0..{totals.shape[0] - 1}")
    permutation = np.argsort(groups, kind="stable")
    return permutation, np.searchsorted(groups[permutation], np.arange(totals.shape[0] + 1)).astype(np.int64)


def _raise_bad_value(arrays: dict[str, np.ndarray]) -> None:
    for name, values in arrays.items():
        bad = ~np.isfinite(values) | ~(values >= 0)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise AllocationError(f"row {row} has {name} {values[row]!r}; {name} must be finite and >= 0")
    raise AllocationError("weights sum to infinity within a group")


def _unpermute(permutation: np.ndarray | None, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    if permutation is None:
        return arrays
    restored = []
    for values in arrays:
        out = np.empty_like(values)
        out[permutation] = values
        restored.append(out)
    return tuple(restored)


def largest_remainder(
    totals_nano: np.ndarray, group_index: np.ndarray, weights: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Split `totals_nano[g]` among the rows with `group_index == g` in proportion to `weights`.

    Returns (integer shares, exact real shares), one per row. Within a group, ties go to the
    row that comes first in the input. Rows of a group need not be adjacent, but groups laid
    out one after another in non-decreasing order (steps in order) skip a sort.
    """
    totals = np.ascontiguousarray(totals_nano, dtype=np.int64)
    groups = np.ascontiguousarray(group_index, dtype=np.int64)
    row_weights = np.ascontiguousarray(weights, dtype=np.float64)
    permutation, offsets = _layout(totals, groups, {"weight": row_weights})
    shares = np.empty(groups.shape[0], dtype=np.int64)
    exact = np.empty(groups.shape[0], dtype=np.float64)
    sorted_weights = row_weights if permutation is None else row_weights[permutation]
    failed = _largest_remainder_sorted(totals, offsets, sorted_weights, shares, exact, *_scratch(offsets))
    if failed == _BAD_VALUE:
        _raise_bad_value({"weight": row_weights})
    if failed >= 0:
        raise AllocationError(
            f"group {failed} has total {int(totals[failed])} but no row with a positive weight to carry it"
        )
    return _unpermute(permutation, shares, exact)


@dataclass(frozen=True)
class BlendedSplit:
    """Per row: integer share, exact real share, and the two blended weight parts."""

    shares: np.ndarray
    exact: np.ndarray
    compute_part: np.ndarray | None  # alpha x the row's share of its group's compute work
    kv_part: np.ndarray | None  # (1 - alpha) x its share of the group's KV blocks


def blend_and_allocate(
    totals: np.ndarray,
    group_index: np.ndarray,
    compute_work: np.ndarray,
    kv_weight: np.ndarray,
    alpha: float | np.ndarray,
    *,
    with_parts: bool = True,
) -> BlendedSplit:
    """Weight each row alpha x compute share + (1 - alpha) x KV share within its group, then
    split the group's total by largest remainder.

    `alpha` is one value or one per group. A group without KV blocks is split on compute alone,
    one without compute work (holders only) on KV alone; a group with a positive total and
    neither is an error. `with_parts=False` skips the per-row weight parts (left as None) for
    callers that need only the shares.
    """
    totals = np.ascontiguousarray(totals, dtype=np.int64)
    groups = np.ascontiguousarray(group_index, dtype=np.int64)
    compute = np.ascontiguousarray(compute_work, dtype=np.float64)
    kv = np.ascontiguousarray(kv_weight, dtype=np.float64)
    checked = {"compute work": compute, "KV weight": kv}
    permutation, offsets = _layout(totals, groups, checked)
    group_alpha = np.ascontiguousarray(np.broadcast_to(np.asarray(alpha, dtype=np.float64), totals.shape))
    if ((group_alpha < 0) | (group_alpha > 1)).any():
        raise AllocationError("alpha must lie in [0, 1]")
    if permutation is not None:
        compute, kv = compute[permutation], kv[permutation]
    n = groups.shape[0]
    shares, exact = np.empty(n, dtype=np.int64), np.empty(n)
    parts_rows = n if with_parts else 0
    compute_part, kv_part = np.empty(parts_rows), np.empty(parts_rows)
    failed = _blend_allocate_sorted(
        totals, offsets, compute, kv, group_alpha, shares, exact, compute_part, kv_part, *_scratch(offsets)
    )
    if failed == _BAD_VALUE:
        _raise_bad_value(checked)
    if failed >= 0:
        raise AllocationError(
            f"group {failed} has total {int(totals[failed])} but no row with compute work or KV blocks to carry it"
        )
    if not with_parts:
        return BlendedSplit(*_unpermute(permutation, shares, exact), None, None)
    return BlendedSplit(*_unpermute(permutation, shares, exact, compute_part, kv_part))


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _split_compute_kv(amount: np.ndarray, compute_part: np.ndarray, kv_part: np.ndarray, compute: np.ndarray) -> None:
    for i in range(amount.shape[0]):
        both = compute_part[i] + kv_part[i]
        share = np.int64(np.floor(amount[i] * (compute_part[i] / both) + 0.5)) if both > 0.0 else amount[i]
        compute[i] = min(share, amount[i])


def allocate_fitted_steps(
    totals: np.ndarray,
    step_index: np.ndarray,
    new_tokens: np.ndarray,
    context_tokens: np.ndarray,
    kv_blocks: np.ndarray,
    coefficients: tuple[float, float, float],
    alpha: float | np.ndarray,
    fixed_cost: str = "per_slot",
) -> tuple[np.ndarray, np.ndarray]:
    """(shares, exact shares) of steps weighted by fitted coefficients (c0, a, b) in one pass.

    The same result as fitted work followed by `blend_and_allocate`, without materialising the
    work: the reference allocator's computation for every step at once. Rows must be in step
    order (non-decreasing `step_index`).
    """
    if fixed_cost not in ("per_slot", "per_token"):
        raise AllocationError(f"unknown fixed-cost policy {fixed_cost!r}; expected per_slot or per_token")
    totals = np.ascontiguousarray(totals, dtype=np.int64)
    groups = np.ascontiguousarray(step_index, dtype=np.int64)
    kv = np.ascontiguousarray(kv_blocks, dtype=np.float64)
    permutation, offsets = _layout(totals, groups, {"KV weight": kv})
    if permutation is not None:
        raise AllocationError("rows must be in step order (non-decreasing step_index)")
    group_alpha = np.ascontiguousarray(np.broadcast_to(np.asarray(alpha, dtype=np.float64), totals.shape))
    n = groups.shape[0]
    shares, exact = np.empty(n, dtype=np.int64), np.empty(n)
    buckets, counts = _scratch(offsets)
    failed = _fitted_allocate_sorted(
        totals, offsets, np.ascontiguousarray(new_tokens, dtype=np.int64), np.ascontiguousarray(context_tokens), kv,
        np.asarray(coefficients, dtype=np.float64), fixed_cost == "per_token", group_alpha, shares, exact, buckets,
        counts, np.empty(buckets.shape[0]),
    )
    if failed == _BAD_VALUE:
        _raise_bad_value({"KV weight": kv, "coefficient": np.asarray(coefficients, dtype=np.float64)})
    if failed >= 0:
        raise AllocationError(f"group {failed} has total {int(totals[failed])} but no row with work or KV blocks")
    return shares, exact


def split_compute_kv(amount_nano: np.ndarray, compute_part: np.ndarray, kv_part: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split each row's integer amount into (compute, KV) by its two weight parts.

    compute = round-half-up(amount x compute/(compute + kv)); kv = amount - compute, so the two
    always sum to the row's amount.
    """
    amount = np.ascontiguousarray(amount_nano, dtype=np.int64)
    compute = np.empty_like(amount)
    _split_compute_kv(
        amount, np.ascontiguousarray(compute_part, dtype=np.float64), np.ascontiguousarray(kv_part, dtype=np.float64), compute
    )
    return compute, amount - compute


def step_total_units(step_ms: float, gpus: int, usd_per_gpu_hour: float, unit_per_usd: int) -> int:
    """One step's cost in whole units (micro- or nano-dollars), rounded half-to-even once.

    Exact rational arithmetic on the decimal inputs, so 50 ms at $3.60 is exactly 50 micro-dollars.
    """
    exact = (
        Fraction(str(step_ms)) * gpus * Fraction(str(usd_per_gpu_hour)) * unit_per_usd / MS_PER_HOUR
    )
    return round(exact)


class SeedSlot(Protocol):
    request_id: str
    new_tokens: int
    context: int
    kv_blocks: float


def predicted_ms(slot: SeedSlot, a_ms: float, b_ms: float) -> float:
    """The slot's variable work: dense per-token cost plus attention over its context."""
    attention_pairs = slot.new_tokens * (slot.context + (slot.new_tokens + 1) / 2)
    return a_ms * slot.new_tokens + b_ms * attention_pairs


def allocate_step(
    slots: Sequence[SeedSlot],
    step_ms: float,
    rate_micro_per_ms: float,
    c0_ms: float,
    a_ms: float,
    b_ms: float,
    alpha: float = 0.8,
) -> dict[str, int]:
    """Split one measured step among its slots in integer micro-dollars (the reference method).

    Same arguments and results as the method's published per-step allocator, with two
    guards it lacks: a step whose slots hold no KV blocks is split on compute alone (instead
    of losing (1 - alpha) of the step), and an empty step is an error. This is the scalar
    explanation path; `largest_remainder` is the production one and gives the same shares.
    """
    if not slots:
        raise AllocationError("a step needs at least one slot")
    total = round(step_ms * rate_micro_per_ms)
    fixed = c0_ms / len(slots)
    compute = [fixed + predicted_ms(s, a_ms, b_ms) for s in slots]
    compute_sum = sum(compute)
    kv_sum = sum(s.kv_blocks for s in slots)
    compute_weight = alpha if kv_sum > 0 else 1.0
    weights = [
        compute_weight * c / compute_sum + ((1 - compute_weight) * s.kv_blocks / kv_sum if kv_sum > 0 else 0.0)
        for c, s in zip(compute, slots)
    ]
    raw = [w * total for w in weights]
    floors = [int(x) for x in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - floors[i], reverse=True)
    for i in order[: total - sum(floors)]:
        floors[i] += 1
    if sum(floors) != total:
        raise AllocationError(f"step of {total} units: rounding left {total - sum(floors)} units unassigned")
    return {s.request_id: amount for s, amount in zip(slots, floors)}
