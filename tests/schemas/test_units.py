from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.units import (
    HOUR_NS,
    from_warehouse,
    hour_at,
    hour_bounds_ns,
    hour_key,
    hour_start_ns,
    instant_to_warehouse,
    nano_of_usd,
    nano_to_usd,
    parse_hour_key,
    to_warehouse,
    usd_to_nano,
    utc_hour,
)
from tests.helpers.hours import HOUR

hours = st.integers(0, 200_000).map(lambda n: datetime(2000, 1, 1, tzinfo=UTC) + timedelta(hours=n))
offsets = st.integers(-12 * 60, 14 * 60).map(lambda m: timezone(timedelta(minutes=m)))


def test_an_hour_has_its_key_and_epoch_nanoseconds():
    assert hour_key(HOUR) == "2026-11-30T05"
    assert hour_start_ns(HOUR) == 1_796_014_800 * 10**9
    assert hour_bounds_ns(HOUR) == (1_796_014_800 * 10**9, 1_796_018_400 * 10**9)


@given(hours, offsets)
def test_the_same_instant_in_any_zone_is_the_same_hour(hour, zone):
    shown = hour.astimezone(zone)
    assert hour_key(shown) == hour_key(hour)
    assert hour_start_ns(shown) == hour_start_ns(hour) == int(hour.timestamp()) * 10**9
    assert utc_hour(shown).tzinfo is UTC


@given(hours)
def test_keys_and_warehouse_timestamps_round_trip(hour):
    assert parse_hour_key(hour_key(hour)) == hour
    assert from_warehouse(to_warehouse(hour)) == hour
    start, end = hour_bounds_ns(hour)
    assert end - start == HOUR_NS


@given(hours)
def test_consecutive_hours_are_an_hour_of_nanoseconds_apart(hour):
    assert hour_start_ns(hour + timedelta(hours=1)) - hour_start_ns(hour) == HOUR_NS
    assert hour_key(hour + timedelta(hours=1)) > hour_key(hour)


@pytest.mark.parametrize(
    "function", [utc_hour, hour_key, hour_start_ns, hour_bounds_ns, to_warehouse]
)
def test_a_naive_datetime_is_refused_not_guessed(function):
    with pytest.raises(ValueError, match="has no time zone; pass an aware UTC datetime"):
        function(datetime(2026, 11, 30, 5))


@given(hours, st.integers(1, 3599 * 10**6))
def test_an_instant_inside_an_hour_is_not_an_hour(hour, microseconds):
    with pytest.raises(ValueError, match="is not the start of an hour"):
        hour_key(hour + timedelta(microseconds=microseconds))


def test_dagster_partition_keys_parse_and_other_forms_are_refused():
    assert parse_hour_key("2026-11-30-05:00") == HOUR
    for text in ("2026-11-30 05", "2026-11-30-05:30", "2026-11-30T5x"):
        with pytest.raises(ValueError, match="is not of the form YYYY-MM-DDTHH"):
            parse_hour_key(text)


def test_an_aware_warehouse_timestamp_is_refused():
    with pytest.raises(ValueError, match="warehouse hours are naive UTC"):
        from_warehouse(HOUR)


def test_dollars_become_whole_nano_dollars_exactly():
    assert usd_to_nano(Decimal("3.60")) == 3_600_000_000
    assert usd_to_nano(Decimal("0.000000001")) == 1
    assert usd_to_nano(Decimal("-12.5")) == -12_500_000_000
    # 2**63 - 1 nano-dollars, beyond a float's 53 bits of mantissa.
    assert usd_to_nano(Decimal("9223372036.854775807")) == 9_223_372_036_854_775_807


def test_a_fraction_of_a_nano_dollar_is_refused_not_rounded():
    assert nano_of_usd(Decimal("0.0000000015")) == Decimal("1.5")
    with pytest.raises(
        ValueError, match=r"0\.0000000015 USD is not a whole number of nano-dollars"
    ):
        usd_to_nano(Decimal("0.0000000015"))


@given(st.integers(-(2**63), 2**63 - 1))
def test_nano_dollars_round_trip_through_exact_dollars(nano):
    dollars = nano_to_usd(nano)
    assert dollars * 10**9 == nano
    assert usd_to_nano(dollars) == nano


@given(hours, offsets, st.integers(0, HOUR_NS // 1000 - 1))
def test_an_instant_enters_the_warehouse_as_naive_utc(hour, zone, microseconds):
    moment = (hour + timedelta(microseconds=microseconds)).astimezone(zone)
    stored = instant_to_warehouse(moment)
    assert stored.tzinfo is None
    assert stored - datetime(1970, 1, 1) == moment - datetime(1970, 1, 1, tzinfo=UTC)


def test_a_naive_instant_is_refused_at_the_warehouse():
    with pytest.raises(ValueError, match="has no time zone"):
        instant_to_warehouse(datetime(2026, 11, 30, 5, 30))


@given(st.integers(0, 2_000_000))
def test_an_hour_index_counts_hours_from_the_epoch(index):
    assert hour_start_ns(hour_at(index)) == index * 3_600 * 10**9
