"""The busy pool-hour of `bench_pool_hour` with its segments on the object store: shipped to
a SeaweedFS S3 server first (not timed), the local outboxes removed, and the pool-hour job run
with `STEPLEDGER_STORE` set, so its `step_log` step lists the store and pulls the segments
before it ingests them. Beside `pool_hour_s`, it shows what the store costs an hour; the lake
itself stays on local disk (the step log is written locally, docs/scale-out.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_pool_hour import _TIMED, simulate_input
from benchmarks.figure import Figure
from pipeline.datadir import DataDir
from pipeline.ship.s3server import S3Server
from pipeline.ship.shipper import ship_pending
from pipeline.ship.store import STORE_VARIABLE, SegmentStore

# Each data directory of the run (the fixed hour's and the data's) has its own prefix, as the
# replicas of both are named alike.
_TIMED_FROM_STORE = _TIMED.replace(
    "def run(data_dir, hour):\n",
    "def run(data_dir, hour):\n"
    "    import os\n"
    f"    os.environ['{STORE_VARIABLE}'] = os.environ['BENCH_STORE'] + '/' + data_dir.name\n",
)


def _ship(server: S3Server, data: Path) -> None:
    store = SegmentStore(
        server.filesystem(), f"{server.bucket}/bench/{data.name}", server.uri(f"bench/{data.name}")
    )
    report = ship_pending(store, DataDir(data).outbox)
    if report.failed:
        raise RuntimeError(f"shipping the benchmark's segments failed: {report.failed[0]}")
    shutil.rmtree(DataDir(data).outbox)


def figures(quick: bool) -> list[Figure]:
    assert _TIMED_FROM_STORE != _TIMED, "bench_pool_hour's timed script changed shape"
    with tempfile.TemporaryDirectory(prefix="bench-pool-hour-store-") as tmp:
        data, _, _, scale = simulate_input(Path(tmp), quick)
        server = S3Server(Path(tmp) / "s3").start()
        try:
            for directory in (data, Path(tmp) / "minute") if quick else (data,):
                _ship(server, directory)
            env = {**os.environ, **server.env(), "BENCH_STORE": server.uri("bench")}
            out = subprocess.run(
                [sys.executable, "-c", _TIMED_FROM_STORE, str(data), "fixed" if quick else "cold"],
                capture_output=True,
                text=True,
                check=True,
                env=env,
            )
        finally:
            server.stop()
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    if measured["errors"]:
        raise RuntimeError(f"the pool-hour from the store failed: {measured['errors'][0]}")
    wall_s = measured["fixed_s"] + measured["wall_s"] * scale
    return [Figure("pool_hour_s_object_store", wall_s, "s", 15.0, "max")]
