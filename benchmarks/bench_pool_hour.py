"""One pool-hour from segments to ledger: 8 busy TP1 replicas through the Dagster job.

The input is simulated outside the timing (and kept between runs: `benchmarks.simulated`).
The timed part runs in a fresh process (so its peak RSS is the pipeline's alone): ingest,
request context, attribution, publishing and reconciliation of the hour, exactly as the hourly
job runs them, on the first hour that process bills, as a launched run does.

QUICK bills fewer replicas for fewer minutes and extrapolates, counting what an hour costs
once apart from what grows with its data. Its process bills three hours in turn, each into a
directory of its own: one replica's minute (the first hour: imports' warm-up, kernel build,
loading or, from a fresh clone, compiling every numba function, run set-up; an hour without
steps would leave the allocator's functions to the next), the same minute again (what every
hour costs once warm: run set-up, openings, commits) and QUICK's hour. The data's cost per
replica-minute is QUICK's hour less the warm minute, over the replica-minutes between them;
the full pool-hour is the first minute's hour plus that cost for the replica-minutes it lacks
(a straight line through the two sizes, so no fixed cost is scaled). The peak RSS is the
smaller run's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.figure import Figure
from benchmarks.simulated import run_directory, simulated
from schemas.config import PoolsFile, load_pools

REPLICAS = 8
# Each replica is TP1: one GPU for the hour.
GPU_HOURS = REPLICAS
# Busy: twice the default chat pool's per-replica traffic.
TRAFFIC_SCALE = 2.0 * REPLICAS / 4

_TIMED = textwrap.dedent(
    """
    import json, resource, sys, time, warnings
    from datetime import datetime, timezone
    from pathlib import Path
    warnings.filterwarnings("ignore")
    import dagster as dg
    from assets.definitions import build_definitions
    from assets.partitions import partition_key
    from schemas.config import load_pools

    instance = dg.DagsterInstance.ephemeral()

    def cpu_s():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    def run(data_dir, hour):
        pools = load_pools(data_dir / "pools.yaml")
        job = build_definitions(pools, data_dir).resolve_job_def("pool_hour_job")
        started, cpu_started = time.perf_counter(), cpu_s()
        result = job.execute_in_process(
            partition_key=partition_key(hour, pools.pools[0].name), instance=instance, raise_on_error=False,
            run_config={"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}},
        )
        errors = [e.event_specific_data.error.message for e in result.get_step_failure_events()
                  if e.event_specific_data.error.cls_name != "DagsterAssetCheckFailedError"]
        return {"wall_s": time.perf_counter() - started, "cpu_s": cpu_s() - cpu_started}, errors

    # The hour of each data directory given, in turn.
    hour = datetime(2026, 11, 30, tzinfo=timezone.utc)
    runs, errors = [], []
    for data_dir in sys.argv[1:]:
        timed, failed = run(Path(data_dir), hour)
        runs.append(timed)
        errors += failed
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"runs": runs, "peak_kib": peak_kib, "errors": errors}))
    """
)
# QUICK's hour: enough work that its data's cost stands well above the warm minute's.
QUICK_REPLICAS, QUICK_MINUTES = 2, 10


def busy_pool(replicas: int) -> PoolsFile:
    """The default chat pool (Llama 3.1 8B on H100, TP1) with `replicas` busy replicas."""
    pools = load_pools()
    chat = pools.pool("chat-8b")
    template = chat.replicas[0]
    replica_list = [
        template.model_copy(
            update={
                "id": f"chat-8b-r{i}",
                "hostname": f"gpu-node-{i // 8 + 1:02d}",
                "gpu_uuids": [f"GPU-5f1c2a10-0000-4000-8000-{i + 1:012d}"],
            }
        )
        for i in range(replicas)
    ]
    scale = TRAFFIC_SCALE * replicas / REPLICAS
    workload = chat.workload
    assert workload is not None
    tenants = [
        tenant.model_copy(
            update={
                "features": [
                    f.model_copy(update={"requests_per_s": f.requests_per_s * scale})
                    for f in tenant.features
                ]
            }
        )
        for tenant in workload.tenants
    ]
    chat = chat.model_copy(
        update={
            "replicas": replica_list,
            "workload": workload.model_copy(update={"tenants": tenants}),
        }
    )
    return pools.model_copy(update={"pools": [chat]})


@dataclass(frozen=True)
class Input:
    """The directories the timed process bills, in order (QUICK: the first minute, the warm
    minute, QUICK's hour; full: the pool-hour), and the replica-minutes of each."""

    directories: list[Path]
    replica_minutes: list[int]


def simulate_input(tmp: Path, quick: bool) -> Input:
    """The benchmark's input: directories under `tmp` of their own, linked to the simulated
    inputs."""
    replicas, minutes = (QUICK_REPLICAS, QUICK_MINUTES) if quick else (REPLICAS, 60)
    data = simulated(
        f"pool-hour-{replicas}x{minutes}min", busy_pool(replicas), hours=minutes / 60, seed=11
    )
    if not quick:
        return Input([run_directory(data, tmp / "hour")], [replicas * minutes])
    minute = simulated("pool-hour-1x1min", busy_pool(1), hours=1 / 60, seed=12)
    return Input(
        [
            run_directory(minute, tmp / "first-minute"),
            run_directory(minute, tmp / "warm-minute"),
            run_directory(data, tmp / "hour"),
        ],
        [1, 1, replicas * minutes],
    )


def bill(
    directories: list[Path], script: str = _TIMED, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Bill the hour of each of `directories` in turn in a fresh process running `script`:
    each run's wall and CPU seconds (`runs`) and the process's peak RSS (`peak_kib`)."""
    out = subprocess.run(
        [sys.executable, "-c", script, *map(str, directories)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    measured: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    if measured["errors"]:
        raise RuntimeError(f"the pool-hour failed: {measured['errors'][0]}")
    return measured


def full_hour(measured: dict[str, Any], replica_minutes: list[int], key: str) -> float:
    """The full pool-hour's `key` (wall_s, cpu_s): measured, or QUICK's extrapolation (see the
    module's docstring)."""
    runs = [run[key] for run in measured["runs"]]
    if len(runs) == 1:
        return float(runs[0])
    first, warm, data = runs
    per_replica_minute = (data - warm) / (replica_minutes[2] - replica_minutes[1])
    return float(first + per_replica_minute * (REPLICAS * 60 - replica_minutes[0]))


def extrapolation(measured: dict[str, Any], replica_minutes: list[int], key: str) -> str:
    """How QUICK's `key` was extrapolated, with the seconds it came from."""
    first, warm, data = (run[key] for run in measured["runs"])
    return (
        f"first minute {first:.2f} s + (QUICK's {replica_minutes[2]} replica-minutes {data:.2f} s"
        f" - warm minute {warm:.2f} s) / {replica_minutes[2] - replica_minutes[1]}"
        f" x {REPLICAS * 60 - replica_minutes[0]}"
    )


def figures(quick: bool) -> list[Figure]:
    with tempfile.TemporaryDirectory(prefix="bench-pool-hour-") as tmp:
        given = simulate_input(Path(tmp), quick)
        measured = bill(given.directories)
    if quick:
        print(
            f"  pool_hour_s and pool_hour_cpu_s_per_gpu_hour extrapolated from {QUICK_REPLICAS}"
            f" replicas x {QUICK_MINUTES} min to {REPLICAS} x 60: wall"
            f" {extrapolation(measured, given.replica_minutes, 'wall_s')}; CPU"
            f" {extrapolation(measured, given.replica_minutes, 'cpu_s')};"
            " pool_hour_peak_gib is the smaller run's",
            file=sys.stderr,
        )
    cpu_s = full_hour(measured, given.replica_minutes, "cpu_s")
    return [
        Figure(
            "pool_hour_s", full_hour(measured, given.replica_minutes, "wall_s"), "s", 15.0, "max"
        ),
        Figure("pool_hour_peak_gib", measured["peak_kib"] / (1 << 20), "GiB", 4.0, "max"),
        # Wall time on a shared machine measures the neighbours too; CPU time is the bill's own.
        Figure("pool_hour_cpu_s_per_gpu_hour", cpu_s / GPU_HOURS, "s", 2.0, "max"),
    ]
