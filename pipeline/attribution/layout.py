"""Where an hour's slot and holder rows go: their step, their request, their processing order.

A pool-hour holds tens of millions of slot rows. Joining them to their steps (or copying them
to filter and sort) costs several copies of the table, so rows are instead mapped with a few
integer arrays: each row's hour step comes from a binary search of its (replica, seq) among
the logged steps sorted by replica then seq, each row's request is an integer code, and the
rows are processed in step order from the input itself (no copy when it is already in step
order, as the lake delivers it), a bounded number of steps at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import polars as pl

from pipeline.ahead import ordered_ahead
from schemas.errors import DataError

# Rows mapped per pass: bounds the transient copies of the key columns.
_LOOKUP_ROWS = 1 << 22


class AttributionError(DataError):
    """The hour's tables cannot be attributed; the message names the table, row and field."""


@dataclass(frozen=True)
class StepKeys:
    """Every logged step's (replica code, seq), sorted, with its hour step (-1: outside the hour).

    Replica codes index `replicas`; `offsets[code]:offsets[code + 1]` is that replica's range.
    """

    replicas: list[str]
    code: np.ndarray
    offsets: np.ndarray
    seq: np.ndarray
    step: np.ndarray

    @classmethod
    def build(
        cls, replicas: list[str], replica_code: np.ndarray, seq: np.ndarray, hour_step: np.ndarray
    ) -> StepKeys:
        """The keys of steps given per step in any order; `hour_step` is each one's hour step."""
        order = np.lexsort((seq, replica_code))
        code = replica_code[order]
        offsets = np.searchsorted(code, np.arange(len(replicas) + 1)).astype(np.int64)
        return cls(
            replicas,
            code,
            offsets,
            np.ascontiguousarray(seq[order]),
            np.ascontiguousarray(hour_step[order]),
        )

    def duplicate_in_hour(self) -> tuple[str, int] | None:
        """(replica, seq) of a step logged more than once with a copy in the hour, if any.

        Rows of such a step could not be told apart; copies wholly outside the hour are
        never attributed, so they do not matter.
        """
        repeated = np.flatnonzero(
            (self.seq[1:] == self.seq[:-1])
            & (self.code[1:] == self.code[:-1])
            & ((self.step[1:] >= 0) | (self.step[:-1] >= 0))
        )
        if not repeated.size:
            return None
        first = int(repeated[0])
        return self.replicas[int(self.code[first])], int(self.seq[first])


@numba.njit(cache=True, nogil=True)
def _lookup_steps(
    offsets: np.ndarray,
    key_seq: np.ndarray,
    key_step: np.ndarray,
    replica: np.ndarray,
    seq: np.ndarray,
    out: np.ndarray,
) -> tuple[int, int]:
    """out[i] = row i's hour step (-1 outside the hour); returns (rows of no logged step, first such row or -1)."""
    orphans = 0
    first_orphan = -1
    # Rows of one step are usually adjacent: reuse the previous search.
    last_replica = -1
    last_seq = 0
    last_step = -1
    for i in range(replica.shape[0]):
        code = replica[i]
        if code == last_replica and seq[i] == last_seq:
            out[i] = last_step
            continue
        found = -1
        if code >= 0:
            lo = offsets[code]
            hi = offsets[code + 1]
            j = lo + np.searchsorted(key_seq[lo:hi], seq[i])
            if j < hi and key_seq[j] == seq[i]:
                found = j
        if found < 0:
            out[i] = -1
            orphans += 1
            if first_orphan < 0:
                first_orphan = i
            last_replica = -1
            continue
        out[i] = key_step[found]
        last_replica, last_seq, last_step = code, seq[i], key_step[found]
    return orphans, first_orphan


