"""Step cost from the clock: measured nanoseconds to integer nano-dollars within an hour.

Rounding, stated once: within an hour, instant `t` (ns after the hour starts) maps to the
cumulative amount M(t) = floor(t x P / H), where P is the replica's price per hour in
nano-dollars (GPUs per replica x price per GPU-hour) and H the hour in ns. A step costs
M(end) - M(start) of the part of it that lies in the hour. Consequences:
- each step's cost is within one nano-dollar of its exact real cost;
- a step crossing an hour boundary is split by time, and its two parts are its whole cost
  (there is no third rounding);
- a replica's step costs within an hour never exceed P, because non-overlapping steps map
  to non-overlapping money intervals; the rest of P is that replica's idle time.
"""

from __future__ import annotations

import numpy as np

from schemas.config import MAX_PRICE_PER_HOUR_NANO
from schemas.units import HOUR_NS

# t < 2**42 within an hour; splitting t = high * 2**20 + low keeps every product below 2**63.
_LOW_BITS = 20
assert MAX_PRICE_PER_HOUR_NANO == (1 << 63) // (HOUR_NS >> _LOW_BITS) // 2


def cumulative_nano(offset_ns: np.ndarray, price_per_hour_nano: int) -> np.ndarray:
    """floor(offset x price / HOUR_NS), exact in int64 for offsets in [0, HOUR_NS]."""
    if not 0 < price_per_hour_nano <= MAX_PRICE_PER_HOUR_NANO:
        raise ValueError(
            f"price per replica-hour {price_per_hour_nano} nano-dollars is outside 1..{MAX_PRICE_PER_HOUR_NANO}"
        )
    offset = np.asarray(offset_ns, dtype=np.int64)
    if offset.size and (offset.min() < 0 or offset.max() > HOUR_NS):
        raise ValueError("offsets must lie within the hour")
    high = offset >> _LOW_BITS
    low = offset & ((1 << _LOW_BITS) - 1)
    quotient, remainder = np.divmod(high * price_per_hour_nano, HOUR_NS)
    tail = (remainder << _LOW_BITS) + low * price_per_hour_nano
    cumulative: np.ndarray = (quotient << _LOW_BITS) + tail // HOUR_NS
    return cumulative


def step_costs_in_hour(
    start_utc_ns: np.ndarray,
    end_utc_ns: np.ndarray,
    hour_start_utc_ns: int,
    price_per_hour_nano: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(cost in nano-dollars, ns inside the hour) of each step's part that lies in the hour.

    Steps wholly outside the hour get zero for both.
    """
    start = np.clip(np.asarray(start_utc_ns, dtype=np.int64) - hour_start_utc_ns, 0, HOUR_NS)
    end = np.clip(np.asarray(end_utc_ns, dtype=np.int64) - hour_start_utc_ns, 0, HOUR_NS)
    end = np.maximum(end, start)
    cost = cumulative_nano(end, price_per_hour_nano) - cumulative_nano(start, price_per_hour_nano)
    return cost, end - start
