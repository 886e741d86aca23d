"""`simulate()`: a whole run directory for every pool of a pools file, as production would deliver it.

    out_dir/pools.yaml                          the pools file used
    out_dir/outbox/<replica>/*.seg              step segments, through the real StepRecorder
    out_dir/gateway/<YYYY-MM-DDTHH>.jsonl       gateway request context
    out_dir/dcgm/<hostname>/<YYYY-MM-DDTHH>.prom   DCGM exporter scrapes
    out_dir/alert-sink.json                     the alert sink, with the sink-down fault

Replicas are simulated one after another on one core, or in worker processes. Every random
stream is seeded from (seed, pool, replica, purpose), so a seed always gives the same data
however the replicas are run, and turning a fault on changes only what that fault touches.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from pipeline.datadir import DataDir
from pipeline.simulator.faults import (
    ENGINE_VERSION,
    UNCALIBRATED_ENGINE_VERSION,
    FaultError,
    ReplicaFaults,
    damage_segments,
    validate_fault,
)
from pipeline.simulator.replica import ReplicaRun, simulate_replica
from pipeline.simulator.sink import write_sink
from pipeline.simulator.telemetry import GpuActivity, gpu_model_name, write_dcgm, write_gateway
from pipeline.simulator.workload import PoolTraffic, generate_pool_traffic
from pricing import Kernel
from schemas.config import Pool, PoolsFile, Replica
from schemas.units import HOUR_NS, NS_PER_SECOND

DEFAULT_START = datetime(2026, 11, 30, tzinfo=UTC)
# Purposes of the seeded random streams.
_TRAFFIC, _ENGINE, _GATEWAY, _DCGM = range(4)


@dataclass(frozen=True)
class ReplicaSummary:
    pool: str
    replica: str
    hostname: str
    requests: int
    finished: int
    steps: int
    recorded_steps: int
    dropped_steps: int
    busy_fraction: float  # step time / span
    gpu_busy_fraction: float  # kernel time / span (what DCGM tracks)
    preemptions: int
    admission_blocked_steps: int
    prefix_hit_tokens: int
    mean_admission_lag_steps: float
    segments: int
    engine_version: str


# What a replica's summary repeats of its run under the same name.
_FROM_RUN = (
    "replica",
    "requests",
    "finished",
    "steps",
    "recorded_steps",
    "dropped_steps",
    "preemptions",
    "admission_blocked_steps",
    "prefix_hit_tokens",
    "mean_admission_lag_steps",
)


@dataclass(frozen=True)
class SimulationSummary:
    out_dir: Path
    start: datetime
    hours: float
    seed: int
    requests: int
    gateway_lines: int
    steps: int
    replicas: list[ReplicaSummary]
    # fault name -> what was done, naming the replica or file it hit.
    faults: dict[str, str] = field(default_factory=dict)


def _fault_targets(pools: PoolsFile, faults: dict[str, float | None]) -> tuple[str, str | None]:
    """(replica hit by single-replica faults, replica left idle by `idle-replica`)."""
    idle = None
    if "idle-replica" in faults:
        multi = [p for p in pools.pools if len(p.streams) > 1]
        if not multi:
            raise FaultError("fault 'idle-replica' needs a pool with more than one replica")
        idle = multi[0].streams[-1].id
    busy_pools = [p for p in pools.pools if p.workload is not None]
    target = busy_pools[0].streams[0].id if busy_pools else pools.pools[0].streams[0].id
    return target, idle


def _fault_value(faults: dict[str, float | None], name: str) -> float:
    value = faults[name]
    if value is None:
        raise ValueError(f"fault {name!r} needs a value")
    return value


def _replica_faults(
    replica: str, target: str, faults: dict[str, float | None], span_ns: int, notes: dict[str, str]
) -> ReplicaFaults:
    if replica != target:
        return ReplicaFaults()
    drop_window = None
    if "drop-records" in faults:
        fraction = _fault_value(faults, "drop-records")
        first = int(0.4 * span_ns)
        drop_window = (first, first + int(fraction * span_ns))
        notes["drop-records"] = (
            f"{replica}: steps starting {drop_window[0] / NS_PER_SECOND:.0f}-{drop_window[1] / NS_PER_SECOND:.0f} s "
            "into the span recorded as counted drops"
        )
    lost_window = _lost_window(faults, span_ns)
    if lost_window is not None:
        notes["missing-segments"] = (
            f"{replica}: the segments of steps starting {lost_window[0] / NS_PER_SECOND:.0f}-"
            f"{lost_window[1] / NS_PER_SECOND:.0f} s into the span are never delivered"
        )
    wall_rate = 1.0
    if "clock-skew" in faults:
        wall_rate = 1.0 - _fault_value(faults, "clock-skew") / 3600.0
        notes["clock-skew"] = (
            f"{replica}: wall clock runs slow by {faults['clock-skew']:g} s per hour"
        )
    wall_jump = None
    if "clock-jump" in faults:
        jump_s = faults["clock-jump"] or 0.0
        wall_jump = (span_ns // 2, round(jump_s * NS_PER_SECOND))
        notes["clock-jump"] = (
            f"{replica}: wall clock steps by {jump_s:+g} s at {span_ns / 2e9:.0f} s into the span"
        )
    stall = faults.get("host-stall") or 0.0
    if "host-stall" in faults:
        notes["host-stall"] = (
            f"{replica}: every step waits on the host for {stall:g} of its GPU time"
        )
    if "impossible-kv" in faults:
        notes["impossible-kv"] = (
            f"{replica}: the hook reports {faults['impossible-kv']:g} times each request's KV blocks"
        )
    version = ENGINE_VERSION
    if "new-engine-version" in faults:
        version = UNCALIBRATED_ENGINE_VERSION
        notes["new-engine-version"] = f"{replica}: reports engine version {version}"
    return ReplicaFaults(
        drop_window_ns=drop_window,
        lost_window_ns=lost_window,
        wall_rate=wall_rate,
        wall_jump=wall_jump,
        host_stall_fraction=stall,
        kv_factor=faults.get("impossible-kv") or 1.0,
        engine_version=version,
    )


def _lost_window(faults: dict[str, float | None], span_ns: int) -> tuple[int, int] | None:
    """Where the missing-head, -middle or -tail fault loses the replica's segments."""
    wanted = [name for name in ("missing-head", "missing-middle", "missing-tail") if name in faults]
    if not wanted:
        return None
    if len(wanted) > 1:
        raise FaultError(f"faults {wanted[0]!r} and {wanted[1]!r} cannot be combined")
    length = int(_fault_value(faults, wanted[0]) * span_ns)
    first = {"missing-head": 0, "missing-middle": int(0.4 * span_ns)}.get(
        wanted[0], span_ns - length
    )
    return first, first + length


