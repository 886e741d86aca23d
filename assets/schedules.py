"""The hourly schedule: each hour is materialized for every pool once late files had time to
arrive (Settings.late_file_delay_minutes after the hour ended). It runs as soon as a daemon
loads the code location; stop it in the UI's Automation page.

It bills only hours the data directory has data for or expects: a gateway file of the hour or
of the hour before (a feed that ran an hour ago and fell silent is a gap, billed and held back
by the checks), or a DCGM scrape of the hour. An hour the directory was never given (the
current hour of a demo's directory) is skipped with the reason, never billed as all idle; a
silence longer than that is the dead-man sensor's to page."""

from __future__ import annotations

from datetime import datetime, timedelta

import dagster as dg

from assets.jobs import POOL_HOUR_JOB
from assets.partitions import completed_hour, partition_key
from assets.resources import StepledgerData
from pipeline.datadir import DataDir
from pipeline.ingestion.gateway import gateway_files_for_hour
from schemas.config import PoolsFile
from schemas.units import hour_key


def expects_data(layout: DataDir, hour: datetime) -> bool:
    """Whether the directory has data for `hour` or expects it (see the module's docstring)."""
    return bool(gateway_files_for_hour(layout.gateway, hour)) or any(
        layout.dcgm.glob(f"*/{hour_key(hour)}.prom")
    )


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
    def hourly_ledger(
        context: dg.ScheduleEvaluationContext, data: StepledgerData
    ) -> list[dg.RunRequest] | dg.SkipReason:
        hour = completed_hour(context.scheduled_execution_time, delay)
        if not expects_data(data.layout, hour):
            return dg.SkipReason(
                f"{data.layout.root} has no data for {hour_key(hour)} and expects none "
                "(no gateway file of the hour or the hour before, no DCGM scrape of the hour)"
            )
        return [
            dg.RunRequest(
                run_key=f"{hour_key(hour)}|{pool}", partition_key=partition_key(hour, pool)
            )
            for pool in pool_names
        ]

    return hourly_ledger
