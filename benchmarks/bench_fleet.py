"""Pools billed side by side on the production stack: how much of a pool-hour is serial, and
how throughput grows with run workers.

The stack (`pipeline.stack.up`: PostgreSQL, the Dagster daemon and webserver) is started in a
temporary directory; each measurement bills a fresh copy of the input into a fresh store on
its server (the pipeline's state and the DuckLake catalog in PostgreSQL). The input is the
default chat pool's four replicas as four pools of one TP1 replica each, one hour, simulated
for SIMULATED_HOURS of it. A run worker is a process billing its share of the pools (each
pool's hours in order, as the conservation check needs), each pool-hour through
`pool_hour_job` in process, as a run launched by the daemon does.

`serial_s_per_gpu_hour`: with the four pools billed at once (four workers), the seconds during
which one pool-hour holds a lock, pool slot or row that another pool-hour waits for, per
GPU-hour billed. No step takes a Dagster pool, and the state rows a pool-hour writes are its
own, so what remains is measured where it happens:

- the COMMIT of every transaction a pool-hour runs (`pipeline.storage.warehouse.transaction`,
  wherever the pipeline imported it). A DuckLake commit is where writers serialise: it claims
  the next snapshot id in the PostgreSQL catalog, and a second committer waits on that row
  until the first commits (then DuckLake retries it, inside the same COMMIT, when the two
  changed nothing in common). Writing a transaction's Parquet files happens before COMMIT, side
  by side. State transactions are counted too, though they lock only their own rows: an upper
  bound;
- the work of every attempt `retry_conflicts` ran again after a conflict (less its COMMIT,
  counted above);
- lock waits on the pipeline state's tables observed in PostgreSQL: `pg_stat_activity` sampled
  every SAMPLE_EVERY_S, each session waiting for a lock counting the time between samples (a
  gateway file of the hour is every pool's, so two pool-hours loading it meet on its request
  ids). Waits on the catalog's tables are reported apart and not added: the waiter is inside
  its own COMMIT, counted already.

The breakdown (commits by the function that committed, conflicts, waits) is printed with the
figures. The simulated part of the hour has a SIMULATED_HOURS share of a full hour's requests,
so GPU-hours billed are the replicas' GPUs x SIMULATED_HOURS; the serial seconds of a
pool-hour are mostly a fixed number of commits, so the QUICK figure (a twentieth of an hour,
pools of one GPU) is far above a full hour's of a larger pool. `serial_s_per_pool_hour` is the
measured serial seconds per pool-hour as they are, against the time a busy pool of 8 GPUs may
take for the fleet target (8 x 3600 / TARGET_CEILING_GPUS per full hour).
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
import threading
import time
from dataclasses import dataclass
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
# The busy pool of the pool-hour benchmark: 8 TP1 replicas.
BUSY_POOL_GPUS = 8
# One worker's billing: its pools' hour through the job in process, with the serial sections
# timed where the pipeline enters them.
WORKER = """
import contextlib, json, sys, time, warnings
from pathlib import Path
import dagster as dg
import duckdb
import pipeline.storage.warehouse as warehouse
import assets.pool_hour, pipeline.finance, pipeline.ingestion.gateway, pipeline.ingestion.ingest
import pipeline.reconcile.alerts
from assets.definitions import build_definitions
from assets.partitions import partition_key
from assets.runner import QUIET_RUN_CONFIG
from pipeline.datadir import DataDir
from schemas.config import load_pools
from schemas.units import parse_hour_key
warnings.filterwarnings("ignore")
serial = {"commit_s": 0.0, "redone_s": 0.0, "commits": 0, "conflicts": 0, "by_caller": {}}
original_transaction, original_retry = warehouse.transaction, warehouse.retry_conflicts
@contextlib.contextmanager
def measured_transaction(con):
    con.execute("BEGIN TRANSACTION")
    try:
        yield con
    except BaseException:
        con.execute("ROLLBACK")
        raise
    started = time.perf_counter()
    try:
        con.execute("COMMIT")
    finally:
        spent = time.perf_counter() - started
        serial["commit_s"] += spent
        serial["commits"] += 1
        # Who committed: the function whose `with transaction(...)` this is.
        caller = sys._getframe(2).f_code.co_name
        serial["by_caller"][caller] = serial["by_caller"].get(caller, 0.0) + spent
def measured_retry(work, what):
    def attempt():
        started, committing = time.perf_counter(), serial["commit_s"]
        try:
            return work()
        except duckdb.Error as err:
            if any(conflict in str(err) for conflict in warehouse.CONFLICTS):
                # The attempt's own COMMIT is counted already.
                spent = time.perf_counter() - started
                serial["redone_s"] += spent - (serial["commit_s"] - committing)
                serial["conflicts"] += 1
            raise
    return original_retry(attempt, what)
