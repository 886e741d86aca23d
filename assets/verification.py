"""The verification sweep: pages when a published pool-hour's data files or rows change while
no run and no reader touches it (a reader or a re-run refuses a changed file itself).

Every tick it verifies every published pool-hour (`pipeline.storage.integrity.sweep_warehouse`,
through a finance connection, so a run holding the pipeline's state does not hold it up) and
puts a `published_changed` page per changed pool-hour in the alert outbox, which delivers it
(the `deliver_alerts` sensor retries what the sink refused). The page's dedup key is the
pool-hour's finding, the one a refused re-run of the hour pages with: each changed hour pages
once, however often the sensor ticks and whichever noticed first.
"""

# No `from __future__ import annotations`: Dagster checks the `context` annotation as an
# object, and a postponed (string) annotation fails that check.

from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import dagster as dg
from dagster_duckdb import DuckDBResource

from assets.resources import open_warehouse
from pipeline.reconcile import alerts
from pipeline.storage.integrity import sweep_warehouse
from pipeline.storage.warehouse import WarehouseError, warehouse_dir
from schemas.units import hour_key

# Each file is hashed once per version in the sensor's process; a tick after the first stats
# the files and digests the rows (docs/production.md, "Verification sweep", for the cost).
VERIFY_INTERVAL_SECONDS = 3600


def build_verify_published_sensor(
    clock: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> dg.SensorDefinition:
    @dg.sensor(
        name="verify_published",
        minimum_interval_seconds=VERIFY_INTERVAL_SECONDS,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Pages when a published pool-hour's data files or rows changed since publishing.",
    )
    def verify_published(
        context: dg.SensorEvaluationContext, warehouse: DuckDBResource
    ) -> dg.SkipReason:
        now = clock()
        try:
            sweep = sweep_warehouse(warehouse_dir(Path(warehouse.database).resolve().parent))
        except WarehouseError as err:
            return dg.SkipReason(f"nothing published to verify: {err}")
        owed = [alerts.alert_for(change, now) for change in sweep.changed]
        if owed:
            with open_warehouse(warehouse) as con:
                alerts.enqueue(con, owed)
                alerts.deliver_due(con, alerts.sink_from_env(), now)
        verified = f"{sweep.hours} published pool-hour(s), {sweep.files} data file(s) verified"
        if not owed:
            return dg.SkipReason(f"{verified}: none changed")
        changed = ", ".join(f"{a.pool} {hour_key(a.hour)}" for a in owed)
        return dg.SkipReason(f"{verified}: changed since publishing: {changed}")

    return verify_published
