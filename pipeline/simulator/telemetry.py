"""What the pipeline reads beside the step log: DCGM exporter scrapes and the gateway's context log.

DCGM: one file per host and UTC hour, `dcgm/<hostname>/<YYYY-MM-DDTHH>.prom`, in Prometheus text
exposition format with an explicit millisecond timestamp per sample. Every GPU of every
replica on the host reports `DCGM_FI_PROF_GR_ENGINE_ACTIVE` every 15 s (each host's scrapes
at its own phase). A reading is the fraction of the preceding scrape interval the GPU spent
running the engine's kernels, plus Gaussian sampling noise, clipped to [0, 1]: exporters
publish the latest instantaneous reading, so an hourly mean matches the engine's busy time
only within a band. Host waits inside a step are not GPU activity.

Gateway: one JSON object per request in `gateway/<YYYY-MM-DDTHH>.jsonl`, filed by the hour
the gateway received it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import polars as pl

from pipeline.datadir import DataDir
from pipeline.simulator.workload import RETRY_CAUSES, PoolTraffic
from schemas.units import HOUR_NS, NS_PER_SECOND, hour_key

SCRAPE_INTERVAL_NS = 15_000_000_000
DCGM_METRIC = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
DCGM_NOISE = 0.02
# The exporter's `modelName` label per pool GPU type.
GPU_MODEL_NAMES = {
    "h100": "NVIDIA H100 80GB HBM3",
    "h200": "NVIDIA H200",
    "a100": "NVIDIA A100-SXM4-80GB",
    "a100-80": "NVIDIA A100-SXM4-80GB",
    "b200": "NVIDIA B200",
    "l40s": "NVIDIA L40S",
}


def gpu_model_name(gpu_type: str) -> str:
    return GPU_MODEL_NAMES.get(gpu_type.lower(), f"NVIDIA {gpu_type.upper()}")


@dataclass(frozen=True)
class GpuActivity:
    """One replica's GPUs on a host, and when they ran kernels (ns since the span start)."""

    hostname: str
    gpu_uuids: list[str]
    model_name: str
    busy_start_ns: np.ndarray  # int64, sorted, non-overlapping
    busy_end_ns: np.ndarray


def busy_between(
    busy_start_ns: np.ndarray,
    busy_end_ns: np.ndarray,
    window_start_ns: np.ndarray,
    window_end_ns: np.ndarray,
) -> np.ndarray:
    """Busy ns inside each window [start, end), for sorted non-overlapping busy intervals."""
    if busy_start_ns.shape[0] == 0:
        return np.zeros(window_start_ns.shape[0], np.int64)
    durations = busy_end_ns - busy_start_ns
    # cumulative[i]: busy ns of all intervals before interval i.
    cumulative = np.concatenate([[0], np.cumsum(durations)])

    def busy_before(moment: np.ndarray) -> np.ndarray:
        started = np.searchsorted(busy_start_ns, moment, side="right")
        last = np.maximum(started - 1, 0)
        partial = np.clip(moment - busy_start_ns[last], 0, durations[last])
        busy: np.ndarray = np.where(started > 0, cumulative[last] + partial, 0)
        return busy

    inside: np.ndarray = busy_before(window_end_ns) - busy_before(window_start_ns)
    return inside


