"""UTC hours, the pipeline's unit of work: the one place that turns a datetime into an hour,
an hour into its key ('YYYY-MM-DDTHH', as lake partitions, gateway and DCGM files are named)
and into integer nanoseconds.

Every hour is an aware datetime on :00:00. A naive datetime is refused rather than read as
local or as UTC: the two readings differ by the machine's offset, and an hour read wrongly
bills the wrong hour. The warehouse stores hours as TIMESTAMP (no zone) holding UTC;
`from_warehouse` and `to_warehouse` are the only crossings.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

HOUR_NS = 3_600_000_000_000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_KEY_FORMAT = "%Y-%m-%dT%H"
# Dagster's hourly partition keys.
_DAGSTER_KEY_FORMAT = "%Y-%m-%d-%H:%M"


def utc_hour(hour: datetime) -> datetime:
    """`hour` as an aware UTC datetime; it must be aware and fall on :00:00."""
    if hour.tzinfo is None or hour.utcoffset() is None:
        raise ValueError(
            f"hour {hour.isoformat()} has no time zone; pass an aware UTC datetime "
            "(a warehouse TIMESTAMP goes through pipeline.hours.from_warehouse)"
        )
    hour = hour.astimezone(UTC)
    if (hour.minute, hour.second, hour.microsecond) != (0, 0, 0):
        raise ValueError(f"{hour.isoformat()} is not the start of an hour")
    return hour


def hour_key(hour: datetime) -> str:
    """'YYYY-MM-DDTHH' of a UTC hour."""
    return utc_hour(hour).strftime(_KEY_FORMAT)


def parse_hour_key(key: str) -> datetime:
    """The UTC hour of 'YYYY-MM-DDTHH' (also accepts Dagster's 'YYYY-MM-DD-HH:MM')."""
    for fmt in (_KEY_FORMAT, _DAGSTER_KEY_FORMAT):
        try:
            return utc_hour(datetime.strptime(key, fmt).replace(tzinfo=UTC))
        except ValueError:
            continue
    raise ValueError(f"hour {key!r} is not of the form YYYY-MM-DDTHH")


def hour_start_ns(hour: datetime) -> int:
    """The hour's start as UTC epoch nanoseconds (exact: no float on the way)."""
    return (utc_hour(hour) - _EPOCH) // timedelta(microseconds=1) * 1_000


def hour_bounds_ns(hour: datetime) -> tuple[int, int]:
    """[start, end) of a UTC hour in epoch nanoseconds."""
    start_ns = hour_start_ns(hour)
    return start_ns, start_ns + HOUR_NS


def to_warehouse(hour: datetime) -> datetime:
    """The naive datetime holding UTC that the warehouse's TIMESTAMP columns store."""
    return utc_hour(hour).replace(tzinfo=None)


def from_warehouse(stored: datetime) -> datetime:
    """A warehouse TIMESTAMP (naive, holding UTC) as an aware UTC hour."""
    if stored.tzinfo is not None:
        raise ValueError(f"{stored.isoformat()} is aware; warehouse hours are naive UTC")
    return utc_hour(stored.replace(tzinfo=UTC))


def parse_range_bound(text: str, *, end: bool) -> datetime:
    """One bound of an inclusive UTC range: a month 'YYYY-MM', a day 'YYYY-MM-DD' or an hour
    (a key, as `parse_hour_key` reads). `end`: the hour after the period (the range is read
    as [start, end)), so `--to 2026-11-30` covers the whole day."""
    for fmt, step in (("%Y-%m", None), ("%Y-%m-%d", timedelta(days=1))):
        try:
            start = datetime.strptime(text, fmt).replace(tzinfo=UTC)
        except ValueError:
            continue
        if not end:
            return start
        if step is None:  # the first hour of the next month
            return (start + timedelta(days=32)).replace(day=1)
        return start + step
    try:
        hour = parse_hour_key(text)
    except ValueError:
        raise ValueError(
            f"{text!r} is no month (YYYY-MM), day (YYYY-MM-DD) or hour (YYYY-MM-DDTHH)"
        ) from None
    return hour + timedelta(hours=1) if end else hour
