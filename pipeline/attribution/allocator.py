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
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Protocol

import numba
import numpy as np

from schemas.errors import InputError
from schemas.units import MS_PER_HOUR

# Kernel return code for a negative or non-finite weight (group indices are >= 0, -1 is success).
_BAD_VALUE = -2
# Boundary buckets of up to this many rows are ranked in place; bigger ones (many rows with
# near-equal remainders) by a sort.
_INSERTION_SORT_ROWS = 32


class AllocationError(InputError):
    """A group cannot be split: a positive total with no positive weight, or bad inputs."""


# The kernels use numba's IEEE error model: every division below is by a sum checked to be
# positive, and the default model's zero-divisor check on each division adds a branch that
# keeps the loops from vectorising.

# Remainders are ranked by bucketing their leading bits (at least as many buckets as rows):
# every row in a bucket above the boundary bucket gets a unit, and only the boundary bucket,
# usually one row, is ranked exactly. Same rows as a stable sort by remainder, in linear time
# and without the mispredicted branches of a comparison sort. The loop that computes a
# group's exact shares also takes their floors and buckets: one pass over the rows, not two.


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _bucket_count(size: int) -> int:
    n_buckets = 8
    while n_buckets < size:
        n_buckets *= 2
    return n_buckets


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _floor_row(
    value: float, top_bucket: int, i: int, lo: int, shares: np.ndarray, buckets: np.ndarray
) -> np.int64:
    """Store the floor of `value` as row i's share and its remainder's bucket; returns the floor."""
    floor = np.int64(value)
    shares[i] = floor
    buckets[i - lo] = min(np.int64((value - floor) * (top_bucket + 1)), top_bucket)
    return floor


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _rank_boundary(
    need: int | np.int64, found: int, exact: np.ndarray, shares: np.ndarray, rows: np.ndarray
) -> None:
    """Give a unit to the `need` of `rows[:found]` (in position order) with the largest
    remainders, earliest on ties."""
    if found > _INSERTION_SORT_ROWS:
        negated = np.empty(found)
        for m in range(found):
            negated[m] = shares[rows[m]] - exact[rows[m]]
        # mergesort is stable: equal remainders keep their position order.
        ranked = np.argsort(negated, kind="mergesort")
        for m in range(need):
            shares[rows[ranked[m]]] += 1
        return
    # Usually two or three rows: a (stable) insertion sort, without allocating.
    for m in range(1, found):
        row = rows[m]
        k = m
        while k > 0 and shares[rows[k - 1]] - exact[rows[k - 1]] > shares[row] - exact[row]:
            rows[k] = rows[k - 1]
            k -= 1
        rows[k] = row
    for m in range(need):
        shares[rows[m]] += 1


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _give_leftover_units(
    total: int,
    given: np.int64,
    lo: int,
    hi: int,
    exact: np.ndarray,
    shares: np.ndarray,
    buckets: np.ndarray,
    counts: np.ndarray,
) -> bool:
    """Rows lo..hi hold their floors (summing to `given`) and remainder buckets: hand the
    units left over to the largest remainders, earliest on ties. False when the floors leave
    fewer than 0 or more than `rows` units (the exact shares do not sum to the total)."""
    size = hi - lo
    left = total - given
    if left == 0:
        return True
    if left < 0 or left > size:
        return False
    n_buckets = _bucket_count(size)
    for bucket in range(n_buckets):
        counts[bucket] = 0
    for j in range(size):
        counts[buckets[j]] += 1
    # The boundary bucket: the one holding the left-th largest remainder, found from the
    # nearer end of the counts.
    if 2 * left <= size:
        above = 0
        boundary = n_buckets - 1
        while above + counts[boundary] < left:
            above += counts[boundary]
            boundary -= 1
    else:
        below = 0
        boundary = 0
        while below + counts[boundary] <= size - left:
            below += counts[boundary]
            boundary += 1
        above = size - below - counts[boundary]
    need = left - above
    if need == counts[boundary]:
        for j in range(size):
            shares[lo + j] += buckets[j] >= boundary
        return True
    # Rows above the boundary get their unit; the boundary bucket's rows, in position order,
    # move to the front of `buckets` (j >= found, so no bucket is overwritten before it is read).
    found = 0
    for j in range(size):
        bucket = buckets[j]
        shares[lo + j] += bucket > boundary
        if bucket == boundary:
            buckets[found] = lo + j
            found += 1
    _rank_boundary(need, found, exact, shares, buckets)
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
        # A flag, not an early return: the loop stays free of exits.
        valid = True
        for i in range(lo, hi):
            valid &= weights[i] >= 0.0
            weight_sum += weights[i]
        if not (valid and weight_sum < np.inf):
            return _BAD_VALUE
        if total == 0:
            for i in range(lo, hi):
                shares[i] = 0
                exact[i] = 0.0
            continue
        if not weight_sum > 0.0:
            return group
        top_bucket = _bucket_count(hi - lo) - 1
        given = np.int64(0)
        for i in range(lo, hi):
            exact[i] = total * (weights[i] / weight_sum)
            given += _floor_row(exact[i], top_bucket, i, lo, shares, buckets)
        if not _give_leftover_units(total, given, lo, hi, exact, shares, buckets, counts):
            return group
    return -1


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _blend_scales(
    compute: np.ndarray, kv: np.ndarray, lo: int, hi: int, alpha: float
) -> tuple[bool, float, float, float, float]:
    """(valid, compute scale, compute divisor, KV scale, KV divisor) of rows lo..hi: a row's
    weight is compute scale x work / compute divisor + KV scale x blocks / KV divisor.

    Sums run in row order, as the reference allocator adds them. Not valid when a value is
    negative or not finite. No blocks: compute alone; no compute (holders only): KV alone;
    neither: both scales 0.
    """
    compute_sum = 0.0
    kv_sum = 0.0
    # A flag, not an early return: the loop stays free of exits.
    valid = True
    for i in range(lo, hi):
        valid &= (compute[i] >= 0.0) & (kv[i] >= 0.0)
        compute_sum += compute[i]
        kv_sum += kv[i]
    valid &= (compute_sum < np.inf) & (kv_sum < np.inf)
    group_alpha = alpha if kv_sum > 0.0 else 1.0
    if not compute_sum > 0.0:
        group_alpha = 0.0
    return (
        valid,
        group_alpha if compute_sum > 0.0 else 0.0,
        compute_sum if compute_sum > 0.0 else 1.0,
        1.0 - group_alpha if kv_sum > 0.0 else 0.0,
        kv_sum if kv_sum > 0.0 else 1.0,
    )


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _blend_allocate_sorted(
    totals: np.ndarray,
    offsets: np.ndarray,
    compute: np.ndarray,
    kv: np.ndarray,
    alpha: np.ndarray,
    shares: np.ndarray,
    exact: np.ndarray,
    buckets: np.ndarray,
    counts: np.ndarray,
) -> int:
    """Blend compute and KV shares per group and allocate, in one pass. Returns as
    _largest_remainder_sorted.

    The arithmetic follows the reference allocator operation by operation, (alpha x work) /
    sum then x total, so its shares come out bit for bit the same.
    """
    for group in range(totals.shape[0]):
        lo = offsets[group]
        hi = offsets[group + 1]
        total = totals[group]
        valid, compute_scale, compute_divisor, kv_scale, kv_divisor = _blend_scales(
            compute, kv, lo, hi, alpha[group]
        )
        if not valid:
            return _BAD_VALUE
        if total > 0 and compute_scale == 0.0 and kv_scale == 0.0:
            return group
        top_bucket = _bucket_count(hi - lo) - 1
        given = np.int64(0)
        # One scalar pass: on steps of a few dozen rows it beats a vectorised pass for the
        # exact shares and another for their floors, which mostly run their scalar tails.
        for i in range(lo, hi):
            exact[i] = (
                compute_scale * compute[i] / compute_divisor + kv_scale * kv[i] / kv_divisor
            ) * total
            given += _floor_row(exact[i], top_bucket, i, lo, shares, buckets)
        if not _give_leftover_units(total, given, lo, hi, exact, shares, buckets, counts):
            return group
    return -1


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _blend_parts_sorted(
    offsets: np.ndarray,
    compute: np.ndarray,
    kv: np.ndarray,
    alpha: np.ndarray,
    compute_part: np.ndarray,
    kv_part: np.ndarray,
) -> None:
    for group in range(offsets.shape[0] - 1):
        lo = offsets[group]
        hi = offsets[group + 1]
        _, compute_scale, compute_divisor, kv_scale, kv_divisor = _blend_scales(
            compute, kv, lo, hi, alpha[group]
        )
        for i in range(lo, hi):
            compute_part[i] = compute_scale * compute[i] / compute_divisor
            kv_part[i] = kv_scale * kv[i] / kv_divisor


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _offsets_if_ordered(groups: np.ndarray, offsets: np.ndarray) -> bool:
    """Fill `offsets` (n_groups + 1) when groups are non-decreasing and in range; else False."""
    n_groups = offsets.shape[0] - 1
    n = groups.shape[0]
    offsets[:] = 0
    if n == 0:
        return True
    # Branch-free passes: the order check vectorises, and each row writes its group's end.
    ordered = (groups[0] >= 0) & (groups[n - 1] < n_groups)
    for i in range(1, n):
        ordered &= groups[i] >= groups[i - 1]
    if not ordered:
        return False
    for i in range(n):
        offsets[groups[i] + 1] = i + 1
    for group in range(1, n_groups + 1):
        offsets[group] = max(offsets[group], offsets[group - 1])
    return True


