"""The project's units, each with one home: integer nano-dollars and integer nanoseconds as
named types, the one place dollars become nano-dollars (and back), UTC hours (the pipeline's
unit of work) with their keys, and the one place an instant crosses into or out of the
warehouse.

Money is whole nano-dollars and time whole nanoseconds, in int64; dollars enter as `Decimal`
(never float), so a price is either exact in nano-dollars or refused. This module lives in
`schemas/`, the lowest layer both the pools file (`schemas.config`, which prices pools) and
`pipeline/` may import, and needs the standard library only.

Every hour is an aware datetime on :00:00, its key 'YYYY-MM-DDTHH' (as lake partitions,
gateway and DCGM files are named). A naive datetime is refused rather than read as local or as
UTC: the two readings differ by the machine's offset, and an hour read wrongly bills the wrong
hour. The warehouse stores instants as TIMESTAMP (no zone) holding UTC; `to_warehouse`,
`instant_to_warehouse` and `from_warehouse` are the only crossings.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Final, NewType

NanoUSD = NewType("NanoUSD", int)
"""An amount of money in whole nano-dollars (1e-9 USD)."""
Nanos = NewType("Nanos", int)
"""A duration or a UTC epoch instant in whole nanoseconds."""

NANO_PER_USD: Final = 1_000_000_000
# The allocator's explanation also counts in micro-dollars.
MICRO_PER_USD: Final = 1_000_000
NS_PER_SECOND: Final = 1_000_000_000
NS_PER_MS: Final = 1_000_000
MS_PER_HOUR: Final = 3_600_000
HOUR_NS: Final = Nanos(3_600 * NS_PER_SECOND)

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_KEY_FORMAT = "%Y-%m-%dT%H"
# Dagster's hourly partition keys.
_DAGSTER_KEY_FORMAT = "%Y-%m-%d-%H:%M"


def nano_of_usd(usd: Decimal) -> Decimal:
    """`usd` dollars in nano-dollars, exactly: a fraction of a nano-dollar stays visible, for
    a caller that refuses a price it could only bill rounded."""
    return usd.scaleb(9)


def usd_to_nano(usd: Decimal) -> NanoUSD:
    """`usd` dollars as whole nano-dollars; a value with a fraction of a nano-dollar is refused."""
    nano = nano_of_usd(usd)
    if nano != nano.to_integral_value():
        raise ValueError(f"{usd:f} USD is not a whole number of nano-dollars")
    return NanoUSD(int(nano))


def nano_to_usd(nano: int) -> Decimal:
    """Whole nano-dollars as exact dollars."""
    return Decimal(int(nano)).scaleb(-9)


def utc_hour(hour: datetime) -> datetime:
    """`hour` as an aware UTC datetime; it must be aware and fall on :00:00."""
    if hour.tzinfo is None or hour.utcoffset() is None:
        raise ValueError(
            f"hour {hour.isoformat()} has no time zone; pass an aware UTC datetime "
            "(a warehouse TIMESTAMP goes through schemas.units.from_warehouse)"
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


def hour_at(index: int) -> datetime:
    """The UTC hour `index` hours after the epoch (an instant's index is `ns // HOUR_NS`)."""
    return _EPOCH + timedelta(hours=index)


def hour_start_ns(hour: datetime) -> Nanos:
    """The hour's start as UTC epoch nanoseconds (exact: no float on the way)."""
    return Nanos((utc_hour(hour) - _EPOCH) // timedelta(microseconds=1) * 1_000)


def hour_bounds_ns(hour: datetime) -> tuple[Nanos, Nanos]:
    """[start, end) of a UTC hour in epoch nanoseconds."""
    start_ns = hour_start_ns(hour)
    return start_ns, Nanos(start_ns + HOUR_NS)


def to_warehouse(hour: datetime) -> datetime:
    """The naive datetime holding UTC that the warehouse's TIMESTAMP columns store for an hour."""
    return instant_to_warehouse(utc_hour(hour))


def instant_to_warehouse(moment: datetime) -> datetime:
    """Any aware instant as the naive datetime holding UTC that a TIMESTAMP column stores (not
    only hours: a scope's ends, when an alert was raised)."""
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ValueError(f"{moment.isoformat()} has no time zone; pass an aware datetime")
    return moment.astimezone(UTC).replace(tzinfo=None)


def warehouse_now() -> datetime:
    """Now, as a TIMESTAMP column stores it."""
    return instant_to_warehouse(datetime.now(UTC))


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