data, hour, names = Path(sys.argv[1]), parse_hour_key(sys.argv[2]), sys.argv[3].split(",")
pools = load_pools(DataDir(data).pools_file)
job = build_definitions(pools, data).resolve_job_def("pool_hour_job")
for module in list(sys.modules.values()):
    for name, original, measured in (
        ("transaction", original_transaction, measured_transaction),
        ("retry_conflicts", original_retry, measured_retry),
    ):
        if getattr(module, name, None) is original:
            setattr(module, name, measured)
gpu_hours = 0
with dg.DagsterInstance.ephemeral() as instance:
    for name in names:
        result = job.execute_in_process(partition_key=partition_key(hour, name),
            instance=instance, run_config=QUIET_RUN_CONFIG, raise_on_error=False)
        if not result.success:
            sys.exit(f"pool {name}: the run failed")
        pool = pools.pool(name)
        gpu_hours += len(pool.replicas) * pool.gpus_per_replica
print(json.dumps({**serial, "gpu_hours": gpu_hours}))
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


# Sessions of the store waiting for a lock, by whether the waiting statement is DuckLake's
# (its catalog tables are in schema `ducklake`) or the pipeline state's.
WAITING = (
    "SELECT query LIKE '%ducklake%', count(*) FROM pg_stat_activity "
    "WHERE wait_event_type = 'Lock' AND datname = current_database() GROUP BY 1"
)
SAMPLE_EVERY_S = 0.005


class LockWaits(threading.Thread):
    """Samples the store's sessions waiting for a lock while the workers bill: seconds of lock
    wait (sessions waiting x time between samples), on the state's tables and on the catalog."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.state_s = 0.0
        self.catalog_s = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        import psycopg2

        con = psycopg2.connect(self.dsn)
        con.autocommit = True
        try:
            with con.cursor() as cursor:
                last = time.perf_counter()
                while not self.stop.wait(SAMPLE_EVERY_S):
                    cursor.execute(WAITING)
                    now = time.perf_counter()
                    for catalog, waiting in cursor.fetchall():
                        if catalog:
                            self.catalog_s += waiting * (now - last)
                        else:
                            self.state_s += waiting * (now - last)
                    last = now
        finally:
            con.close()


@dataclass(frozen=True)
class Billed:
    """What one billing of every pool measured."""

    wall_s: float
    commit_s: float
    redone_s: float
    state_lock_wait_s: float
    catalog_lock_wait_s: float
    commits: int
    conflicts: int
    gpu_hours: int
    # Seconds in COMMIT by the function that committed (publishing, checks, ingestion...).
    commit_s_by_caller: dict[str, float]

    @property
    def serial_s(self) -> float:
        return self.commit_s + self.redone_s + self.state_lock_wait_s


def bill(stack_dir: Path, data: Path, copy: Path, workers: int) -> Billed:
    """Bill every pool of the input's hour with `workers` processes into a fresh store."""
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
    waits = LockWaits(env[POSTGRES_ENV])
    waits.start()
    started = time.perf_counter()
    try:
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
    finally:
        waits.stop.set()
        waits.join()
    return Billed(
        wall_s=wall,
        commit_s=sum(o["commit_s"] for o in outcomes),
        redone_s=sum(o["redone_s"] for o in outcomes),
        state_lock_wait_s=waits.state_s,
        catalog_lock_wait_s=waits.catalog_s,
        commits=sum(o["commits"] for o in outcomes),
        conflicts=sum(o["conflicts"] for o in outcomes),
        gpu_hours=sum(o["gpu_hours"] for o in outcomes),
        commit_s_by_caller={
            caller: round(sum(o["by_caller"].get(caller, 0.0) for o in outcomes), 3)
            for caller in sorted({c for o in outcomes for c in o["by_caller"]})
        },
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
            side_by_side = bill(root / "stack", data, root / "billed", 4)
            rates = {}
            for workers in (1, 2):
                rates[workers] = (
                    4 / bill(root / "stack", data, root / "billed", workers).wall_s * 60
                )
        finally:
            stack.down(root / "stack")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"  four pools at once: {side_by_side}", file=sys.stderr, flush=True)
    serial_per_gpu_hour = side_by_side.serial_s / share / side_by_side.gpu_hours
    pool_hours = len(four_pools().pools)
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
        Figure(
            "serial_s_per_pool_hour",
            side_by_side.serial_s / pool_hours,
            "s",
            BUSY_POOL_GPUS * 3600 / TARGET_CEILING_GPUS,
            "max",
        ),
        Figure("stack_pool_hours_per_min_1_worker", rates[1], "/min", 0, "min"),
        Figure("stack_pool_hours_per_min_2_workers", rates[2], "/min", 0, "min"),
        Figure("stack_workers_speedup", rates[2] / rates[1], "x", TARGET_RATIO, "min"),
    ]
