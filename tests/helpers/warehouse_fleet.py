"""A small, fully known fleet written through the real StepRecorder, for warehouse tests."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path

from pipeline.hook.recorder import StepRecorder
from schemas.config import Pool
from schemas.records import SegmentHeader

NS = 1_000_000_000


def write_replica_log(
    outbox: Path,
    pool: Pool,
    replica: str,
    *,
    start: datetime,
    steps: int,
    step_ns: int,
    gap_ns: int,
    requests: list[str],
    rotate_seconds: float = 600.0,
    first_seq: int = 0,
    mono_start_ns: int = 10 * NS,
    prompt_tokens: int = 100,
    kv_blocks: float = 7.0,
    drop_at: int | None = None,
) -> list[Path]:
    """Log `steps` equal steps from `start` (monotonic clock `mono_start_ns`: a later log of the
    same replica continues its clock), numbered from `first_seq`, each batching every
    request of `requests` (decode slots of `prompt_tokens`-token prompts holding `kv_blocks`
    blocks, the context growing from `prompt_tokens` by one a step); before step `drop_at` the
    recorder counts one dropped step; segments rotate every `rotate_seconds`."""
    directory = outbox / replica
    directory.mkdir(parents=True, exist_ok=True)
    clock = {"mono": mono_start_ns}
    wall_offset = int(start.timestamp() * NS) - clock["mono"]
    header = SegmentHeader(
        pool=pool.name,
        replica=replica,
        engine_name="vllm",
        engine_version="0.11.0",
        driver_version="570.86",
        model=pool.model,
        gpu_type=pool.gpu_type,
        gpus_per_replica=pool.gpus_per_replica,
        kv_block_size=pool.kv_block_size,
    )
    recorder = StepRecorder(
        directory,
        header,
        overflow="block",
        rotate_seconds=rotate_seconds,
        mono_clock=lambda: clock["mono"],
        wall_clock=lambda: clock["mono"] + wall_offset,
        first_seq=first_seq,
    )
    with recorder:
        for index in range(steps):
            if index == drop_at:
                recorder.drop_step()
            begin = clock["mono"]
            clock["mono"] = begin + step_ns
            n = len(requests)
            recorder.record_step(
                begin,
                begin + step_ns,
                list(requests),
                [1] * n,
                [prompt_tokens + index] * n,
                [kv_blocks] * n,
                [prompt_tokens] * n,
                [0] * n,
                [0] * n,
                [0] * n,
                free_blocks=1000,
                total_blocks=2000,
            )
            clock["mono"] += gap_ns
    return sorted(directory.glob("*.seg"))


def write_gateway(gateway: Path, hour: datetime, rows: list[tuple[str, str, str, str]]) -> Path:
    """(request_id, tenant, feature, api_key) rows into the hour's gateway file."""
    gateway.mkdir(parents=True, exist_ok=True)
    path = gateway / f"{hour:%Y-%m-%dT%H}.jsonl"
    received = (hour + timedelta(seconds=1)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    path.write_text(
        "".join(
            json.dumps(
                {
                    "request_id": r,
                    "tenant": t,
                    "feature": f,
                    "api_key": k,
                    "retry_of": None,
                    "retry_cause": None,
                    "received_at": received,
                }
            )
            + "\n"
            for r, t, f, k in rows
        )
    )
    return path
