"""A 24-hour backfill of the default pools through the Dagster definitions: wall time and the
peak memory of the whole process tree.

The input is simulated once, outside the timing, and kept in STEPLEDGER_BENCH_CACHE
(`benchmarks.simulated`), so a second `make bench` times the backfill alone.

How it runs, as production would on one machine: a persistent Dagster instance (SQLite
storage, the `duckdb` concurrency pool limited to 1 as in dagster_home/dagster.yaml), and
LANES launcher processes that each execute their share of the runs Dagster's backfill plans
for the day (one per pool, over all its hours: `assets.partitions.BACKFILL_POLICY`), on the
job's own in-process executor (the steps of a run one after another in the launcher, each
step working through the run's hours in order). Within a run, ingestion writes its Parquet
files and attribution works on its hours two at a time, using both cores. LANES is 1: the
runs go one after the other. Two lanes overlap a run's `attribution` with the other's
warehouse steps, but a run whose next step waits for the `duckdb` pool keeps a core busy
(Dagster 1.13's executors never sleep while a step waits for a pool slot:
`InstanceConcurrencyContext.interval_to_next_pending_claim_check` returns at most 0), and a
range run's `step_log` holds the pool for a whole day's ingestion: QUICK's runs took 28.7 s
and 53.3 CPU-s in two lanes against 24.1 s and 36.3 CPU-s in one, one after the other.
STEPLEDGER_BACKFILL_LANES overrides it. (A process per step, on the multiprocess executor,
spent 2-2.6 s importing before each step did any work: QUICK took 2057 s that way against
952 s in process, on the same machine, when a backfill was a run per pool-hour.) A run's
`step_log` ingests whatever its pool's outbox holds: the whole day, in batches of bounded
size.

CPU time is the launchers' own and their children's (`backfill_24h_cpu_s`): on a shared
machine the wall time measures the neighbours too. Its target is the wall target's worth of
both cores.

Peak memory is the largest sum of resident set sizes over the launchers and any processes
they start, sampled every 0.2 s from /proc.

QUICK backfills QUICK_HOURS (one) hour, as the same runs (one per pool), and scales wall
and CPU time by HOURS / QUICK_HOURS, less the launchers' start (imports, the Dagster instance),
which the full backfill pays once too and is measured apart. Hours of a pool cost about the
same, so that is linear in hours but for what a run pays once (its set-up, warehouse
openings, the fixed part of ingesting and reconciling), which the scaling counts
HOURS / QUICK_HOURS times: QUICK's figures are upper bounds of the full run's. Its peak memory is the shorter run's, unscaled,
and reads low: the full run's `step_log` ingests a whole day of a replica's segments.

Target: 240 s, a day of backfill in four minutes (360 times faster than the hours arrive),
so that billing stays a rounding error of the GPUs it bills; that is 5 s per pool-hour on 2
cores. Peak memory: 8 GiB.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from benchmarks.figure import Figure
from benchmarks.simulated import run_directory, simulated

HOURS = 24
QUICK_HOURS = 1
SEED = 5
LANES = int(os.environ.get("STEPLEDGER_BACKFILL_LANES", "1"))
TARGET_WALL_S = 240.0
CORES = 2
TARGET_PEAK_GIB = 8.0
REPO = Path(__file__).resolve().parent.parent
SAMPLE_SECONDS = 0.2
_INSTANCE_YAML = """\
concurrency:
  pools:
    default_limit: 1
telemetry:
  enabled: false
