"""Pools billed side by side on the production stack: how much of a pool-hour is serial, and
how throughput grows with run workers.

The stack (`pipeline.stack.up`: PostgreSQL, the Dagster daemon and webserver) is started in a
temporary directory; each measurement bills a fresh copy of the input into a fresh store on
its server (the pipeline's state and the DuckLake catalog in PostgreSQL). The input is the
default chat pool's four replicas as four pools of one TP1 replica each, one hour, simulated
for SIMULATED_HOURS of it. A run worker is a process billing its share of the pools (each
pool's hours in order, as the conservation check needs), each pool-hour through
`pool_hour_job` in process, as a run launched by the daemon does.

`serial_s_per_gpu_hour`: with the four pools billed at once (four workers), the seconds a
pool-hour spends where another pool-hour may have to wait for it, per GPU-hour billed: its
transactions on the warehouse's tables (publishing the hour, recording its checks and
alerts: DuckLake lets one of two concurrent transactions that write a table commit and the
other retries) and loading the hour's gateway files (shared by every pool of the hour: the
first to load one holds its rows until it commits). Nothing else is shared: the state rows
each pool-hour writes are its own, and no step takes a Dagster pool. The simulated part of
the hour has a SIMULATED_HOURS share of a full hour's requests, so the serial seconds are
scaled by 1 / SIMULATED_HOURS: an upper bound (part of each transaction is fixed).
`fleet_ceiling_gpus` = 3600 / `serial_s_per_gpu_hour`: the GPUs whose hourly billing fits in
an hour of serial time, however many machines run the rest.

`stack_pool_hours_per_min` with 1 and 2 workers, and their ratio (target 1.7 on 2 cores).
QUICK bills the same four pools over SIMULATED_HOURS_QUICK of the hour (smaller pool-hours).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.figure import Figure

if TYPE_CHECKING:
    from schemas.config import PoolsFile

SIMULATED_HOURS = 0.25
SIMULATED_HOURS_QUICK = 0.05
SEED = 17
REPO = Path(__file__).resolve().parent.parent
TARGET_CEILING_GPUS = 100_000
TARGET_RATIO = 1.7
# One worker's billing: its pools' hour through the job in process, with the serial sections
# timed where the pipeline enters them.
WORKER = """
import json, sys, time, warnings
from pathlib import Path
import dagster as dg
import pipeline.ingestion.gateway as gateway
import pipeline.reconcile.alerts as alerts
import pipeline.reconcile.hour as reconcile_hour
import pipeline.storage.warehouse as warehouse
from assets.definitions import build_definitions
from assets.partitions import partition_key
from assets.runner import QUIET_RUN_CONFIG
from pipeline.datadir import DataDir
from schemas.config import load_pools
from schemas.units import parse_hour_key
warnings.filterwarnings("ignore")
serial = [0.0]
def timed(module, name):
    inner = getattr(module, name)
    def measured(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            serial[0] += time.perf_counter() - started
    setattr(module, name, measured)
timed(warehouse, "_replace_hour_rows")
timed(reconcile_hour, "record_checks")
timed(alerts, "record_alerts")
timed(gateway, "load_gateway_files")
data, hour, names = Path(sys.argv[1]), parse_hour_key(sys.argv[2]), sys.argv[3].split(",")
pools = load_pools(DataDir(data).pools_file)
job = build_definitions(pools, data).resolve_job_def("pool_hour_job")
gpu_hours = 0
with dg.DagsterInstance.ephemeral() as instance:
    for name in names:
        result = job.execute_in_process(partition_key=partition_key(hour, name),
            instance=instance, run_config=QUIET_RUN_CONFIG, raise_on_error=False)
        if not result.success:
            sys.exit(f"pool {name}: the run failed")
        pool = pools.pool(name)
        gpu_hours += len(pool.replicas) * pool.gpus_per_replica
print(json.dumps({"serial_s": serial[0], "gpu_hours": gpu_hours}))
"""


def four_pools() -> PoolsFile:
    from schemas.config import load_pools

    pools = load_pools()
    chat = pools.pool("chat-8b")
    names = ("chat-8b", "chat-8b-eu", "chat-8b-us", "chat-8b-ap")
    return pools.model_copy(
        update={
            "pools": [
                chat.model_copy(update={"name": name, "replicas": [replica]})
                for name, replica in zip(names, chat.replicas, strict=True)
            ]
        }
    )


def bill(stack_dir: Path, data: Path, copy: Path, workers: int) -> tuple[float, float, int]:
    """Bill every pool of the input's hour with `workers` processes into a fresh store:
    (wall seconds, serial seconds, GPU-hours)."""
    from pipeline.datadir import DataDir
    from pipeline.simulator.run import DEFAULT_START
    from pipeline.stack import demo_environment
    from pipeline.storage.warehouse import POSTGRES_ENV
    from schemas.config import load_pools
    from schemas.units import hour_key

    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(data, copy)
    env = {**os.environ, **demo_environment(stack_dir, copy), "PYTHONPATH": str(REPO)}
    assert env[POSTGRES_ENV]
    names = [p.name for p in load_pools(DataDir(copy).pools_file).pools]
    shares = [names[i::workers] for i in range(workers)]
    started = time.perf_counter()
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(copy), hour_key(DEFAULT_START), ",".join(share)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for share in shares
    ]
    outcomes = []
    for process in processes:
        out, _ = process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"a billing worker failed ({process.returncode})")
        outcomes.append(json.loads(out.splitlines()[-1]))
    wall = time.perf_counter() - started
    return (
        wall,
        sum(o["serial_s"] for o in outcomes),
        sum(o["gpu_hours"] for o in outcomes),
    )


def figures(quick: bool) -> list[Figure]:
    from pipeline import stack
    from pipeline.simulator import simulate

    share = SIMULATED_HOURS_QUICK if quick else SIMULATED_HOURS
    root = Path(tempfile.mkdtemp(prefix="stepledger-bench-fleet-"))
    try:
        data = root / "input"
        simulate(data, four_pools(), hours=share, seed=SEED)
        (root / "stack-data").mkdir()
        port = stack.free_port()
        stack.up(root / "stack", root / "stack-data", webserver_port=port)
        try:
            _, serial_s, gpu_hours = bill(root / "stack", data, root / "billed", 4)
            rates = {}
            for workers in (1, 2):
                wall, _, _ = bill(root / "stack", data, root / "billed", workers)
                rates[workers] = 4 / wall * 60
        finally:
            stack.down(root / "stack")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    serial_per_gpu_hour = serial_s / share / gpu_hours
    return [
        Figure(
            "serial_s_per_gpu_hour",
            serial_per_gpu_hour,
            "s",
            3600 / TARGET_CEILING_GPUS,
            "max",
        ),
        Figure(
            "fleet_ceiling_gpus", 3600 / serial_per_gpu_hour, "GPUs", TARGET_CEILING_GPUS, "min"
        ),
        Figure("stack_pool_hours_per_min_1_worker", rates[1], "/min", 0, "min"),
        Figure("stack_pool_hours_per_min_2_workers", rates[2], "/min", 0, "min"),
        Figure("stack_workers_speedup", rates[2] / rates[1], "x", TARGET_RATIO, "min"),
    ]
