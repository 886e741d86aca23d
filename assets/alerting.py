"""Paging on-call when a pool-hour run fails, through the sink the environment configures
(pipeline.reconcile.alerts: PagerDuty Events v2 or Slack webhook, else a JSON-lines file or stdout).

A run fails when a reconciliation check fails with ERROR (its findings are paged, each once
per hour) or when a step raises (paged as `run_failed`, once per run). The failure sensor only
records what is owed in the pipeline state's alert outbox and tries it once; the delivery
sensor retries what the sink refused, with backoff, until it accepts, and fails its tick
(visible in the UI, and to Dagster's own sensor alerting) while any alert stays owed for
longer than the dead-man delay.
"""

# No `from __future__ import annotations`: Dagster checks the `context` annotation as an
# object, and a postponed (string) annotation fails that check.

from datetime import UTC, datetime

import dagster as dg
from dagster_duckdb import DuckDBResource

from assets.partitions import partition_key, pool_hours_of_run
from assets.resources import open_warehouse
from pipeline.reconcile import alerts, failed_checks
from schemas.config import Settings
from schemas.errors import ExternalError
from schemas.units import hour_key

# Dedup keys of the dead-man pages already delivered, in the data directory (the dead-man
# sensor reads while a run holds the pipeline's state, so it cannot use the outbox).


def build_failure_pager(partitions: dg.MultiPartitionsDefinition) -> dg.SensorDefinition:
    # Every job of the code location: the pool-hour and ingest jobs, and the runs of an asset
    # backfill launched by selecting partitions in the UI (Dagster's implicit asset job).
    @dg.run_failure_sensor(name="page_on_call", default_status=dg.DefaultSensorStatus.RUNNING)
    def page_on_call(context: dg.RunFailureSensorContext, warehouse: DuckDBResource) -> None:
        pool_hours = pool_hours_of_run(context.dagster_run.tags, partitions)
        message = context.failure_event.message
        if len(pool_hours) > 1:
            (first, pool, _), (last, _, _) = pool_hours[0], pool_hours[-1]
            message = f"{message} (the run of {pool} from {hour_key(first)} to {hour_key(last)})"
        now = datetime.now(UTC)
        with open_warehouse(warehouse) as con:
            # Each failed hour's findings; a run that failed without any, once for the run.
            owed = alerts.hour_alerts(
                [r for hour, pool, _ in pool_hours for r in failed_checks(con, pool, hour)],
                pool_hours[0].pool,
                pool_hours[0].hour,
                context.dagster_run.run_id,
                message,
                now,
                alerts.links_for(
                    context.dagster_run.run_id,
                    str(partition_key(pool_hours[0].hour, pool_hours[0].pool)),
                ),
            )
            alerts.enqueue(con, owed)
            alerts.deliver_due(con, alerts.sink_from_env(), now)

    return page_on_call


class AlertsUndelivered(ExternalError):
    """Alerts the sink has refused for longer than the dead-man delay."""


def build_alert_delivery_sensor(settings: Settings) -> dg.SensorDefinition:
    @dg.sensor(
        name="deliver_alerts",
        minimum_interval_seconds=60,
        default_status=dg.DefaultSensorStatus.RUNNING,
    )
    def deliver_alerts(
        context: dg.SensorEvaluationContext, warehouse: DuckDBResource
    ) -> dg.SkipReason:
        now = datetime.now(UTC)
        with open_warehouse(warehouse) as con:
            sent = alerts.deliver_due(con, alerts.sink_from_env(), now)
            owed = con.execute(
                "SELECT count(*) FROM alert_outbox WHERE delivered_at IS NULL"
            ).fetchall()[0][0]
            overdue = alerts.undelivered(con, now, settings)
        if overdue:
            raise AlertsUndelivered("; ".join(r.detail for r in overdue))
        return dg.SkipReason(f"{len(sent)} alert(s) delivered, {owed} still owed")

    return deliver_alerts
