"""Pools billed side by side on the production stack: how much of a pool-hour is serial, and
how throughput grows with run workers.

The stack's servers (`pipeline.stack.up` without the Dagster services, which are ended as soon
as it has started them: nothing here launches runs through the daemon, and their start-up would
take the cores from the billing; PostgreSQL and the S3 server) are started in a temporary
directory, once for all the billings, and killed with it (the S3 server's stop waits for its
filer; nothing it holds is kept); each billing copies its input afresh and bills
it into a fresh store on them (the pipeline's state and the DuckLake catalog in PostgreSQL,
the warehouse's data files on the S3 server), as `stepledger demo --profile
production` does. The input is POOLS busy pools of REPLICAS TP1 replicas each (the pool-hour
benchmark's busy pool: twice the default chat pool's traffic per replica), simulated for a
share of one hour. Each pool-hour is billed by a process of its own running `pool_hour_job` in
process, as a run the daemon launches is; a run worker is a slot that runs one such process at
a time, taking the next pool-hour when its last one ends (the daemon's queue with that many
concurrent runs).

`serial_s_per_gpu_hour`: with the POOLS pool-hours billed at once, the seconds during which one
pool-hour holds a lock, pool slot or row that another pool-hour waits for, per GPU-hour billed.
No step takes a Dagster pool; what remains is measured where it happens:

- the COMMIT of every transaction that writes the warehouse (`pipeline.storage.warehouse.
  transaction` with a DuckLake commit message). The DuckLake commit is where writers
  serialise: it claims the next snapshot id in the PostgreSQL catalog, and a second committer
  waits on that row until the first commits. Writing the Parquet files happens before COMMIT,
  side by side. The snapshots the catalog gained are counted too, and must equal the commits
  timed: a catalog write outside `transaction` would be serial time not measured;
- the work of every attempt `retry_conflicts` ran again after a conflict (less its COMMIT);
- lock waits observed in PostgreSQL: `pg_stat_activity` sampled every SAMPLE_EVERY_S, each
  session waiting for a lock counting the time since the previous sample, on the state's
  tables (added, and printed by the statement that waited) and on the catalog's (printed, not
  added: the waiter is inside its own COMMIT, counted already).

The COMMITs of transactions that write only the pipeline state (ingest batches, gateway files)
lock that pool-hour's own rows. They are printed apart, with the lock waits on the state's
tables, and not added: the waits are what another pool-hour lost to them.

The full benchmark bills a full hour of the pools (SHARE = 1): its serial seconds are measured,
not extrapolated, and divided by the GPU-hours billed (pools x replicas x 1 h). QUICK bills
SHARE_QUICK of the hour with pools of REPLICAS_QUICK replicas, POOLS_AT_ONCE_QUICK of them at
once, and must scale: a pool-hour's
serial seconds are its catalog commits (their count is checked against the snapshots added),
and a DuckLake commit writes the same catalog rows whatever the rows of its Parquet files (on
the SQLite catalog 2,000,000 rows commit in 0.04 s, as 100,000 do), so QUICK divides its
pool-hours' serial seconds by the GPU-hours of full pool-hours of REPLICAS GPUs, and says so.
`serial_s_per_pool_hour` is the serial seconds per pool-hour, against the time a pool of
REPLICAS GPUs may take for the fleet target. `fleet_ceiling_gpus` = 3600 /
`serial_s_per_gpu_hour`: the GPUs whose hourly billing fits in an hour of serial time, however
many machines run the rest.

`stack_pool_hours_per_min` with 1 and 2 run workers over the same input's pool-hours (QUICK:
one pool-hour a worker), and their ratio (target 1.7 on 2 cores). Each
pool-hour's process pays its imports and its first hour's warm-up, as a launched run does, in
both counts alike. The lock sampling does not run then (it takes CPU from the workers); the
CPU the workers, the stack and everything else on the machine used in each window is printed,
with the load average.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.figure import Figure
from benchmarks.simulated import simulated

if TYPE_CHECKING:
    from schemas.config import PoolsFile

POOLS = 4
REPLICAS = 8
REPLICAS_QUICK = 2
# QUICK bills as many pool-hours at once as the machine has cores (the CI machine's two).
POOLS_AT_ONCE_QUICK = 2
# The share of the hour simulated and billed.
SHARE = 1.0
SHARE_QUICK = 0.05
SEED = 17
REPO = Path(__file__).resolve().parent.parent
TARGET_CEILING_GPUS = 100_000
TARGET_RATIO = 1.7
# One pool-hour's billing, in a process of its own as a launched run: the job in process, with
# the sections that hold what others wait for timed where the pipeline enters them.
WORKER = """
import time
launched = time.perf_counter()
import contextlib, json, sys, warnings
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
serial = {"catalog_commit_s": 0.0, "state_commit_s": 0.0, "catalog_commits": 0,
          "state_commits": 0, "redone_s": 0.0, "conflicts": 0, "by_caller": {}}
