"""Paging on-call when a pool-hour run fails, through the sink the environment configures
(pipeline.alerts: PagerDuty Events v2 or Slack webhook, else a JSON-lines file or stdout).

A run fails when a reconciliation check fails with ERROR (its findings are paged, each once
per hour) or when a step raises (paged as `run_failed`, once per run).
"""

# No `from __future__ import annotations`: Dagster checks the `context` annotation as an
# object, and a postponed (string) annotation fails that check.

from datetime import UTC, datetime
from typing import TYPE_CHECKING

import dagster as dg
from dagster_duckdb import DuckDBResource

from assets.resources import StepledgerData
from pipeline import alerts
from pipeline.hours import parse_hour_key
from pipeline.reconcile import failed_checks
from pipeline.warehouse import connect_read_only

if TYPE_CHECKING:
    from dagster._core.definitions.unresolved_asset_job_definition import (
        UnresolvedAssetJobDefinition,
    )

# Dedup keys of the alerts already delivered, in the data directory.
SENT_KEYS_FILE = "alerts_sent.keys"


def build_failure_pager(pool_hour_job: "UnresolvedAssetJobDefinition") -> dg.SensorDefinition:
    @dg.run_failure_sensor(
        name="page_on_call",
        monitored_jobs=[pool_hour_job],
        default_status=dg.DefaultSensorStatus.RUNNING,
    )
    def page_on_call(
        context: dg.RunFailureSensorContext, data: StepledgerData, warehouse: DuckDBResource
    ) -> None:
        tags = context.dagster_run.tags
        hour = parse_hour_key(tags["dagster/partition/hour"])
        pool = tags["dagster/partition/pool"]
        now = datetime.now(UTC)
        with connect_read_only(warehouse.database) as con:
            findings = failed_checks(con, pool, hour)
        sink = alerts.sink_from_env()
        sent_keys = alerts.SentKeysFile(data.root / SENT_KEYS_FILE)
        errors = [r for r in findings if r.severity == "ERROR"]
        if errors:
            alerts.page(errors, sink, sent_keys, raised_at=now)
            return
        run_id = context.dagster_run.run_id
        alerts.send_new(
            [
                alerts.Alert(
                    raised_at=now,
                    severity="ERROR",
                    kind="run_failed",
                    hour=hour,
                    pool=pool,
                    replica=None,
                    finding=run_id,
                    detail=context.failure_event.message or "the pool-hour run failed",
                    dedup_key=alerts.dedup_key("run_failed", hour, pool, None, run_id),
                )
            ],
            sink,
            sent_keys,
        )

    return page_on_call
