"""The dead-man sensor: pages when a pool's hours go unreconciled, which no run can notice
because no run happens.

Every few minutes it reads, per pool, the latest hour up to which every hour has rows in the
warehouse's `reconciliation` table (read-only), hands that to `pipeline.reconcile.alerts.deadman`, and
pages each finding once through the sink the environment configures (the same sent-keys file
as the run-failure sensor, so a finding pages once however often the sensor ticks).

Only hours since the deployment (and not before the first partition) are owed: the sensor's first tick stores its time as the
cursor (kept in the Dagster instance), and hours that began before it never page, however far
back the first partition lies.
"""

# No `from __future__ import annotations`: Dagster checks the `context` annotation as an
# object, and a postponed (string) annotation fails that check.

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import dagster as dg
import duckdb
import polars as pl
from dagster_duckdb import DuckDBResource

from assets.resources import StepledgerData
from pipeline.reconcile import alerts
from pipeline.storage.warehouse import WarehouseError, connect_read_only, query_frame
from schemas.config import PoolsFile
from schemas.units import hour_key, instant_to_warehouse

DEADMAN_INTERVAL_SECONDS = 300
ONE_HOUR = timedelta(hours=1)


def last_reconciled_hours(
    reconciled: pl.DataFrame, pool_names: list[str], before_first: datetime
) -> dict[str, datetime]:
    """Pool -> the latest hour up to which every hour since the pool's first reconciled hour
    is reconciled. `reconciled`: distinct (pool, hour) rows, hours naive UTC. A pool never
    reconciled counts from `before_first` (the hour before the first partition), so its
    missing hours are overdue too."""
    last = {}
    for pool in pool_names:
        hours = reconciled.filter(pl.col("pool") == pool)["hour"].unique().sort()
        if hours.is_empty():
            last[pool] = before_first
            continue
        # Hour i of a gapless run is the first hour plus i hours; the first mismatch ends it.
        mismatch = (hours - hours[0]).dt.total_hours() != pl.int_range(0, len(hours), eager=True)
        gapless = int(mismatch.arg_max()) if mismatch.any() else len(hours)
        last[pool] = hours[gapless - 1].replace(tzinfo=UTC)
    return last


def first_owed_hour(deployed_at: datetime, first_partition: datetime) -> datetime:
    """The first hour that began at or after the deployment, and not before the first partition."""
    start = deployed_at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    if start < deployed_at:
        start += ONE_HOUR
    return max(start, first_partition)


def build_deadman_sensor(
    pools: PoolsFile,
    first_partition: datetime,
    clock: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> dg.SensorDefinition:
    pool_names = [p.name for p in pools.pools]
    settings = pools.settings

    @dg.sensor(
        name="deadman",
        minimum_interval_seconds=DEADMAN_INTERVAL_SECONDS,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Pages when a pool's hours are not reconciled within the dead-man delay of their end.",
    )
    def deadman(
        context: dg.SensorEvaluationContext, data: StepledgerData, warehouse: DuckDBResource
    ) -> dg.SkipReason:
        now = clock()
        if context.cursor:
            deployed_at = datetime.fromisoformat(context.cursor)
        else:
            deployed_at = now
            context.update_cursor(now.isoformat())
        owed_from = first_owed_hour(deployed_at, first_partition)
        try:
            with connect_read_only(warehouse.database) as con:
                reconciled = query_frame(con, "SELECT DISTINCT pool, hour FROM reconciliation")
        except WarehouseError:
            reconciled = pl.DataFrame(schema={"pool": pl.String, "hour": pl.Datetime("us")})
        except (duckdb.IOException, duckdb.ConnectionException) as err:
            # A run holds the file open for writing (another process locks it, this process
            # refuses a second configuration): try again at the next tick.
            return dg.SkipReason(f"warehouse busy, not read this tick: {err}")
        owed = reconciled.filter(pl.col("hour") >= instant_to_warehouse(owed_from))
        last = last_reconciled_hours(owed, pool_names, owed_from - ONE_HOUR)
        findings = alerts.deadman(last, now, settings)
        sent = alerts.page(
            findings,
            alerts.sink_from_env(),
            alerts.SentKeysFile(data.layout.sent_alert_keys),
            raised_at=now,
        )
        status = ", ".join(
            f"{pool} reconciled to {hour_key(hour)}" for pool, hour in sorted(last.items())
        )
        if not findings:
            return dg.SkipReason(f"every pool on time: {status}")
        return dg.SkipReason(f"{len(findings)} pool(s) overdue, {len(sent)} newly paged: {status}")

    return deadman