# Whether the open transaction writes the warehouse: every warehouse write of the pipeline
# names its DuckLake snapshot (`commit_message`).
writes_catalog = [False]
original_transaction = warehouse.transaction
original_retry, original_message = warehouse.retry_conflicts, warehouse.commit_message
def measured_message(con, message, **extra):
    writes_catalog[0] = True
    original_message(con, message, **extra)
@contextlib.contextmanager
def measured_transaction(con):
    writes_catalog[0] = False
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
        kind = "catalog" if writes_catalog[0] else "state"
        serial[kind + "_commit_s"] += spent
        serial[kind + "_commits"] += 1
        # Who committed: the function whose `with transaction(...)` this is.
        caller = kind + ":" + sys._getframe(2).f_code.co_name
        serial["by_caller"][caller] = serial["by_caller"].get(caller, 0.0) + spent
def measured_retry(work, what):
    def attempt():
        started = time.perf_counter()
        committing = serial["catalog_commit_s"] + serial["state_commit_s"]
        try:
            return work()
        except duckdb.Error as err:
            if any(conflict in str(err) for conflict in warehouse.CONFLICTS):
                # The attempt's own COMMIT is counted already.
                committed = serial["catalog_commit_s"] + serial["state_commit_s"] - committing
                serial["redone_s"] += time.perf_counter() - started - committed
                serial["conflicts"] += 1
            raise
    return original_retry(attempt, what)
data, hour, name = Path(sys.argv[1]), parse_hour_key(sys.argv[2]), sys.argv[3]
pools = load_pools(DataDir(data).pools_file)
job = build_definitions(pools, data).resolve_job_def("pool_hour_job")
for module in list(sys.modules.values()):
    for attribute, original, measured in (
        ("transaction", original_transaction, measured_transaction),
        ("retry_conflicts", original_retry, measured_retry),
        ("commit_message", original_message, measured_message),
    ):
        if getattr(module, attribute, None) is original:
            setattr(module, attribute, measured)
ready = time.perf_counter()
with dg.DagsterInstance.ephemeral() as instance:
    result = job.execute_in_process(partition_key=partition_key(hour, name),
        instance=instance, run_config=QUIET_RUN_CONFIG, raise_on_error=False)
if not result.success:
    sys.exit(f"pool {name}: the run failed")
pool = pools.pool(name)
print(json.dumps({**serial, "gpus": len(pool.replicas) * pool.gpus_per_replica,
                  "start_s": ready - launched, "bill_s": time.perf_counter() - ready}))