@dataclass(frozen=True)
class GroupedRows:
    """Rows laid out group after group: group g is rows `offsets[g]:offsets[g + 1]`.

    Callers that already hold their rows in group order (a `SlotBatch` of steps) pass this
    instead of a per-row group index, and the allocator reads the groups off it directly.
    """

    offsets: np.ndarray

    def __post_init__(self) -> None:
        offsets = self.offsets
        if (
            offsets.ndim != 1
            or offsets.shape[0] < 1
            or offsets[0] != 0
            or (np.diff(offsets) < 0).any()
        ):
            raise ValueError("group offsets must start at 0 and never decrease")

    @classmethod
    def of(cls, group_index: np.ndarray, n_groups: int) -> GroupedRows:
        """The layout of `group_index`, which must be non-decreasing within 0..n_groups-1."""
        offsets = np.empty(n_groups + 1, dtype=np.int64)
        if not _offsets_if_ordered(np.ascontiguousarray(group_index, dtype=np.int64), offsets):
            raise ValueError(f"group index must be non-decreasing within 0..{n_groups - 1}")
        return cls(offsets)

    @property
    def n_rows(self) -> int:
        """The number of rows over all groups."""
        return int(self.offsets[-1])

    @property
    def sizes(self) -> np.ndarray:
        """Each group's row count, in group order."""
        return np.diff(self.offsets)


