"""What several checks read from the same frames: the pool's steps of the hour, a warehouse
table's rows of the hour, and durations as they are shown in a result."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import polars as pl

from schemas.config import Pool
from schemas.units import NS_PER_SECOND, hour_bounds_ns, to_warehouse


def steps_of_hour(steps: pl.DataFrame, hour: datetime, pool: Pool) -> pl.DataFrame:
    """The pool's steps placed in the hour by their UTC start, ordered by replica and seq."""
    start_ns, end_ns = hour_bounds_ns(hour)
    in_hour = steps.filter(
        (pl.col("pool") == pool.name)
        & pl.col("start_utc_ns").is_between(start_ns, end_ns, closed="left")
    )
    # The lake delivers them in that order: checking it costs a fifth of sorting.
    replica, seq = pl.col("replica"), pl.col("seq")
    ordered = in_hour.select(
        ((replica > replica.shift(1)) | ((replica == replica.shift(1)) & (seq > seq.shift(1))))
        .fill_null(True)
        .all()
    ).item()
    return in_hour if ordered else in_hour.sort("replica", "seq")


def rows_of_hour(frame: pl.DataFrame, hour: datetime, pool: str, table: str) -> pl.DataFrame:
    """A warehouse table's rows for one hour and pool; `hour` may be naive UTC or zoned."""
    for column in ("hour", "pool"):
        if column not in frame.columns:
            raise ValueError(f"{table}: no column {column!r} (columns: {frame.columns})")
    dtype = frame.schema["hour"]
    if not isinstance(dtype, pl.Datetime):
        raise ValueError(f"{table}.hour is {dtype}, expected a timestamp")
    moment = to_warehouse(hour) if dtype.time_zone is None else hour.astimezone(UTC)
    return frame.filter((pl.col("hour") == moment) & (pl.col("pool") == pool))


def seconds(ns: int) -> str:
    """A duration in nanoseconds as seconds with millisecond digits ("1.500 s")."""
    return f"{ns / NS_PER_SECOND:.3f} s"


def utc_clock(ns: int) -> str:
    """An instant in UTC nanoseconds as the time of day ("05:14:03.512")."""
    moment = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=ns // 1000)
    return moment.strftime("%H:%M:%S.%f")[:-3]