"""


def fleet_pools(replicas: int) -> PoolsFile:
    """POOLS busy pools of `replicas` TP1 replicas each (the pool-hour benchmark's busy pool,
    named and numbered apart)."""
    from benchmarks.bench_pool_hour import busy_pool

    busy = busy_pool(replicas)
    template = busy.pools[0]
    pools = []
    for p in range(POOLS):
        name = f"{template.name}-{p + 1}"
        pools.append(
            template.model_copy(
                update={
                    "name": name,
                    "replicas": [
                        replica.model_copy(
                            update={
                                "id": f"{name}-r{i}",
                                "hostname": f"gpu-node-{p + 1:02d}",
                                "gpu_uuids": [
                                    f"GPU-5f1c2a10-0000-4000-8000-{p * 1000 + i + 1:012d}"
                                ],
                            }
                        )
                        for i, replica in enumerate(template.replicas)
                    ],
                }
            )
        )
    return busy.model_copy(update={"pools": pools})


# Sessions of the store waiting for a lock, by whether the waiting statement is DuckLake's
# (its catalog tables are in schema `ducklake`) or the pipeline state's.
WAITING = (
    "SELECT query LIKE '%ducklake%', left(regexp_replace(query, '\\s+', ' ', 'g'), 90), "
    "count(*) FROM pg_stat_activity "
    "WHERE wait_event_type = 'Lock' AND datname = current_database() GROUP BY 1, 2"
)
SNAPSHOTS = "SELECT count(*) FROM ducklake.ducklake_snapshot"
SAMPLE_EVERY_S = 0.005


class LockWaits(threading.Thread):
    """Samples the store's sessions waiting for a lock while the pool-hours bill: seconds of
    lock wait (sessions waiting x time between samples), on the state's tables and on the
    catalog, and how many samples were taken; the state's by the statement that waited."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.state_s = 0.0
        self.catalog_s = 0.0
        self.samples = 0
        self.state_s_by_statement: dict[str, float] = {}
        # A sampler that failed saw nothing: the billing it watched is not reported.
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            self.sample()
        except BaseException as err:
            self.error = err

    def sample(self) -> None:
        import psycopg2

        con = psycopg2.connect(self.dsn)
        con.autocommit = True
        try:
            with con.cursor() as cursor:
                last = time.perf_counter()
                while not self.stop.wait(SAMPLE_EVERY_S):
                    cursor.execute(WAITING)
                    now = time.perf_counter()
                    self.samples += 1
                    for catalog, statement, waiting in cursor.fetchall():
                        if catalog:
                            self.catalog_s += waiting * (now - last)
                        else:
                            self.state_s += waiting * (now - last)
                            self.state_s_by_statement[statement] = self.state_s_by_statement.get(
                                statement, 0.0
                            ) + waiting * (now - last)
                    last = now
        finally:
            con.close()


def catalog_snapshots(dsn: str) -> int:
    """The snapshots the store's DuckLake catalog holds."""
    import psycopg2

    con = psycopg2.connect(dsn)
    try:
        with con.cursor() as cursor:
            cursor.execute(SNAPSHOTS)
            row = cursor.fetchone()
            assert row is not None
            return int(row[0])
    finally:
        con.close()


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU-seconds the machine's cores have been busy (all processes, /proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    # user nice system idle iowait irq softirq steal ...: idle and iowait are not busy.
    return (sum(fields[:8]) - fields[3] - fields[4]) / CLOCK_TICKS


def stack_cpu_s(stack_dir: Path) -> float:
    """CPU-seconds used so far by the stack's processes (the services' process groups, and
    PostgreSQL's server with the sessions it has reaped)."""
    from pipeline.stack import StackLayout

    record = json.loads(StackLayout(stack_dir.resolve()).record.read_text())
    groups = {int(g) for g in record.get("processes", {}).values()}
    server = int((Path(record["cluster"]) / "postmaster.pid").read_text().split()[0])
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the command (which may hold spaces): state ppid pgrp ... utime stime
        # cutime cstime are the 14th to 17th of the line.
        rest = stat.rsplit(")", 1)[1].split()
        pid, ppid, group = int(entry.name), int(rest[1]), int(rest[2])
        if group in groups or pid == server or ppid == server:
            total += sum(int(v) for v in rest[11:15])
    return total / CLOCK_TICKS


@dataclass(frozen=True)
class Billed:
    """What one billing of every pool-hour measured."""

    workers: int
    pool_hours: int
    wall_s: float
    catalog_commit_s: float
    state_commit_s: float
    redone_s: float
    state_lock_wait_s: float
    catalog_lock_wait_s: float
    lock_samples: int
    catalog_commits: int
    state_commits: int
    catalog_snapshots_added: int
    conflicts: int
    gpus: int
    # Per process: seconds from launch to the job ready (imports, definitions), then billing.
    start_s: float
    bill_s: float
    # CPU-seconds in the window: the pool-hours' processes, the stack's, the whole machine's.
    workers_cpu_s: float
    stack_cpu_s: float
    machine_cpu_s: float
    load_average: float
    # Seconds in COMMIT by kind (catalog, state) and the function that committed.
    commit_s_by_caller: dict[str, float]
    # Seconds sessions waited for a lock on the state's tables, by the statement waiting.
    state_lock_wait_s_by_statement: dict[str, float]

    @property
    def serial_s(self) -> float:
        return self.catalog_commit_s + self.redone_s + self.state_lock_wait_s

    def summary(self) -> str:
        others = self.machine_cpu_s - self.workers_cpu_s - self.stack_cpu_s
        return (
            f"{self.pool_hours} pool-hours, {self.workers} worker(s): wall {self.wall_s:.1f} s"
            f" (per process {self.start_s / self.pool_hours:.1f} s start,"
            f" {self.bill_s / self.pool_hours:.1f} s billing); CPU-s"
            f" pool-hours {self.workers_cpu_s:.1f} (cores {self.workers_cpu_s / self.wall_s:.2f}),"
            f" stack {self.stack_cpu_s:.1f}, everything else {others:.1f}; load average"
            f" {self.load_average:.2f}"
        )


