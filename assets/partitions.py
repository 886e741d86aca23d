"""Partitions: one per UTC hour and pool. Pool names come from the pools file when the
definitions are built, never at import.

A backfill runs each pool's hours as one run (`BACKFILL_POLICY`): every asset and the
reconciliation then work through the run's hours in order, paying a run's fixed costs (its
set-up, events, warehouse openings, kernel and weights) once, not once per hour, and each
hour's conservation check sees every earlier hour of the range already attributed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import NamedTuple

import dagster as dg

from pipeline.datadir import DataDir
from schemas.units import parse_hour_key

# The first hour Dagster offers, when set; else the data directory's first hour.
FIRST_HOUR_ENV = "STEPLEDGER_FIRST_HOUR"
DAGSTER_HOUR = "%Y-%m-%d-%H:%M"
ONE_HOUR = timedelta(hours=1)


def data_hours(layout: DataDir) -> list[datetime]:
    """The hours the directory holds gateway files or DCGM scrapes for (files named otherwise
    are not hours and are left to ingestion to report)."""
    hours = set(layout.hours())
    for scrape in layout.dcgm.glob("*/*.prom"):
        with contextlib.suppress(ValueError):
            hours.add(parse_hour_key(scrape.stem))
    return sorted(hours)


class HourRange(NamedTuple):
    first: datetime  # the first hourly partition
    end: datetime | None  # the hour after the last one; None: up to the current hour


def partition_hours(
    layout: DataDir, now: datetime, run_hours: Sequence[datetime] = ()
) -> HourRange:
    """The hours Dagster offers as partitions, so that the UI shows a data directory as it is.

    They start at STEPLEDGER_FIRST_HOUR when set, else at the directory's first hour of data
    (`data_hours`), else (a directory that holds no data yet) at the hour of `now`. They run
    up to the current hour, except in a directory whose data stopped before the hour the
    schedule would still expect (assets.schedules: the hour after its last data) had
    ended: a demo's directory, whose partitions then end at its last hour. `run_hours`: hours
    a caller is about to run, always covered (`stepledger run --hour` of any hour)."""
    value = os.environ.get(FIRST_HOUR_ENV)
    data = data_hours(layout)
    if value is not None:
        try:
            first = parse_hour_key(value)
        except ValueError as err:
            raise ValueError(f"{FIRST_HOUR_ENV}: {err}") from err
    else:
        first = data[0] if data else completed_hour(now) + ONE_HOUR
    stopped = bool(data) and data[-1] + ONE_HOUR < completed_hour(now)
    end = data[-1] + ONE_HOUR if stopped else None
    if run_hours:
        first = min(first, *run_hours)
        end = max(end, max(run_hours) + ONE_HOUR) if end else None
    return HourRange(first, end)


# One run per contiguous range of a pool's hours, not a run per hour. Dagster groups a
# multi-partition backfill by the dimension with fewer keys: a day of two pools is two runs,
# one hour of two pools one run of both.
BACKFILL_POLICY = dg.BackfillPolicy.single_run()


def pool_hour_partitions(pool_names: list[str], hours: HourRange) -> dg.MultiPartitionsDefinition:
    hourly = dg.HourlyPartitionsDefinition(
        start_date=hours.first.astimezone(UTC).strftime(DAGSTER_HOUR),
        end_date=hours.end.astimezone(UTC).strftime(DAGSTER_HOUR) if hours.end else None,
        timezone="UTC",
    )
    return dg.MultiPartitionsDefinition(
        {"hour": hourly, "pool": dg.StaticPartitionsDefinition(pool_names)}
    )


def partition_key(hour: datetime, pool: str) -> dg.MultiPartitionKey:
    return dg.MultiPartitionKey({"hour": hour.astimezone(UTC).strftime(DAGSTER_HOUR), "pool": pool})


class PoolHour(NamedTuple):
    hour: datetime
    pool: str
    key: str  # the partition key, for the hour's own metadata and check evaluations


def _pool_hour(key: str) -> PoolHour:
    if not isinstance(key, dg.MultiPartitionKey):
        raise TypeError(f"partition {key!r} is not an (hour, pool) partition")
    keys = key.keys_by_dimension
    hour = datetime.strptime(keys["hour"], DAGSTER_HOUR).replace(tzinfo=UTC)
    return PoolHour(hour, keys["pool"], str(key))


def pool_hours(
    context: dg.AssetExecutionContext | dg.AssetCheckExecutionContext,
) -> list[PoolHour]:
    """The (hour, pool) partitions of the run, hours in order: one for a scheduled or sensed
    run, a range of hours for a backfill (`BACKFILL_POLICY`)."""
    return sorted(map(_pool_hour, context.partition_keys))


def pool_hours_of_run(
    tags: Mapping[str, str], partitions: dg.MultiPartitionsDefinition
) -> list[PoolHour]:
    """The (hour, pool) partitions a run covered, hours in order, from its tags: one
    partition, or a backfill's range."""
    if "dagster/partition" in tags:
        names: Sequence[str] = [tags["dagster/partition"]]
    elif "dagster/asset_partition_range_start" not in tags:
        raise ValueError(f"the run has no (hour, pool) partition nor range of them: tags {tags}")
    else:
        names = partitions.get_partition_keys_in_range(
            dg.PartitionKeyRange(
                tags["dagster/asset_partition_range_start"],
                tags["dagster/asset_partition_range_end"],
            )
        )
    return sorted(_pool_hour(partitions.get_partition_key_from_str(name)) for name in names)


def range_tags(first: datetime, last: datetime, pool: str) -> dict[str, str]:
    """The tags of one run over the hours `first`..`last` (inclusive) of `pool`, as Dagster
    gives the run of a backfill range."""
    return {
        "dagster/asset_partition_range_start": str(partition_key(first, pool)),
        "dagster/asset_partition_range_end": str(partition_key(last, pool)),
    }


def completed_hour(now: datetime, delay: timedelta = timedelta(0)) -> datetime:
    """The latest hour that ended at least `delay` before `now`."""
    shifted = now.astimezone(UTC) - delay
    return shifted.replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
