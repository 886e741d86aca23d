from __future__ import annotations

from datetime import timedelta

import pytest

from assets.partitions import (
    HourRange,
    partition_key,
    pool_hour_partitions,
    pool_hours_of_run,
    range_tags,
)
from tests.helpers.hours import SIMULATED_HOUR

PARTITIONS = pool_hour_partitions(["chat-8b", "reason-dsv3"], HourRange(SIMULATED_HOUR, None))


def test_a_runs_pool_hours_come_from_its_partition_or_its_range() -> None:
    key = partition_key(SIMULATED_HOUR, "chat-8b")
    one = {"dagster/partition": str(key)}
    assert pool_hours_of_run(one, PARTITIONS) == [(SIMULATED_HOUR, "chat-8b", str(key))]
    last = SIMULATED_HOUR + timedelta(hours=2)
    ranged = pool_hours_of_run(range_tags(SIMULATED_HOUR, last, "reason-dsv3"), PARTITIONS)
    assert [(hour, pool) for hour, pool, _ in ranged] == [
        (SIMULATED_HOUR + timedelta(hours=h), "reason-dsv3") for h in range(3)
    ]


def test_a_run_without_partitions_is_named() -> None:
    with pytest.raises(ValueError, match=r"no \(hour, pool\) partition.*'dagster/backfill': 'b1'"):
        pool_hours_of_run({"dagster/backfill": "b1"}, PARTITIONS)
