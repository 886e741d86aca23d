"""Provisional prices of newly closed segments, by the hourly path's own attribution.

Each batch of new steps is attributed with `attribute_hour` for every hour its steps touch, so
every step is priced by the same kernel, weights and integer allocator as the hourly ledger.
Steps are independent, so a step priced now gets the same share it gets in the hour's ledger,
but for what depends on the whole hour: an alpha from the hour's admission-blocked steps, the
prefix-cache terms of requests spanning batches, and context that arrives later. Only usage
is kept: idle and headroom are known when the hour closes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import polars as pl

from pipeline.attribution.hour import attribute_hour
from pipeline.attribution.workmodel import WeightSource
from schemas.config import Pool
from schemas.units import HOUR_NS, hour_at

# Said beside every provisional figure, wherever it is shown.
PROVISIONAL_NOTE = (
    "provisional: usage priced from the segments closed so far; idle and headroom are not "
    "included (known when the hour closes) and the hourly ledger supersedes these figures"
)
# The ledger line kinds a request's charge can be on: what provisional figures hold.
USAGE_KINDS = ("usage", "unattributed", "platform_retry")


@dataclass(frozen=True)
class ProvisionalPrices:
    """One batch's provisional figures: request rows (`provisional_request_costs` without
    batch_id and priced_at) and usage lines (`provisional_lines` without them)."""

    request_costs: pl.DataFrame
    lines: pl.DataFrame

    @property
    def amount_nano(self) -> int:
        return int(self.lines["amount_nano"].sum()) if self.lines.height else 0


def hours_touched(steps: pl.DataFrame) -> list[datetime]:
    """The UTC hours the steps run in, oldest first."""
    if not steps.height:
        return []
    first = int(steps["start_utc_ns"].min()) // HOUR_NS  # type: ignore[arg-type]
    # A step ending exactly on the hour runs in none of the next.
    last = (int(steps["end_utc_ns"].max()) - 1) // HOUR_NS  # type: ignore[arg-type]
    return [hour_at(index) for index in range(first, max(first, last) + 1)]


def _last_step_ends(steps: pl.DataFrame, slots: pl.DataFrame) -> pl.DataFrame:
    """Per request, the UTC end of the last step it had a slot in."""
    return (
        slots.select("replica", "seq", "request_id")
        .join(steps.select("replica", "seq", "end_utc_ns"), on=["replica", "seq"])
        .group_by("request_id")
        .agg(pl.col("end_utc_ns").max().alias("last_step_end_utc_ns"))
    )


def price_steps(
    pool: Pool,
    steps: pl.DataFrame,
    slots: pl.DataFrame,
    holders: pl.DataFrame,
    context: pl.DataFrame,
    weights: WeightSource,
) -> ProvisionalPrices:
    """Provisional figures of a batch of one pool's steps (schemas.tables STEPS, SLOTS,
    HOLDERS as frames), with the gateway context known so far."""
    last_ends = _last_step_ends(steps, slots)
    batch_end = int(steps["end_utc_ns"].max()) if steps.height else 0  # type: ignore[arg-type]
    costs, lines = [], []
    for hour in hours_touched(steps):
        ledger = attribute_hour(hour, pool, steps, slots, holders, context, weights).ledger
        # A request that only held blocks in the batch is as fresh as the batch's last step.
        costs.append(
            ledger.request_costs.join(last_ends, on="request_id", how="left").with_columns(
                pl.col("last_step_end_utc_ns").fill_null(pl.lit(batch_end, dtype=pl.Int64))
            )
        )
        lines.append(
            ledger.ledger_lines.filter(pl.col("line_kind").is_in(USAGE_KINDS)).drop("requests")
        )
    if not costs:
        return ProvisionalPrices(pl.DataFrame(), pl.DataFrame())
    return ProvisionalPrices(pl.concat(costs), pl.concat(lines))