@numba.njit(cache=True, nogil=True)
def _count_in_step_order(step: np.ndarray, position: np.ndarray, counts: np.ndarray) -> bool:
    """Count rows per hour step (rows with step -1 are skipped); True when the counted rows
    already come in (step, position) order."""
    ordered = True
    last_step = -1
    last_position = 0
    for i in range(step.shape[0]):
        s = step[i]
        if s < 0:
            continue
        counts[s] += 1
        if s < last_step or (s == last_step and position[i] <= last_position):
            ordered = False
        last_step = s
        last_position = position[i]
    return ordered


@dataclass(frozen=True)
class RowLayout:
    """A slot or holder table's rows in processing order: by hour step, then position.

    `step` and `request` are per input row (step -1: outside the hour, not processed);
    `offsets[s]:offsets[s + 1]` are step s's rows in processing order, and processing row k
    is input row `order[k]`, or input row k when `order` is None.
    """

    step: np.ndarray
    request: np.ndarray
    offsets: np.ndarray
    order: np.ndarray | None

    def rows(self, first_step: int, end_step: int) -> slice | np.ndarray:
        """The input rows of steps first_step..end_step-1, in processing order."""
        lo, hi = int(self.offsets[first_step]), int(self.offsets[end_step])
        return slice(lo, hi) if self.order is None else self.order[lo:hi]


def lay_out_rows(
    table: pl.DataFrame, name: str, position: str, keys: StepKeys, n_steps: int, requests: pl.Series
) -> RowLayout:
    """Map the table's rows to hour steps and request codes (indices into `requests`, which
    holds every request id of the table) and find their processing order.

    Rows of no logged step, or missing a key, are an error naming the table and a row.
    """
    for column in ("replica", "seq", position, "request_id"):
        missing = table[column].null_count()
        if missing:
            raise AttributionError(f"{name}: {missing} row(s) have no {column}")
    n = table.height
    step = np.empty(n, dtype=np.int64)
    request = np.empty(n, dtype=np.int32)
    # An enum's codes are the strings' places in its categories: one hash per row, where a
    # mapping of strings to codes costs three times as much.
    replica_enum, request_enum = pl.Enum(keys.replicas), pl.Enum(requests)

    def map_rows(lo: int) -> tuple[int, int]:
        """Map rows lo.. (up to _LOOKUP_ROWS) into `step` and `request`; (orphans, first)."""
        part = table.slice(lo, _LOOKUP_ROWS)
        replica = (
            part["replica"]
            .cast(replica_enum, strict=False)
            .to_physical()
            .cast(pl.Int64)
            .fill_null(-1)
            .to_numpy()
        )
        request[lo : lo + part.height] = part["request_id"].cast(request_enum).to_physical()
        found, first = _lookup_steps(
            keys.offsets,
            keys.seq,
            keys.step,
            replica,
            part["seq"].to_numpy(),
            step[lo : lo + part.height],
        )
        return found, lo + first

    # Each part writes its own rows of `step` and `request`: parts are mapped side by side.
    mapped = list(ordered_ahead(map_rows, range(0, n, _LOOKUP_ROWS)))
    orphans = sum(found for found, _ in mapped)
    first_orphan = next((first for found, first in mapped if found), -1)
    if orphans:
        row = table.row(first_orphan, named=True)
        raise AttributionError(
            f"{name}: {orphans} row(s) belong to no logged step, e.g. replica {row['replica']} seq {row['seq']}"
        )
    counts = np.zeros(n_steps, dtype=np.int64)
    in_order = _count_in_step_order(step, table[position].to_numpy(), counts)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    order = None
    if not (in_order and offsets[-1] == n):
        order = np.flatnonzero(step >= 0)
        if not in_order:
            order = order[np.lexsort((table[position].to_numpy()[order], step[order]))]
    return RowLayout(step, request, offsets, order)


def gather(
    table: pl.DataFrame, columns: list[str], rows: slice | np.ndarray
) -> dict[str, np.ndarray]:
    """The columns of the given input rows as numpy arrays (copies of just those rows)."""
    part = table.select(columns)
    part = part.slice(rows.start, rows.stop - rows.start) if isinstance(rows, slice) else part[rows]
    return {name: part[name].to_numpy() for name in columns}