def _unscrape(written: list[Path], pools: PoolsFile, target: str) -> str:
    """Remove the target replica's samples from the DCGM files (the other GPUs' stay as they
    were drawn); what was done."""
    (replica,) = [r for pool in pools.pools for r in pool.streams if r.id == target]
    labels = tuple(f'UUID="{uuid}"' for uuid in replica.gpu_uuids)
    for path in written:
        lines = path.read_text().splitlines(keepends=True)
        path.write_text(
            "".join(line for line in lines if not any(label in line for label in labels))
        )
    return f"{target}: no DCGM sample of its GPUs {', '.join(replica.gpu_uuids)}"


def _rng(seed: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([seed, *keys])


def _simulate_in_worker(pool: Pool, replica: Replica, job: dict[str, Any]) -> ReplicaRun:
    return simulate_replica(pool, replica, Kernel.build(pool.deployment()), **job)


def _check_arguments(out_dir: Path, hours: float, workers: int, start: datetime) -> None:
    if hours <= 0:
        raise ValueError(f"hours must be positive, got {hours}")
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if start.utcoffset() != timedelta(0):
        raise ValueError(f"start must be a UTC datetime, got {start!r}")
    if (start.minute, start.second, start.microsecond) != (0, 0, 0):
        raise ValueError(f"start must be on the hour, got {start.isoformat()}")
    layout = DataDir(out_dir)
    for existing in (layout.own_pools_file, layout.outbox, layout.gateway, layout.dcgm):
        if existing.exists():
            raise FileExistsError(f"{existing} exists: simulate into a new or empty directory")


@dataclass(frozen=True)
class _Plan:
    """What every replica is sent, before any is simulated."""

    span_ns: int
    target: str
    traffic: list[PoolTraffic]
    jobs: list[tuple[Pool, Replica, dict[str, Any]]]


def _plan(
    out_dir: Path,
    pools: PoolsFile,
    hours: float,
    seed: int,
    start: datetime,
    faults: dict[str, float | None],
    notes: dict[str, str],
) -> _Plan:
    span_ns = round(hours * HOUR_NS)
    start_wall_ns = int(start.timestamp()) * NS_PER_SECOND
    target, idle = _fault_targets(pools, faults)
    if idle is not None:
        notes["idle-replica"] = f"{idle}: receives no traffic"
    traffic: list[PoolTraffic] = []
    jobs: list[tuple[Pool, Replica, dict[str, Any]]] = []
    for pool_index, pool in enumerate(pools.pools):
        serving = [i for i, r in enumerate(pool.streams) if r.id != idle]
        pool_traffic = generate_pool_traffic(
            pool, span_ns, _rng(seed, pool_index, _TRAFFIC), serving_replicas=serving
        )
        traffic.append(pool_traffic)
        step_noise = pool.workload.step_noise if pool.workload is not None else 0.0
        for replica_index, replica in enumerate(pool.streams):
            mine = pool_traffic.replica == replica_index
            job = dict(
                request_ids=pool_traffic.request_ids[mine],
                arrival_ns=pool_traffic.arrival_ns[mine],
                prompt_tokens=pool_traffic.prompt_tokens[mine],
                output_tokens=pool_traffic.output_tokens[mine],
                feature=pool_traffic.feature[mine],
                prefix_tokens=pool_traffic.prefix_tokens,
                span_ns=span_ns,
                start_wall_ns=start_wall_ns,
                outbox=DataDir(out_dir).replica_outbox(replica.id),
                faults=_replica_faults(replica.id, target, faults, span_ns, notes),
                rng=_rng(seed, pool_index, _ENGINE, replica_index),
                step_noise=step_noise,
            )
            jobs.append((pool, replica, job))
    return _Plan(span_ns=span_ns, target=target, traffic=traffic, jobs=jobs)


def _run_replicas(
    plan: _Plan, pools: PoolsFile, workers: int, advance: Callable[[int], None]
) -> list[ReplicaRun]:
    if workers == 1:
        kernels = {pool.name: Kernel.build(pool.deployment()) for pool in pools.pools}
        return [
            simulate_replica(pool, replica, kernels[pool.name], progress=advance, **job)
            for pool, replica, job in plan.jobs
        ]
    # Replicas are independent and seeded on their own, so processes give the same data.
    with ProcessPoolExecutor(max_workers=workers) as executor:
        futures = [
            executor.submit(_simulate_in_worker, pool, replica, job)
            for pool, replica, job in plan.jobs
        ]
        for future in as_completed(futures):
            future.result()
            advance(plan.span_ns)
        return [future.result() for future in futures]


def _write_telemetry(
    out_dir: Path,
    pools: PoolsFile,
    plan: _Plan,
    run_of: dict[str, ReplicaRun],
    seed: int,
    start: datetime,
    faults: dict[str, float | None],
    notes: dict[str, str],
) -> int:
    """The gateway's and DCGM's files, and the faults applied after simulation; the gateway's
    line count."""
    gateway_lines = write_gateway(
        out_dir, plan.traffic, start, faults.get("missing-context") or 0.0, _rng(seed, _GATEWAY)
    )
    if "missing-context" in faults:
        notes["missing-context"] = f"{faults['missing-context']:g} of requests have no gateway line"
    activities = [
        GpuActivity(
            hostname=replica.hostname,
            gpu_uuids=list(replica.gpu_uuids),
            model_name=gpu_model_name(pool.gpu_type),
            busy_start_ns=run_of[replica.id].gpu_busy_start_ns,
            busy_end_ns=run_of[replica.id].gpu_busy_end_ns,
        )
        for pool in pools.pools
        for replica in pool.streams
    ]
    written = write_dcgm(out_dir, activities, start, plan.span_ns, _rng(seed, _DCGM))
    if "no-dcgm" in faults:
        notes["no-dcgm"] = _unscrape(written, pools, plan.target)
    if "sink-down" in faults:
        notes["sink-down"] = write_sink(out_dir, int(_fault_value(faults, "sink-down")))
    target_segments = sorted(run_of[plan.target].segments) if plan.target in run_of else []
    notes.update(damage_segments(out_dir, plan.target, target_segments, faults))
    return gateway_lines


def simulate(
    out_dir: Path,
    pools: PoolsFile,
    *,
    hours: float,
    seed: int,
    start: datetime = DEFAULT_START,
    faults: dict[str, float | None] | None = None,
    progress: Callable[[float, float], None] | None = None,
    workers: int = 1,
    rotate_seconds: float | None = None,
) -> SimulationSummary:
    """Simulate every replica of every pool for `hours` (fractions allowed) from `start` into `out_dir`.

    `faults` maps fault names (see `pipeline.simulator.faults`) to a value or None for the
    default. `progress(done, total)` is called in simulated replica-seconds. `workers` > 1
    simulates replicas in that many processes (progress then advances per finished replica).
    `rotate_seconds`: simulated time per segment (by default `replica.ROTATE_NS`), e.g. the
    recorder's `ROTATE_SECONDS` to replay a pool as the live path sees it.
    """
    out_dir = Path(out_dir)
    _check_arguments(out_dir, hours, workers, start)
    faults = {name: validate_fault(name, value) for name, value in (faults or {}).items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    DataDir(out_dir).own_pools_file.write_text(
        yaml.safe_dump(pools.model_dump(mode="json"), sort_keys=False)
    )
    notes: dict[str, str] = {}
    plan = _plan(out_dir, pools, hours, seed, start, faults, notes)
    if rotate_seconds is not None:
        for _, _, job in plan.jobs:
            job["rotate_ns"] = round(rotate_seconds * NS_PER_SECOND)
    total_s = plan.span_ns / NS_PER_SECOND * sum(len(p.streams) for p in pools.pools)
    done_s = 0.0

    def advance(ns: int) -> None:
        nonlocal done_s
        done_s += ns / NS_PER_SECOND
        if progress is not None:
            progress(done_s, total_s)

    replica_runs = _run_replicas(plan, pools, workers, advance)
    run_of = {replica.id: run for (_, replica, _), run in zip(plan.jobs, replica_runs, strict=True)}
    gateway_lines = _write_telemetry(out_dir, pools, plan, run_of, seed, start, faults, notes)
    replicas = [
        ReplicaSummary(
            pool=pool.name,
            hostname=replica.hostname,
            busy_fraction=run.busy_ns / plan.span_ns,
            gpu_busy_fraction=int((run.gpu_busy_end_ns - run.gpu_busy_start_ns).sum())
            / plan.span_ns,
            segments=len(run.segments),
            engine_version=job["faults"].engine_version,
            **{name: getattr(run, name) for name in _FROM_RUN},
        )
        for (pool, replica, job), run in zip(plan.jobs, replica_runs, strict=True)
    ]
    return SimulationSummary(
        out_dir=out_dir,
        start=start,
        hours=hours,
        seed=seed,
        requests=sum(len(t) for t in plan.traffic),
        gateway_lines=gateway_lines,
        steps=sum(r.steps for r in replicas),
        replicas=replicas,
        faults=notes,
    )
