"""Inclusive ranges of sequence numbers: the algebra the sequence and conservation checks
need to say which steps are missing, dropped, damaged or repeated, and how to list them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

SeqRange = tuple[int, int]  # inclusive first, last
# Ranges listed in a detail before the rest is summarised as a count.
RANGES_LISTED = 20


def compact_ranges(ranges: Sequence[SeqRange], limit: int = RANGES_LISTED) -> str:
    """ "1200-1299, 4000-4010, 5123"; beyond `limit` ranges the rest is counted, not listed."""
    shown = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges[:limit])
    if len(ranges) > limit:
        shown += f" and {len(ranges) - limit} more ranges"
    return shown


def count(ranges: Iterable[SeqRange]) -> int:
    """How many sequence numbers the ranges hold (counted twice where they overlap)."""
    return sum(b - a + 1 for a, b in ranges)


def merge(ranges: Iterable[SeqRange]) -> list[SeqRange]:
    """The ranges sorted, with overlapping and adjacent ones joined."""
    merged: list[SeqRange] = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def intersect(left: Sequence[SeqRange], right: Sequence[SeqRange]) -> list[SeqRange]:
    """Intersection of two sorted, merged range lists (two pointers: O(len(left) + len(right)))."""
    out: list[SeqRange] = []
    i = j = 0
    while i < len(left) and j < len(right):
        a, b = max(left[i][0], right[j][0]), min(left[i][1], right[j][1])
        if a <= b:
            out.append((a, b))
        if left[i][1] < right[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(left: Sequence[SeqRange], right: Sequence[SeqRange]) -> list[SeqRange]:
    """`left` minus `right`, both sorted and merged."""
    out: list[SeqRange] = []
    j = 0
    for a, b in left:
        while j < len(right) and right[j][1] < a:
            j += 1
        k, start = j, a
        while k < len(right) and right[k][0] <= b:
            if right[k][0] > start:
                out.append((start, right[k][0] - 1))
            start = max(start, right[k][1] + 1)
            k += 1
        if start <= b:
            out.append((start, b))
    return out


def runs(values: np.ndarray) -> list[SeqRange]:
    """Sorted distinct integers as maximal consecutive runs."""
    if values.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(values) != 1)
    starts = np.concatenate(([0], breaks + 1))
    ends = np.concatenate((breaks, [values.size - 1]))
    return [(int(values[s]), int(values[e])) for s, e in zip(starts, ends, strict=True)]