def _layout(
    totals: np.ndarray, groups: np.ndarray | GroupedRows, arrays: dict[str, np.ndarray]
) -> tuple[np.ndarray | None, np.ndarray]:
    """Check shapes and totals; returns (permutation to group order or None when already
    ordered, group offsets in that order)."""
    if (totals < 0).any():
        raise AllocationError(f"negative total in group {int(np.flatnonzero(totals < 0)[0])}")
    if isinstance(groups, GroupedRows):
        n_rows, offsets = groups.n_rows, groups.offsets
        if offsets.shape[0] != totals.shape[0] + 1:
            raise AllocationError(
                f"{totals.shape[0]} totals for {offsets.shape[0] - 1} groups of rows"
            )
    else:
        groups = np.ascontiguousarray(groups, dtype=np.int64)
        n_rows, offsets = groups.shape[0], np.empty(totals.shape[0] + 1, dtype=np.int64)
    for name, values in arrays.items():
        if values.shape != (n_rows,):
            raise AllocationError(f"the groups have {n_rows} rows but {name} has {values.shape[0]}")
    if isinstance(groups, GroupedRows) or _offsets_if_ordered(groups, offsets):
        return None, offsets
    if groups.size and (groups.min() < 0 or groups.max() >= totals.shape[0]):
        raise AllocationError(f"group_index outside 0..{totals.shape[0] - 1}")
    permutation = np.argsort(groups, kind="stable")
    return permutation, np.searchsorted(groups[permutation], np.arange(totals.shape[0] + 1)).astype(
        np.int64
    )


