"""One pool-hour from segments to ledger: 8 busy TP1 replicas through the Dagster job.

The input is simulated once, outside the timing. The timed part runs in a fresh process (so
its peak RSS is the pipeline's alone): ingest, request context, attribution, publishing and
reconciliation of the hour, exactly as the hourly job runs them. QUICK simulates fewer
replicas for fewer minutes: it first times an hour of one replica's minute (the fixed cost of
any hour: kernel build, loading or, from a fresh clone, compiling every numba function, run
set-up; an hour without steps would leave the allocator's functions to the timed hour, which
QUICK then scales), then the data's hour, and reports the fixed
cost plus the data's time scaled to the full pool-hour (the peak RSS is the smaller run's).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from benchmarks.figure import Figure
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

    data, measure_fixed = Path(sys.argv[1]), sys.argv[2] == "fixed"
    pools = load_pools(data / "pools.yaml")
    instance = dg.DagsterInstance.ephemeral()

    def cpu_s():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    def run(data_dir, hour):
        job = build_definitions(pools, data_dir).resolve_job_def("pool_hour_job")
        started, cpu_started = time.perf_counter(), cpu_s()
        result = job.execute_in_process(
            partition_key=partition_key(hour, pools.pools[0].name), instance=instance, raise_on_error=False,
            run_config={"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}},
        )
        errors = [e.event_specific_data.error.message for e in result.get_step_failure_events()
                  if e.event_specific_data.error.cls_name != "DagsterAssetCheckFailedError"]
        return time.perf_counter() - started, cpu_s() - cpu_started, errors

    # First a minute of one replica: what any hour costs (kernel build, JIT, run set-up).
    hour = datetime(2026, 11, 30, tzinfo=timezone.utc)
    fixed_s, fixed_cpu_s, errors = run(data.parent / "minute", hour) if measure_fixed else (0.0, 0.0, [])
    wall_s, cpu_s_, more_errors = run(data, hour)
    errors += more_errors
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"fixed_s": fixed_s, "fixed_cpu_s": fixed_cpu_s, "wall_s": wall_s,
                      "cpu_s": cpu_s_, "peak_kib": peak_kib, "errors": errors}))
    """
)


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


def simulate_input(tmp: Path, quick: bool) -> tuple[Path, int, int, float]:
    """The benchmark's input under `tmp`: the data directory (`run`; QUICK adds `minute`, the
    fixed hour's), its replicas and minutes, and the factor scaling its hour to the full one."""
    from pipeline.simulator import simulate

    # QUICK keeps enough work that the fixed cost (imports, kernel build) does not dominate.
    replicas, minutes = (4, 10) if quick else (REPLICAS, 60)
    data = tmp / "run"
    simulate(data, busy_pool(replicas), hours=minutes / 60, seed=11)
    if quick:
        simulate(tmp / "minute", busy_pool(1), hours=1 / 60, seed=12)
    return data, replicas, minutes, (REPLICAS / replicas) * (60 / minutes)


def figures(quick: bool) -> list[Figure]:
    with tempfile.TemporaryDirectory(prefix="bench-pool-hour-") as tmp:
        data, replicas, minutes, scale = simulate_input(Path(tmp), quick)
        out = subprocess.run(
            [sys.executable, "-c", _TIMED, str(data), "fixed" if quick else "cold"],
            capture_output=True,
            text=True,
            check=True,
        )
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    if measured["errors"]:
        raise RuntimeError(f"the pool-hour failed: {measured['errors'][0]}")
    if quick:
        print(
            "  pool_hour_s and pool_hour_cpu_s_per_gpu_hour extrapolated: the fixed cost of an hour"
            f" once plus {replicas} replicas x {minutes} min scaled by {scale:g};"
            " pool_hour_peak_gib is the smaller run's",
            file=sys.stderr,
        )
    # QUICK: the per-hour fixed cost once, the data-dependent rest scaled to the full pool-hour.
    cpu_s = measured["fixed_cpu_s"] + measured["cpu_s"] * scale
    return [
        Figure("pool_hour_s", measured["fixed_s"] + measured["wall_s"] * scale, "s", 15.0, "max"),
        Figure("pool_hour_peak_gib", measured["peak_kib"] / (1 << 20), "GiB", 4.0, "max"),
        # Wall time on a shared machine measures the neighbours too; CPU time is the bill's own.
        Figure("pool_hour_cpu_s_per_gpu_hour", cpu_s / GPU_HOURS, "s", 2.0, "max"),
    ]