def children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def bill(
    stack_dir: Path, data: Path, copy: Path, workers: int, *, pool_hours: int, sample: bool
) -> Billed:
    """Bill the first `pool_hours` pools' hour of the input into a fresh store, a process per
    pool-hour, at most `workers` at once; `sample`: watch PostgreSQL's lock waits meanwhile."""
    from pipeline.datadir import DataDir
    from pipeline.simulator.run import DEFAULT_START
    from pipeline.stack import demo_environment
    from pipeline.storage.warehouse import POSTGRES_ENV
    from schemas.config import load_pools
    from schemas.units import hour_key

    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(data, copy)
    env = {**os.environ, **demo_environment(stack_dir, copy), "PYTHONPATH": str(REPO)}
    dsn = env[POSTGRES_ENV]
    queue = [p.name for p in load_pools(DataDir(copy).pools_file).pools][:pool_hours]
    hour = hour_key(DEFAULT_START)
    snapshots_before = catalog_snapshots(dsn)
    waits = LockWaits(dsn)
    if sample:
        waits.start()
    cpu_before, stack_before, machine_before = (
        children_cpu_s(),
        stack_cpu_s(stack_dir),
        machine_busy_s(),
    )
    started = time.perf_counter()
    outcomes = []
    running: list[subprocess.Popen[str]] = []
    try:
        while queue or running:
            while queue and len(running) < workers:
                running.append(
                    subprocess.Popen(
                        [sys.executable, "-c", WORKER, str(copy), hour, queue.pop(0)],
                        env=env,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
            # A slot frees when its process ends.
            finished = next((p for p in running if p.poll() is not None), None)
            if finished is None:
                time.sleep(0.01)
                continue
            running.remove(finished)
            out, _ = finished.communicate()
            if finished.returncode != 0:
                raise RuntimeError(f"a pool-hour's billing failed ({finished.returncode})")
            outcomes.append(json.loads(out.splitlines()[-1]))
        wall = time.perf_counter() - started
        cpu, stack_cpu, machine = (
            children_cpu_s() - cpu_before,
            stack_cpu_s(stack_dir) - stack_before,
            machine_busy_s() - machine_before,
        )
    finally:
        # A failed pool-hour leaves the others' processes: none outlives the billing.
        for process in running:
            process.kill()
            process.wait()
        waits.stop.set()
        if sample:
            waits.join()
    if waits.error is not None:
        raise RuntimeError(f"sampling the lock waits failed: {waits.error}") from waits.error
    load = os.getloadavg()[0]

    def total(key: str) -> float:
        return float(sum(o[key] for o in outcomes))

    return Billed(
        workers=workers,
        pool_hours=len(outcomes),
        wall_s=wall,
        catalog_commit_s=total("catalog_commit_s"),
        state_commit_s=total("state_commit_s"),
        redone_s=total("redone_s"),
        state_lock_wait_s=waits.state_s,
        catalog_lock_wait_s=waits.catalog_s,
        lock_samples=waits.samples,
        catalog_commits=int(total("catalog_commits")),
        state_commits=int(total("state_commits")),
        catalog_snapshots_added=catalog_snapshots(dsn) - snapshots_before,
        conflicts=int(total("conflicts")),
        gpus=int(total("gpus")),
        start_s=total("start_s"),
        bill_s=total("bill_s"),
        workers_cpu_s=cpu,
        stack_cpu_s=stack_cpu,
        machine_cpu_s=machine,
        load_average=load,
        commit_s_by_caller={
            caller: round(sum(o["by_caller"].get(caller, 0.0) for o in outcomes), 3)
            for caller in sorted({c for o in outcomes for c in o["by_caller"]})
        },
        state_lock_wait_s_by_statement={
            statement: round(waited, 3)
            for statement, waited in sorted(waits.state_s_by_statement.items())
        },
    )


def _end_services(record: dict[str, object], names: tuple[str, ...]) -> None:
    """Kill the process groups of the stack's services `names` (this process started them, by
    `stack.up`) and collect their leaders: `stack.down` then finds them gone."""
    processes = record["processes"]
    assert isinstance(processes, dict)
    for name in names:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(processes[name], signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(processes[name], 0)


def figures(quick: bool) -> list[Figure]:
    from pipeline import stack

    share, replicas = (SHARE_QUICK, REPLICAS_QUICK) if quick else (SHARE, REPLICAS)
    at_once_pools = POOLS_AT_ONCE_QUICK if quick else POOLS
    data = simulated(
        f"fleet-{POOLS}x{replicas}-{share:g}h",
        fleet_pools(replicas),
        hours=share,
        seed=SEED,
        workers=os.cpu_count() or 1,
    )
    root = Path(tempfile.mkdtemp(prefix="stepledger-bench-fleet-"))
    try:
        (root / "stack-data").mkdir()
        record = stack.up(root / "stack", root / "stack-data", webserver_port=stack.free_port())
        try:
            _end_services(record, ("webserver", "daemon"))
            at_once = bill(
                root / "stack",
                data,
                root / "billed",
                at_once_pools,
                pool_hours=at_once_pools,
                sample=True,
            )
            by_workers = {
                workers: bill(
                    root / "stack",
                    data,
                    root / "billed",
                    workers,
                    pool_hours=workers if quick else POOLS,
                    sample=False,
                )
                for workers in (1, 2)
            }
        finally:
            _end_services(record, ("s3",))
            stack.down(root / "stack")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if at_once.catalog_snapshots_added != at_once.catalog_commits:
        raise RuntimeError(
            f"the catalog gained {at_once.catalog_snapshots_added} snapshots but "
            f"{at_once.catalog_commits} warehouse commits were timed"
        )
    # The GPU-hours whose billing the serial seconds stand for: QUICK's pool-hours stand for
    # full pool-hours of REPLICAS GPUs (their serial seconds are commits, see the docstring).
    full_pool_gpus = REPLICAS
    gpu_hours = at_once_pools * full_pool_gpus
    print(
        f"  {at_once_pools} pools of {replicas} TP1 replicas billed at once for {share:g} of an"
        " hour"
        + (
            f" (QUICK: their serial seconds stand for full pool-hours of {REPLICAS} GPUs)"
            if quick
            else ""
        )
        + f": serial {at_once.serial_s:.3f} s = catalog commits {at_once.catalog_commit_s:.3f} s"
        f" ({at_once.catalog_commits}, as many snapshots) + redone {at_once.redone_s:.3f} s"
        f" ({at_once.conflicts} conflicts) + lock waits on the state"
        f" {at_once.state_lock_wait_s:.3f} s; apart: state commits"
        f" {at_once.state_commit_s:.3f} s ({at_once.state_commits}), lock waits on the catalog"
        f" {at_once.catalog_lock_wait_s:.3f} s, {at_once.lock_samples} samples; by committer"
        f" {at_once.commit_s_by_caller}",
        file=sys.stderr,
    )
    if at_once.state_lock_wait_s_by_statement:
        print(
            f"    waited on the state's tables: {at_once.state_lock_wait_s_by_statement}",
            file=sys.stderr,
        )
    for billed in (at_once, *by_workers.values()):
        print(f"  {billed.summary()}", file=sys.stderr, flush=True)
    serial_per_gpu_hour = at_once.serial_s / gpu_hours
    rates = {
        workers: billed.pool_hours / billed.wall_s * 60 for workers, billed in by_workers.items()
    }
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
            at_once.serial_s / at_once_pools,
            "s",
            full_pool_gpus * 3600 / TARGET_CEILING_GPUS,
            "max",
        ),
        Figure("stack_pool_hours_per_min_1_worker", rates[1], "/min", 0, "min"),
        Figure("stack_pool_hours_per_min_2_workers", rates[2], "/min", 0, "min"),
        Figure("stack_workers_speedup", rates[2] / rates[1], "x", TARGET_RATIO, "min"),
    ]
