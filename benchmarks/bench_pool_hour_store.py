"""The busy pool-hour of `bench_pool_hour` with its segments on the object store: shipped to
a SeaweedFS S3 server first (the run's, `benchmarks.s3`; not timed), the local outboxes
removed, and the pool-hour job run with `STEPLEDGER_STORE` set, so its `step_log` step lists the store and pulls the segments
before it ingests them. Beside `pool_hour_s`, it shows what the store costs an hour; the lake
itself stays on local disk (the step log is written locally, docs/scale-out.md)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_pool_hour import _TIMED, bill, extrapolation, full_hour, simulate_input
from benchmarks.figure import Figure
from benchmarks.s3 import s3_server
from pipeline.datadir import DataDir
from pipeline.ship.s3server import S3Server
from pipeline.ship.shipper import ship_pending
from pipeline.ship.store import STORE_VARIABLE, SegmentStore

# Each data directory billed (QUICK: the minutes' and its hour's) has its own prefix, as the
# replicas of both are named alike.
_TIMED_FROM_STORE = _TIMED.replace(
    "def run(data_dir, hour):\n",
    "def run(data_dir, hour):\n"
    "    import os\n"
    f"    os.environ['{STORE_VARIABLE}'] = os.environ['BENCH_STORE'] + '/' + data_dir.name\n",
)


def _ship(server: S3Server, run: Path, scratch: Path, prefix: str) -> None:
    """Ship the segments of the data directory `run` to its prefix on the store (shipping
    deletes them: a copy of them, the simulated input stays), and leave `run` without them."""
    outbox = scratch / f"outbox-{run.name}"
    shutil.copytree(DataDir(run).outbox, outbox)
    store = SegmentStore(
        server.filesystem(),
        f"{server.bucket}/{prefix}/{run.name}",
        server.uri(f"{prefix}/{run.name}"),
    )
    report = ship_pending(store, outbox)
    if report.failed:
        raise RuntimeError(f"shipping the benchmark's segments failed: {report.failed[0]}")
    DataDir(run).outbox.unlink()


def figures(quick: bool) -> list[Figure]:
    assert _TIMED_FROM_STORE != _TIMED, "bench_pool_hour's timed script changed shape"
    server = s3_server()
    with tempfile.TemporaryDirectory(prefix="bench-pool-hour-store-") as tmp:
        given = simulate_input(Path(tmp), quick)
        # Each run of the benchmark in a process bills a store of its own.
        prefix = f"pool-hour-store/{Path(tmp).name}"
        for run in given.directories:
            _ship(server, run, Path(tmp), prefix)
        env = {**os.environ, **server.env(), "BENCH_STORE": server.uri(prefix)}
        measured = bill(given.directories, _TIMED_FROM_STORE, env)
    if quick:
        print(
            "  pool_hour_s_object_store extrapolated as pool_hour_s: wall"
            f" {extrapolation(measured, given.replica_minutes, 'wall_s')}",
            file=sys.stderr,
        )
    wall_s = full_hour(measured, given.replica_minutes, "wall_s")
    return [Figure("pool_hour_s_object_store", wall_s, "s", 15.0, "max")]
