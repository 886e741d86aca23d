"""Simulator speed: seconds to simulate one replica-hour of a busy TP1 replica on one core.

The replica is the default pools file's first pool (Llama-3.1-8B on one H100) reduced to one
replica that receives the whole pool's traffic, so it is busy throughout (about 240k steps an
hour), and everything is written: segments through the real StepRecorder, gateway and DCGM
files. The value is the CPU time of the process (every thread, the recorder's writer
included), which is the wall time on an otherwise idle core and is not inflated when other
work shares the machine. QUICK mode simulates 6 minutes and scales by 10 to a replica-hour
(the cost per simulated second is flat once the engine is warm). Numba compilation is paid
in a warm-up run before timing.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from benchmarks.figure import Figure
from pipeline.simulator import simulate
from schemas.config import PoolsFile, load_pools

TARGET_S = 30.0


def busy_replica_pools() -> PoolsFile:
    pools = load_pools()
    pool = pools.pools[0]
    single = pool.model_copy(update={"replicas": pool.replicas[:1]})
    return PoolsFile.model_validate(
        {"settings": pools.settings.model_dump(), "pools": [single.model_dump()]}
    )


def seconds_per_replica_hour(hours: float) -> float:
    pools = busy_replica_pools()
    with tempfile.TemporaryDirectory() as tmp:
        simulate(Path(tmp) / "warmup", pools, hours=0.002, seed=0)
        started = time.process_time()
        simulate(Path(tmp) / "run", pools, hours=hours, seed=1)
        return (time.process_time() - started) / hours


def figures(quick: bool) -> list[Figure]:
    value = seconds_per_replica_hour(0.1 if quick else 1.0)
    return [Figure("simulator_busy_replica_hour_s", value, "s", TARGET_S, "max")]
