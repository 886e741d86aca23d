"""A sensor that starts ingestion when new segments land in an outbox.

The cursor is the newest segment modification time seen (ns). Ingestion itself skips what it
has already ingested, so a file the cursor misses is picked up by the pool's next run. It runs
as soon as a daemon loads the code location; its first tick ingests every segment there.

Each run is labelled with the hours its segments' data began in (their headers' wall-clock
anchors), not with the hour the sensor ran: the segments of a demo's directory, written now
for a simulated hour, show in the UI under that hour.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

import dagster as dg

from assets.jobs import INGEST_JOB
from assets.partitions import partition_key, range_tags
from assets.resources import StepledgerData
from pipeline.ingestion.decoder import UnreadableSegment, segment_header
from pipeline.ingestion.ingest import segment_files
from schemas.config import PoolsFile
from schemas.units import HOUR_NS, hour_at


def data_hours(paths: Iterable[Path]) -> list[datetime]:
    """The hours the segments' data begin in, from their headers. A segment without a
    readable header has none: ingestion reports its damage."""
    hours = set()
    for path in paths:
        try:
            header = segment_header(path)
        except UnreadableSegment:
            continue
        if header is not None:
            hours.add(hour_at(header.wall_anchor_ns // HOUR_NS))
    return sorted(hours)


def ingest_request(pool: str, newest_ns: int, paths: list[Path]) -> dg.RunRequest | None:
    """The ingest run of `pool`'s new segments, as one partition (their data's hour) or the
    range of the hours they span; None when no header tells an hour (the pool's next hourly
    run ingests and reports them)."""
    hours = data_hours(paths)
    if not hours:
        return None
    run_key = f"{pool}|{newest_ns}"
    if len(hours) == 1:
        return dg.RunRequest(run_key=run_key, partition_key=partition_key(hours[0], pool))
    return dg.RunRequest(run_key=run_key, tags=range_tags(hours[0], hours[-1], pool))


def build_new_segments_sensor(pools: PoolsFile) -> dg.SensorDefinition:
    pool_of_replica = {r.id: p.name for p in pools.pools for r in p.streams}

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
        new_by_pool: dict[str, list[tuple[int, Path]]] = {}
        for path in segment_files(data.layout.outbox, pool_of_replica):
            # lstat: a dangling symlink or a loop named like a segment is damage for ingestion
            # to report, not a reason for the sensor to fail.
            mtime_ns = path.lstat().st_mtime_ns
            if mtime_ns > seen_ns:
                pool = pool_of_replica[path.parent.name]
                new_by_pool.setdefault(pool, []).append((mtime_ns, path))
        if not new_by_pool:
            return dg.SkipReason("no new segments")
        # Ingestion takes every new segment of the pool; the partitions only label the run.
        requests = [
            ingest_request(pool, max(m for m, _ in new), [p for _, p in new])
            for pool, new in sorted(new_by_pool.items())
        ]
        return dg.SensorResult(
            run_requests=[r for r in requests if r is not None],
            cursor=str(max(m for new in new_by_pool.values() for m, _ in new)),
        )

    return new_segments
