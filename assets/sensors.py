"""A sensor that starts ingestion when new segments land in an outbox.

The cursor is the newest segment modification time seen (ns). Ingestion itself skips what it
has already ingested, so a file the cursor misses is picked up by the pool's next run. It runs
as soon as a daemon loads the code location; its first tick ingests every segment there.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

import dagster as dg

from assets.jobs import INGEST_JOB
from assets.partitions import completed_hour, partition_key
from assets.resources import StepledgerData
from pipeline.ingestion.ingest import segment_files
from schemas.config import PoolsFile


def build_new_segments_sensor(
    pools: PoolsFile, clock: Callable[[], datetime] = lambda: datetime.now(UTC)
) -> dg.SensorDefinition:
    pool_of_replica = {r.id: p.name for p in pools.pools for r in p.replicas}

    @dg.sensor(
        name="new_segments",
        job_name=INGEST_JOB,
        minimum_interval_seconds=60,
        default_status=dg.DefaultSensorStatus.RUNNING,
    )
    def new_segments(
        context: dg.SensorEvaluationContext, data: StepledgerData
    ) -> dg.SensorResult | dg.SkipReason:
        seen_ns = int(context.cursor or 0)
        newest_by_pool: dict[str, int] = {}
        for path in segment_files(data.layout.outbox, pool_of_replica):
            # lstat: a dangling symlink or a loop named like a segment is damage for ingestion
            # to report, not a reason for the sensor to fail.
            mtime_ns = path.lstat().st_mtime_ns
            pool = pool_of_replica[path.parent.name]
            if mtime_ns > seen_ns and mtime_ns > newest_by_pool.get(pool, 0):
                newest_by_pool[pool] = mtime_ns
        if not newest_by_pool:
            return dg.SkipReason("no new segments")
        # Ingestion takes every new segment of the pool; the partition only labels the run.
        hour = completed_hour(clock())
        return dg.SensorResult(
            run_requests=[
                dg.RunRequest(run_key=f"{pool}|{newest}", partition_key=partition_key(hour, pool))
                for pool, newest in sorted(newest_by_pool.items())
            ],
            cursor=str(max(newest_by_pool.values())),
        )

    return new_segments
