"""`stepledger ship`: segments uploaded per second by one shipper to a real S3 server
(SeaweedFS on loopback, the run's: `benchmarks.s3`), each put, read back and verified, then deleted locally, as in
production. The segments are the simulator's, of the small two-replica fleet."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.figure import Figure
from benchmarks.s3 import s3_server
from pipeline.datadir import DataDir
from pipeline.ingestion.ingest import segment_files
from pipeline.ship.shipper import ship_pending
from pipeline.ship.store import SegmentStore
from tests.helpers.fleets import simulate_small

MB = 1_000_000
# A node of 8 engines writing the demo's 11 MB per replica-hour writes 88 MB an hour (0.03
# MB/s); the target ships an hour of it, held back by an outage of the store, in a minute.
TARGET_MB_PER_S = 1.5


def figures(quick: bool) -> list[Figure]:
    server = s3_server()
    with tempfile.TemporaryDirectory(prefix="bench-ship-") as scratch:
        root = Path(scratch)
        fleet = simulate_small(root / "fleet")
        # Each run of the benchmark in a process ships to a prefix of its own.
        prefix = f"ship/{root.name}"
        store = SegmentStore(server.filesystem(), f"{server.bucket}/{prefix}", server.uri(prefix))
        rounds = 1 if quick else 3
        shipped_bytes, seconds = 0, 0.0
        for round_ in range(rounds):
            outbox = root / f"outbox{round_}"
            shutil.copytree(DataDir(fleet).outbox, outbox)
            shipped_bytes += sum(p.stat().st_size for p in segment_files(outbox))
            # Each round's segments are new objects: the prefix differs.
            round_store = SegmentStore(
                store.filesystem, f"{store.root}/{round_}", f"{store.uri}/{round_}"
            )
            started = time.perf_counter()
            report = ship_pending(round_store, outbox)
            seconds += time.perf_counter() - started
            assert not report.failed, report.failed
    return [Figure("ship_mb_per_s", shipped_bytes / MB / seconds, "MB/s", TARGET_MB_PER_S, "min")]