"""

_LANE = textwrap.dedent(
    """
    import json, resource, sys, time, warnings
    warnings.filterwarnings("ignore")
    import dagster as dg
    from benchmarks.bench_backfill import backfill_job
    from assets.partitions import range_tags
    from schemas.units import parse_hour_key

    failures = []
    with dg.DagsterInstance.get() as instance:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        ready = {"ready_at": time.time(), "ready_cpu_s": usage.ru_utime + usage.ru_stime}
        for first, last, pool in json.loads(sys.argv[1]):
            result = dg.execute_job(
                dg.reconstructable(backfill_job), instance=instance,
                tags=range_tags(parse_hour_key(first), parse_hour_key(last), pool),
                run_config={"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}},
            )
            if not result.success:
                why = [e.message for e in result.all_events if e.is_failure or e.event_type_value == "RUN_FAILURE"]
                failures.append(f"{first}..{last} {pool}: {why}")
    print(json.dumps({"failures": failures, **ready}))
    """
)


def backfill_job():
    """The pool-hour job of the definitions for STEPLEDGER_DATA, on its own executor.

    Module level, so `dg.reconstructable` can rebuild it in every launcher.
    """
    from assets.definitions import build_definitions
    from assets.resources import data_dir_from_env
    from pipeline.datadir import DataDir
    from schemas.config import load_pools

    data = data_dir_from_env()
    return build_definitions(load_pools(DataDir(data).pools_file), data).resolve_job_def(
        "pool_hour_job"
    )


def simulated_input(hours: int) -> Path:
    """The default pools simulated for `hours` hours (from the cache when already there)."""
    from schemas.config import load_pools

    return simulated(
        f"backfill-{hours}h", load_pools(), hours=hours, seed=SEED, workers=os.cpu_count() or 1
    )


def _tree_rss_bytes(root_pids: list[int]) -> int:
    """Resident memory of the processes `root_pids` and all their descendants."""
    total, pending, seen = 0, list(root_pids), set()
    while pending:
        pid = pending.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            for task in Path(f"/proc/{pid}/task").iterdir():
                pending.extend(int(child) for child in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
        rss_kib = next(
            (int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0
        )
        total += rss_kib * 1024
    return total


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class Backfilled:
    """What one backfill measured: its wall and CPU seconds (the launchers'), those the
    launchers spent starting (until the first run, the last lane's wall), and its peak."""

    wall_s: float
    cpu_s: float
    start_wall_s: float
    start_cpu_s: float
    peak_bytes: int

    def scaled(self, factor: float) -> tuple[float, float]:
        """Wall and CPU seconds with what follows the start `factor` times longer."""
        return (
            self.start_wall_s + (self.wall_s - self.start_wall_s) * factor,
            self.start_cpu_s + (self.cpu_s - self.start_cpu_s) * factor,
        )


def backfill(data: Path, hours: int) -> Backfilled:
    """Run every pool-hour of `data` in a fresh copy of its outputs."""
    from pipeline.datadir import DataDir
    from pipeline.simulator import DEFAULT_START
    from schemas.config import load_pools
    from schemas.units import hour_key

    pools = load_pools(DataDir(data).own_pools_file)
    # The runs Dagster's backfill plans (BACKFILL_POLICY, tests/assets/test_pool_hour.py): one
    # per pool over all the hours, dealt to the lanes in turn.
    first, last = (hour_key(DEFAULT_START + timedelta(hours=h)) for h in (0, hours - 1))
    runs = [(first, last, pool.name) for pool in pools.pools]
    lane_runs = [runs[lane::LANES] for lane in range(min(LANES, len(runs)))]
    with tempfile.TemporaryDirectory(prefix="bench-backfill-") as tmp:
        run = run_directory(data, Path(tmp) / "run")
        home = Path(tmp) / "dagster_home"
        home.mkdir()
        (home / "dagster.yaml").write_text(_INSTANCE_YAML)
        # Create the SQLite storage before the launchers start: two of them creating it at
        # once collide on its schema.
        import dagster as dg

        with dg.DagsterInstance.from_config(str(home)):
            pass
        environment = {
            **os.environ,
            "DAGSTER_HOME": str(home),
            "STEPLEDGER_DATA": str(run),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        started, cpu_started, started_at = time.perf_counter(), _children_cpu_s(), time.time()
        lanes = [
            subprocess.Popen(
                [sys.executable, "-c", _LANE, json.dumps(runs_of_lane)],
                cwd=REPO,
                env=environment,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for runs_of_lane in lane_runs
        ]
        peak = 0
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.wait(SAMPLE_SECONDS):
                peak = max(peak, _tree_rss_bytes([lane.pid for lane in lanes]))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        outputs = [lane.communicate() for lane in lanes]
        wall_s = time.perf_counter() - started
        cpu_s = _children_cpu_s() - cpu_started
        done.set()
        sampler.join()
    failures, reports = [], []
    for lane, (stdout, stderr) in zip(lanes, outputs, strict=True):
        if lane.returncode != 0:
            raise RuntimeError(f"a backfill launcher failed: {stderr[-2000:]}")
        reports.append(json.loads(stdout.strip().splitlines()[-1]))
        failures += reports[-1]["failures"]
    if failures:
        raise RuntimeError(f"{len(failures)} backfill runs failed, first: {failures[0]}")
    return Backfilled(
        wall_s=wall_s,
        cpu_s=cpu_s,
        start_wall_s=max(r["ready_at"] for r in reports) - started_at,
        start_cpu_s=sum(r["ready_cpu_s"] for r in reports),
        peak_bytes=peak,
    )


def figures(quick: bool) -> list[Figure]:
    hours = QUICK_HOURS if quick else HOURS
    measured = backfill(simulated_input(hours), hours)
    wall_s, cpu_s = measured.scaled(HOURS / hours)
    if quick:
        print(
            f"  backfill_24h_s and backfill_24h_cpu_s extrapolated from {hours} hour(s):"
            f" launchers' start {measured.start_wall_s:.1f} s ({measured.start_cpu_s:.1f} CPU-s)"
            f" once + the rest of {measured.wall_s:.1f} s ({measured.cpu_s:.1f} CPU-s)"
            f" x {HOURS / hours:g}, upper bounds: what each run pays once (set-up, warehouse"
            f" openings) is counted {HOURS / hours:g} times; backfill_24h_peak_gib is the shorter"
            " run's",
            file=sys.stderr,
        )
    return [
        Figure("backfill_24h_s", wall_s, "s", TARGET_WALL_S, "max"),
        Figure("backfill_24h_cpu_s", cpu_s, "s", TARGET_WALL_S * CORES, "max"),
        Figure(
            "backfill_24h_peak_gib", measured.peak_bytes / (1 << 30), "GiB", TARGET_PEAK_GIB, "max"
        ),
    ]