def write_dcgm(
    out_dir: Path,
    activities: list[GpuActivity],
    start: datetime,
    span_ns: int,
    rng: np.random.Generator,
) -> list[Path]:
    """Write every host's scrapes over the span; returns the files written."""
    by_host: dict[str, list[GpuActivity]] = {}
    for activity in activities:
        by_host.setdefault(activity.hostname, []).append(activity)
    start_ms = int(start.timestamp() * 1000)
    written: list[Path] = []
    for hostname in sorted(by_host):
        phase_ns = int(rng.integers(NS_PER_SECOND, SCRAPE_INTERVAL_NS))
        scrape_ns = np.arange(phase_ns, span_ns, SCRAPE_INTERVAL_NS, dtype=np.int64)
        window_start = np.maximum(scrape_ns - SCRAPE_INTERVAL_NS, 0)
        lines_per_scrape: list[np.ndarray] = []
        gpu_index = 0
        for activity in by_host[hostname]:
            busy = busy_between(
                activity.busy_start_ns, activity.busy_end_ns, window_start, scrape_ns
            )
            fraction = busy / (scrape_ns - window_start)
            for uuid in activity.gpu_uuids:
                reading = np.clip(
                    fraction + rng.normal(0.0, DCGM_NOISE, scrape_ns.shape[0]), 0.0, 1.0
                )
                labels = (
                    f'{DCGM_METRIC}{{gpu="{gpu_index}",UUID="{uuid}",Hostname="{hostname}",'
                    f'modelName="{activity.model_name}"}} '
                )
                timestamps = start_ms + scrape_ns // 1_000_000
                lines_per_scrape.append(
                    np.array(
                        [
                            f"{labels}{value:.6f} {ms}"
                            for value, ms in zip(
                                reading.tolist(), timestamps.tolist(), strict=False
                            )
                        ],
                        dtype=object,
                    )
                )
                gpu_index += 1
        # One block per scrape, GPUs in order, as an exporter serves them.
        lines = np.stack(lines_per_scrape, axis=1) if lines_per_scrape else np.zeros((0, 0), object)
        hour_of_scrape = scrape_ns // HOUR_NS
        host_dir = DataDir(out_dir).dcgm / hostname
        host_dir.mkdir(parents=True, exist_ok=True)
        for hour in np.unique(hour_of_scrape).tolist():
            rows = lines[hour_of_scrape == hour]
            header = (
                f"# HELP {DCGM_METRIC} Ratio of time the graphics engine is active.\n"
                f"# TYPE {DCGM_METRIC} gauge\n"
            )
            path = host_dir / f"{hour_key(start + timedelta(hours=hour))}.prom"
            path.write_text(header + "\n".join(rows.ravel().tolist()) + "\n")
            written.append(path)
    return written


def write_gateway(
    out_dir: Path,
    traffic: list[PoolTraffic],
    start: datetime,
    missing_fraction: float,
    rng: np.random.Generator,
) -> int:
    """Write the gateway context of every request, leaving out `missing_fraction` of them at
    random; returns the number of lines written."""
    start_ns = int(start.timestamp()) * NS_PER_SECOND
    frames = []
    for pool in traffic:
        if not len(pool):
            continue
        tenants = np.array(pool.feature_tenants, dtype=object)[pool.feature]
        features = np.array(pool.feature_names, dtype=object)[pool.feature]
        retry_of = pool.request_ids[np.maximum(pool.retry_of, 0)].astype(object)
        retry_of[pool.retry_of < 0] = None
        causes = np.array((*RETRY_CAUSES, None), dtype=object)[pool.retry_cause]
        received = (start_ns + pool.received_ns).astype("datetime64[ns]")
        frames.append(
            pl.DataFrame(
                {
                    "request_id": pool.request_ids.tolist(),
                    "tenant": tenants.tolist(),
                    "feature": features.tolist(),
                    "api_key": pool.api_key.tolist(),
                    "retry_of": retry_of.tolist(),
                    "retry_cause": causes.tolist(),
                    "received_at": [
                        s + "Z" for s in np.datetime_as_string(received, unit="us").tolist()
                    ],
                    "hour": (pool.received_ns // HOUR_NS).tolist(),
                    "received_ns": pool.received_ns.tolist(),
                },
                schema_overrides={"retry_of": pl.String, "retry_cause": pl.String},
            )
        )
    if not frames:
        return 0
    lines = pl.concat(frames).sort("received_ns", maintain_order=True)
    if missing_fraction > 0:
        lines = lines.filter(pl.Series(rng.random(lines.height) >= missing_fraction))
    gateway_dir = DataDir(out_dir).gateway
    gateway_dir.mkdir(parents=True, exist_ok=True)
    for (hour,), part in lines.group_by("hour", maintain_order=True):
        path = gateway_dir / f"{hour_key(start + timedelta(hours=hour))}.jsonl"
        part.drop("hour", "received_ns").write_ndjson(path)
    return lines.height
