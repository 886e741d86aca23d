"""Per-request totals of an hour's allocated rows, accumulated a batch of steps at a time.

Rows are added in the order a group-by over the hour's rows (all slot rows in step order,
then all holder rows) would see them, so the totals do not depend on how the hour is cut
into batches: integer totals are exact whatever the order, and the two real-valued audit
totals are compensated (Kahan) sums in row order, the summation polars' group-by uses.
"""

from __future__ import annotations

import numba
import numpy as np
import polars as pl

from pipeline.attribution.layout import RowLayout

# Integer totals per request, in this column order.
INTEGER_TOTALS = (
    "compute_nano",
    "kv_nano",
    "amount_nano",
    "steps",
    "new_tokens",
    "cached_tokens",
    "output_tokens",
    "prefill_tokens",
    "prefill_compute_nano",
    "prompt_tokens",  # the largest logged
    "rows",  # slot and holder rows in the hour: a request without any is not in the hour
)
REAL_TOTALS = ("exact_nano", "kv_block_seconds")
(
    _COMPUTE,
    _KV,
    _AMOUNT,
    _STEPS,
    _NEW,
    _CACHED,
    _OUTPUT,
    _PREFILL,
    _PREFILL_COMPUTE,
    _PROMPT,
    _ROWS,
) = range(len(INTEGER_TOTALS))


@numba.njit(cache=True, nogil=True, inline="always")
def _compensated_add(
    sums: np.ndarray, compensation: np.ndarray, k: int, column: int, value: float
) -> None:
    corrected = value - compensation[k, column]
    total = sums[k, column] + corrected
    compensation[k, column] = (total - sums[k, column]) - corrected
    sums[k, column] = total


@numba.njit(cache=True, nogil=True)
def _add_amounts(
    request: np.ndarray,
    amount: np.ndarray,
    compute: np.ndarray,
    exact: np.ndarray,
    block_seconds: np.ndarray,
    integers: np.ndarray,
    sums: np.ndarray,
    compensation: np.ndarray,
) -> None:
    for i in range(request.shape[0]):
        k = request[i]
        integers[k, _COMPUTE] += compute[i]
        integers[k, _KV] += amount[i] - compute[i]
        integers[k, _AMOUNT] += amount[i]
        integers[k, _ROWS] += 1
        _compensated_add(sums, compensation, k, 0, exact[i])
        _compensated_add(sums, compensation, k, 1, block_seconds[i])


@numba.njit(cache=True, nogil=True)
def _add_slot_tokens(
    request: np.ndarray,
    compute: np.ndarray,
    new_tokens: np.ndarray,
    context_tokens: np.ndarray,
    prompt_tokens: np.ndarray,
    prefix_hit_tokens: np.ndarray,
    spec_drafted: np.ndarray,
    spec_accepted: np.ndarray,
    integers: np.ndarray,
) -> None:
    for i in range(request.shape[0]):
        k = request[i]
        new = np.int64(new_tokens[i])
        context = np.int64(context_tokens[i])
        prompt = np.int64(prompt_tokens[i])
        integers[k, _STEPS] += 1
        integers[k, _NEW] += new
        integers[k, _CACHED] += prefix_hit_tokens[i]
        integers[k, _PROMPT] = max(integers[k, _PROMPT], prompt)
        # A slot produces output when its verified tokens reach the end of the prompt: one
        # sampled token plus the accepted drafts (a chunk still inside the prompt produces none).
        if context + new - spec_drafted[i] >= prompt:
            integers[k, _OUTPUT] += 1 + np.int64(spec_accepted[i])
        if context < prompt:
            integers[k, _PREFILL] += new
            integers[k, _PREFILL_COMPUTE] += compute[i]


@numba.njit(cache=True, nogil=True)
def _add_work(
    request: np.ndarray, work: np.ndarray, sums: np.ndarray, compensation: np.ndarray
) -> None:
    for i in range(request.shape[0]):
        for r in range(work.shape[1]):
            _compensated_add(sums, compensation, request[i], r, work[i, r])


class RequestTotals:
    """Running per-request totals over requests coded 0..n_requests-1; with `resources`, also
    each request's slots' work on each of that many resources."""

    def __init__(self, n_requests: int, resources: int = 0) -> None:
        self.integers = np.zeros((n_requests, len(INTEGER_TOTALS)), dtype=np.int64)
        self.sums = np.zeros((n_requests, len(REAL_TOTALS)))
        self.compensation = np.zeros((n_requests, len(REAL_TOTALS)))
        self.work = np.zeros((n_requests, resources))
        self.work_compensation = np.zeros((n_requests, resources))

    def add_rows(
        self,
        request: np.ndarray,
        amount: np.ndarray,
        compute: np.ndarray,
        exact: np.ndarray,
        block_seconds: np.ndarray,
    ) -> None:
        """Add allocated rows: integer amount, its compute part, exact share, block-seconds."""
        _add_amounts(
            request,
            amount,
            compute,
            exact,
            block_seconds,
            self.integers,
            self.sums,
            self.compensation,
        )

    def add_slot_tokens(
        self, request: np.ndarray, compute: np.ndarray, slots: dict[str, np.ndarray]
    ) -> None:
        """Add slot rows' token counts (`slots` holds the SLOTS token columns)."""
        _add_slot_tokens(
            request,
            compute,
            slots["new_tokens"],
            slots["context_tokens"],
            slots["prompt_tokens"],
            slots["prefix_hit_tokens"],
            slots["spec_drafted"],
            slots["spec_accepted"],
            self.integers,
        )

    def add_slot_work(self, request: np.ndarray, work: np.ndarray) -> None:
        """Add slot rows' work on each resource (`work`: rows x resources)."""
        _add_work(request, work, self.work, self.work_compensation)

    def work_frame(self, request_ids: pl.Series, columns: list[str]) -> pl.DataFrame:
        """One row per request with a slot row in the hour: request_id and its work on each
        resource, in `columns`."""
        present = self.integers[:, _STEPS] > 0
        return pl.DataFrame(
            {"request_id": request_ids.filter(pl.Series(present))}
            | {name: self.work[present, j] for j, name in enumerate(columns)}
        )

    def frame(self, request_ids: pl.Series) -> pl.DataFrame:
        """One row per request with a row in the hour: request_id, the integer totals (Int64)
        and the real ones (Float64)."""
        present = self.integers[:, _ROWS] > 0
        columns = {"request_id": request_ids.filter(pl.Series(present))}
        columns |= {name: self.integers[present, j] for j, name in enumerate(INTEGER_TOTALS[:-1])}
        columns |= {name: self.sums[present, j] for j, name in enumerate(REAL_TOTALS)}
        return pl.DataFrame(columns)


@numba.njit(cache=True, nogil=True)
def _largest_of_rows(
    request: np.ndarray, step: np.ndarray, values: np.ndarray, out: np.ndarray
) -> None:
    for i in range(request.shape[0]):
        if step[i] >= 0:
            out[request[i]] = max(out[request[i]], values[i])


def largest_per_request(layout: RowLayout, values: np.ndarray, n_requests: int) -> np.ndarray:
    """Per request code, the largest of `values` (one per input row) over its rows in the hour;
    the int64 minimum for a request without any."""
    out = np.full(n_requests, np.iinfo(np.int64).min, dtype=np.int64)
    _largest_of_rows(layout.request, layout.step, values, out)
    return out
