"""Partitions: one per UTC hour and pool. Pool names come from the pools file when the
definitions are built, never at import."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta

import dagster as dg

# The first hour Dagster offers; earlier hours can still be run with `stepledger run`.
FIRST_HOUR_ENV = "STEPLEDGER_FIRST_HOUR"
DEFAULT_FIRST_HOUR = "2026-11-01T00"


def first_hour() -> datetime:
    value = os.environ.get(FIRST_HOUR_ENV, DEFAULT_FIRST_HOUR)
    try:
        return datetime.strptime(value, "%Y-%m-%dT%H").replace(tzinfo=UTC)
    except ValueError as err:
        raise ValueError(f"{FIRST_HOUR_ENV}={value!r} is not of the form YYYY-MM-DDTHH") from err


def pool_hour_partitions(pool_names: list[str]) -> dg.MultiPartitionsDefinition:
    hourly = dg.HourlyPartitionsDefinition(
        start_date=first_hour().strftime("%Y-%m-%d-%H:%M"), timezone="UTC"
    )
    return dg.MultiPartitionsDefinition(
        {"hour": hourly, "pool": dg.StaticPartitionsDefinition(pool_names)}
    )


def partition_key(hour: datetime, pool: str) -> dg.MultiPartitionKey:
    return dg.MultiPartitionKey(
        {"hour": hour.astimezone(UTC).strftime("%Y-%m-%d-%H:%M"), "pool": pool}
    )


def hour_and_pool(
    context: dg.AssetExecutionContext | dg.AssetCheckExecutionContext,
) -> tuple[datetime, str]:
    """The UTC hour and pool of the partition being materialized."""
    keys = context.partition_key.keys_by_dimension
    hour = datetime.strptime(keys["hour"], "%Y-%m-%d-%H:%M").replace(tzinfo=UTC)
    return hour, keys["pool"]


def completed_hour(now: datetime, delay: timedelta = timedelta(0)) -> datetime:
    """The latest hour that ended at least `delay` before `now`."""
    shifted = now.astimezone(UTC) - delay
    return shifted.replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
