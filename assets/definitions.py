"""The Dagster code location. `dagster dev -m assets.definitions` (or `stepledger dev`) loads it.

Importing this module does no I/O: the pools file and the environment are read when Dagster
loads the definitions (`defs`), or when a caller builds them with `build_definitions`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import dagster as dg

from assets.alerting import build_alert_delivery_sensor, build_failure_pager
from assets.deadman import build_deadman_sensor
from assets.jobs import build_jobs
from assets.partitions import partition_hours, pool_hour_partitions
from assets.pool_hour import build_pool_hour_assets
from assets.reconciliation import build_reconciliation_checks
from assets.resources import (
    POOL_HOUR_LOCK,
    build_resources,
    data_dir_from_env,
    pool_hour_lock,
    state_pool,
)
from assets.schedules import build_hourly_schedule
from assets.sensors import build_new_segments_sensor
from assets.verification import build_verify_published_sensor
from pipeline.datadir import DataDir
from schemas.config import PoolsFile, load_pools


def build_definitions(
    pools: PoolsFile,
    data_dir: Path,
    warehouse: Path | None = None,
    clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    run_hours: Sequence[datetime] = (),
) -> dg.Definitions:
    """`clock`: the time the definitions are built at; `run_hours`: hours the caller is about
    to run. Both bound the partitions (assets.partitions.partition_hours)."""
    hours = partition_hours(DataDir(data_dir), clock(), run_hours)
    partitions = pool_hour_partitions([p.name for p in pools.pools], hours)
    pool_hour_assets = build_pool_hour_assets(partitions, pools, state_pool())
    pool_hour_job, ingest_job = build_jobs()
    return dg.Definitions(
        assets=pool_hour_assets,
        asset_checks=build_reconciliation_checks(pools, partitions, state_pool()),
        jobs=[pool_hour_job, ingest_job],
        schedules=[build_hourly_schedule(pools)],
        sensors=[
            build_new_segments_sensor(pools),
            build_failure_pager(partitions),
            build_alert_delivery_sensor(pools.settings),
            build_deadman_sensor(pools, hours.first),
            build_verify_published_sensor(),
        ],
        resources={
            **build_resources(data_dir, warehouse),
            POOL_HOUR_LOCK: pool_hour_lock(partitions, data_dir, warehouse),
        },
    )


@dg.definitions
def defs() -> dg.Definitions:
    data_dir = data_dir_from_env()
    return build_definitions(load_pools(DataDir(data_dir).pools_file), data_dir)
