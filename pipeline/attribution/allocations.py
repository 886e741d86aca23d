"""The per-step allocation rows of chosen requests, kept while their hour is billed.

`attribute_hour(..., allocations_of=...)` hands each allocated batch of steps to
`AllocationRows`, which keeps the rows of the chosen requests (or of every request, "all"):
the very shares the hour's request costs are summed from, so what `stepledger explain` shows
is what was billed, not a second computation of it. With nothing chosen it keeps nothing and
the billing does no extra work.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

import numpy as np
import polars as pl

# Requests to keep the allocation rows of: their ids, or "all" of the hour's.
RequestSelection = Collection[str] | Literal["all"]

# One row per (request, step, role): `step` numbers the hour's steps in the attribution's order
# (replica, start, seq); `role` is "slot" or the holder's state; `cost_nano`, `busy_ns` are the
# step's part inside the hour; `share_nano` = `compute_nano` + `kv_nano` is the row's integer
# share of the step; `work` and `kv_blocks` are the row's compute and KV weights, `step_work`
# and `step_kv_blocks` the step's totals of them; `kv_block_seconds` = kv_blocks x busy time.
ALLOCATION_SCHEMA = pl.Schema(
    {
        "request_id": pl.String(),
        "step": pl.Int64(),
        "replica": pl.String(),
        "seq": pl.Int64(),
        "role": pl.String(),
        "cost_nano": pl.Int64(),
        "busy_ns": pl.Int64(),
        "share_nano": pl.Int64(),
        "compute_nano": pl.Int64(),
        "kv_nano": pl.Int64(),
        "work": pl.Float64(),
        "step_work": pl.Float64(),
        "kv_blocks": pl.Float64(),
        "step_kv_blocks": pl.Float64(),
        "kv_block_seconds": pl.Float64(),
    }
)
# The columns `AllocationRows.add` takes per row, besides the request's code.
ROW_COLUMNS = tuple(c for c in ALLOCATION_SCHEMA if c not in ("request_id", "replica", "seq"))


class AllocationRows:
    """The allocation rows of the chosen requests among `request_ids` (the hour's request
    codes index it), gathered batch by batch."""

    def __init__(self, chosen: RequestSelection, request_ids: pl.Series) -> None:
        self.request_ids = request_ids
        self.chosen: np.ndarray | None = None
        if isinstance(chosen, str):
            if chosen != "all":
                raise ValueError(
                    f'allocations_of: a collection of request ids or "all", not {chosen!r}'
                )
            self.chosen = np.ones(len(request_ids), dtype=bool)
        elif chosen:
            self.chosen = request_ids.is_in(list(chosen)).to_numpy()
        self.parts: list[dict[str, np.ndarray]] = []

    @property
    def wanted(self) -> bool:
        """Whether any request is chosen: without, the caller need not gather a batch's rows."""
        return self.chosen is not None

    def add(self, row_request: np.ndarray, columns: dict[str, np.ndarray]) -> None:
        """Keep the chosen requests' rows of a batch: each row's request code and ROW_COLUMNS."""
        if self.chosen is None:
            return
        keep = self.chosen[row_request]
        if keep.any():
            self.parts.append(
                {"request": row_request[keep]} | {c: columns[c][keep] for c in ROW_COLUMNS}
            )

    def frame(self, hour_steps: pl.DataFrame) -> pl.DataFrame:
        """The kept rows (ALLOCATION_SCHEMA), by request, step and role; `hour_steps` names the
        steps (replica, seq) by their number in the hour."""
        if not self.parts:
            return pl.DataFrame(schema=ALLOCATION_SCHEMA)
        rows = {c: np.concatenate([p[c] for p in self.parts]) for c in self.parts[0]}
        step = pl.Series(rows["step"])
        return (
            pl.DataFrame(
                {
                    "request_id": self.request_ids.gather(rows.pop("request")),
                    "replica": hour_steps["replica"].gather(step),
                    "seq": hour_steps["seq"].gather(step),
                }
                | {c: pl.Series(c, rows[c]) for c in ROW_COLUMNS}
            )
            .select(pl.col(c).cast(t) for c, t in ALLOCATION_SCHEMA.items())
            .sort("request_id", "step", "role", maintain_order=True)
        )
