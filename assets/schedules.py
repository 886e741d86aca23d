"""The hourly schedule: each hour is materialized for every pool once late files had time to
arrive (Settings.late_file_delay_minutes after the hour ended). It runs as soon as a daemon
loads the code location; stop it in the UI's Automation page."""

from __future__ import annotations

from datetime import timedelta

import dagster as dg

from assets.jobs import POOL_HOUR_JOB
from assets.partitions import completed_hour, partition_key
from schemas.config import PoolsFile
from schemas.units import hour_key


def build_hourly_schedule(pools: PoolsFile) -> dg.ScheduleDefinition:
    delay = timedelta(minutes=pools.settings.late_file_delay_minutes)
    pool_names = [p.name for p in pools.pools]

    @dg.schedule(
        name="hourly_ledger",
        job_name=POOL_HOUR_JOB,
        cron_schedule=f"{pools.settings.late_file_delay_minutes % 60} * * * *",
        execution_timezone="UTC",
        default_status=dg.DefaultScheduleStatus.RUNNING,
    )
    def hourly_ledger(context: dg.ScheduleEvaluationContext) -> list[dg.RunRequest]:
        hour = completed_hour(context.scheduled_execution_time, delay)
        return [
            dg.RunRequest(
                run_key=f"{hour_key(hour)}|{pool}", partition_key=partition_key(hour, pool)
            )
            for pool in pool_names
        ]

    return hourly_ledger