def _raise_bad_value(arrays: dict[str, np.ndarray]) -> None:
    for name, values in arrays.items():
        bad = ~np.isfinite(values) | ~(values >= 0)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise AllocationError(
                f"row {row} has {name} {values[row]!r}; {name} must be finite and >= 0"
            )
    raise AllocationError("weights sum to infinity within a group")


def _unpermute(
    permutation: np.ndarray | None, first: np.ndarray, second: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    if permutation is None:
        return first, second
    restored = (np.empty_like(first), np.empty_like(second))
    restored[0][permutation] = first
    restored[1][permutation] = second
    return restored


def largest_remainder(
    totals_nano: np.ndarray, groups: np.ndarray | GroupedRows, weights: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Split each group's integer total `totals_nano[g]` among its rows by `weights`, exactly.

    `groups` gives each row's group: an index per row (rows of a group need not be adjacent;
    indices already in non-decreasing order skip a sort), or the `GroupedRows` layout of rows in
    group order. A row's exact share is total x weight / its group's weight sum; it gets the
    floor, and the units left over go to the largest remainders, to the row that comes first
    in the input on equal ones. Returns (integer shares, exact shares), one per row in input
    order: a group's shares sum to its total, each within one unit of its exact share, and a
    zero total gives zeros whatever the weights. An `AllocationError` for a negative total, a
    negative or non-finite weight, or a positive total whose rows all weigh nothing.

    Steps are split by `blend_and_allocate`, which blends compute and KV weights first; this
    split takes the weights as given (idle spread by usage, a compute charge over resources).
    """
    totals = np.ascontiguousarray(totals_nano, dtype=np.int64)
    row_weights = np.ascontiguousarray(weights, dtype=np.float64)
    permutation, offsets = _layout(totals, groups, {"weight": row_weights})
    shares = np.empty(row_weights.shape[0], dtype=np.int64)
    exact = np.empty(row_weights.shape[0], dtype=np.float64)
    sorted_weights = row_weights if permutation is None else row_weights[permutation]
    failed = _largest_remainder_sorted(
        totals, offsets, sorted_weights, shares, exact, *_scratch(offsets)
    )
    if failed == _BAD_VALUE:
        _raise_bad_value({"weight": row_weights})
    if failed >= 0:
        raise AllocationError(
            f"group {failed} has total {int(totals[failed])} but no row with a positive weight to carry it"
        )
    return _unpermute(permutation, shares, exact)


@dataclass(frozen=True)
class BlendedSplit:
    """Per row: the integer share and the exact real share it was rounded from.

    `parts()` gives each row's two weight parts for the compute/KV breakdown; the split keeps
    what it needs to compute them, as that takes a second pass the allocation does not need.
    """

    shares: np.ndarray
    exact: np.ndarray
    _permutation: np.ndarray | None = field(repr=False)
    _offsets: np.ndarray = field(repr=False)
    _compute: np.ndarray = field(repr=False)
    _kv: np.ndarray = field(repr=False)
    _alpha: np.ndarray = field(repr=False)

    def parts(self) -> tuple[np.ndarray, np.ndarray]:
        """(alpha x each row's share of its group's compute work, (1 - alpha) x its share of
        the group's KV blocks), with the allocation's per-group alpha rules; they sum to the
        row's weight, exact / total."""
        compute_part, kv_part = np.empty_like(self._compute), np.empty_like(self._kv)
        _blend_parts_sorted(
            self._offsets, self._compute, self._kv, self._alpha, compute_part, kv_part
        )
        return _unpermute(self._permutation, compute_part, kv_part)


def blend_and_allocate(
    totals: np.ndarray,
    groups: np.ndarray | GroupedRows,
    compute_work: np.ndarray,
    kv_weight: np.ndarray,
    alpha: float | np.ndarray,
) -> BlendedSplit:
    """Weight each row alpha x compute share + (1 - alpha) x KV share within its group, then
    split the group's total by largest remainder.

    `groups` is as for `largest_remainder`; `alpha` is one value or one per group. A group
    without KV blocks is split on compute alone, one without compute work (holders only) on KV
    alone; a group with a positive total and neither is an error.
    """
    totals = np.ascontiguousarray(totals, dtype=np.int64)
    compute = np.ascontiguousarray(compute_work, dtype=np.float64)
    kv = np.ascontiguousarray(kv_weight, dtype=np.float64)
    checked = {"compute work": compute, "KV weight": kv}
    permutation, offsets = _layout(totals, groups, checked)
    group_alpha = np.ascontiguousarray(
        np.broadcast_to(np.asarray(alpha, dtype=np.float64), totals.shape)
    )
    if ((group_alpha < 0) | (group_alpha > 1)).any():
        raise AllocationError("alpha must lie in [0, 1]")
    if permutation is not None:
        compute, kv = compute[permutation], kv[permutation]
    shares, exact = np.empty(compute.shape[0], dtype=np.int64), np.empty(compute.shape[0])
    failed = _blend_allocate_sorted(
        totals, offsets, compute, kv, group_alpha, shares, exact, *_scratch(offsets)
    )
    if failed == _BAD_VALUE:
        _raise_bad_value(checked)
    if failed >= 0:
        raise AllocationError(
            f"group {failed} has total {int(totals[failed])} but no row with compute work or KV blocks to carry it"
        )
    shares, exact = _unpermute(permutation, shares, exact)
    return BlendedSplit(shares, exact, permutation, offsets, compute, kv, group_alpha)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _split_compute_kv(
    amount: np.ndarray, compute_part: np.ndarray, kv_part: np.ndarray, compute: np.ndarray
) -> None:
    for i in range(amount.shape[0]):
        both = compute_part[i] + kv_part[i]
        share = (
            np.int64(np.floor(amount[i] * (compute_part[i] / both) + 0.5))
            if both > 0.0
            else amount[i]
        )
        compute[i] = min(share, amount[i])


def split_compute_kv(
    amount_nano: np.ndarray, compute_part: np.ndarray, kv_part: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Split each row's integer amount into (compute, KV) by its two weight parts.

    compute = round-half-up(amount x compute/(compute + kv)); kv = amount - compute, so the two
    always sum to the row's amount.
    """
    amount = np.ascontiguousarray(amount_nano, dtype=np.int64)
    compute = np.empty_like(amount)
    _split_compute_kv(
        amount,
        np.ascontiguousarray(compute_part, dtype=np.float64),
        np.ascontiguousarray(kv_part, dtype=np.float64),
        compute,
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
    """What the reference allocator reads of a slot: its request, the tokens it adds, the context
    it attends to and the KV blocks it holds."""

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
    explanation path; `blend_and_allocate` is the production one and gives the same shares.
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
        compute_weight * c / compute_sum
        + ((1 - compute_weight) * s.kv_blocks / kv_sum if kv_sum > 0 else 0.0)
        for c, s in zip(compute, slots, strict=False)
    ]
    raw = [w * total for w in weights]
    floors = [int(x) for x in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - floors[i], reverse=True)
    for i in order[: total - sum(floors)]:
        floors[i] += 1
    if sum(floors) != total:
        raise AllocationError(
            f"step of {total} units: rounding left {total - sum(floors)} units unassigned"
        )
    return {s.request_id: amount for s, amount in zip(slots, floors, strict=False)}
