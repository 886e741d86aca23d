"""Step log: StepRecorder cost on the engine thread, the writer thread's encoding cost, and
decoder throughput.

The recorder is timed per call with its writer thread running, at an engine-like cadence
(the engine sleeps between steps the way it waits on the GPU, which is when the writer
works). The encoder is timed on the batches the writer encodes at once, with the columns as
the vLLM adapter passes them. The decoder is timed on segments written by the real recorder.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.figure import Figure
from pipeline.hook.format import step_frames
from pipeline.hook.recorder import ENCODE_BATCH_STEPS, StepRecorder
from pipeline.ingestion.decoder import read_segments
from schemas.records import SLOT_COLUMNS
from tests.helpers.steplog_samples import HEADER

SLOTS_PER_STEP = 256
# Seconds between steps: a short engine step, so the writer is busy as often as it ever is.
STEP_INTERVAL = 0.0005


def _step_arguments(rng: np.random.Generator, step: int) -> tuple[Any, ...]:
    n = SLOTS_PER_STEP
    request_ids = [f"cmpl-{step % 997:04d}-{slot:03d}-5f1c2a10" for slot in range(n)]
    new_tokens = rng.integers(1, 64, n)
    drafted = np.minimum(rng.integers(0, 4, n), new_tokens)
    return (
        request_ids,
        new_tokens,
        rng.integers(0, 4096, n),
        rng.random(n) * 64,
        rng.integers(1, 4096, n),
        np.zeros(n, np.int64),
        drafted,
        drafted // 2,
    )


def _recorder_figures(quick: bool, outbox: Path) -> list[Figure]:
    rng = np.random.default_rng(7)
    steps = 1500 if quick else 15000
    inputs = [_step_arguments(rng, step) for step in range(64)]
    durations = np.empty(steps, np.int64)
    holder_ids = ["cmpl-waiting-0001", "cmpl-waiting-0002"]
    with StepRecorder(outbox, HEADER) as recorder:
        for step in range(steps):
            arguments = inputs[step % len(inputs)]
            began = time.perf_counter_ns()
            recorder.record_step(
                step * 1000,
                step * 1000 + 900,
                *arguments,
                holder_ids=holder_ids,
                holder_blocks=[3.0, 5.5],
                holder_states=["waiting", "waiting"],
                free_blocks=100,
                total_blocks=6000,
            )
            durations[step] = time.perf_counter_ns() - began
            time.sleep(STEP_INTERVAL)
    return [
        Figure("recorder_step_us_median", float(np.median(durations)) / 1e3, "us", 20, "max"),
        Figure("recorder_step_us_p99", float(np.percentile(durations, 99)) / 1e3, "us", 100, "max"),
    ]


def _encoder_figures(quick: bool) -> list[Figure]:
    rng = np.random.default_rng(13)
    batch = []
    for step in range(ENCODE_BATCH_STEPS):
        ids, *counts = _step_arguments(rng, step)
        # The adapter's columns: lists, but the KV blocks it computes with numpy.
        columns = [
            values if name == "kv_blocks" else values.tolist()
            for name, values in zip(SLOT_COLUMNS, counts, strict=True)
        ]
        holders = (
            ["cmpl-waiting-0001", "cmpl-waiting-0002"],
            np.array([3.0, 5.5]),
            ["waiting"] * 2,
        )
        batch.append(
            (step, step * 1000, step * 1000 + 900, ids, *columns, *holders, False, 100, 6000)
        )
    durations = []
    for _ in range(5 if quick else 40):
        began = time.perf_counter_ns()
        frames = step_frames(batch)
        durations.append(time.perf_counter_ns() - began)
    if not all(isinstance(frame, bytes) for frame in frames):
        raise RuntimeError("the encoder benchmark's steps were rejected")
    per_step = float(np.median(durations)) / len(batch)
    # A GPU decodes a 256-request batch in tens of milliseconds: at 200 us a step, the writer
    # holds the interpreter lock for about 1% of the engine's time.
    return [Figure("encode_step_us_median", per_step / 1e3, "us", 200, "max")]


def _decoder_figures(quick: bool, outbox: Path) -> list[Figure]:
    rng = np.random.default_rng(11)
    steps = 1000 if quick else 10000
    inputs = [_step_arguments(rng, step) for step in range(64)]
    with StepRecorder(outbox, HEADER, overflow="block", rotate_bytes=16 << 20) as recorder:
        for step in range(steps):
            recorder.record_step(step * 1000, step * 1000 + 900, *inputs[step % len(inputs)])
    paths = sorted(outbox.glob("*.seg"))
    total_bytes = sum(p.stat().st_size for p in paths)
    best = float("inf")
    for _ in range(3 if quick else 5):
        began = time.perf_counter()
        decoded = read_segments(paths)
        best = min(best, time.perf_counter() - began)
    rows = decoded.slots.num_rows
    if rows != steps * SLOTS_PER_STEP or decoded.damage.num_rows:
        raise RuntimeError(
            f"decoder benchmark read {rows} slot rows and {decoded.damage.num_rows} damage rows"
        )
    return [
        Figure("decode_slot_rows_per_s", rows / best, "rows/s", 5e6, "min"),
        Figure("decode_mb_per_s", total_bytes / best / 1e6, "MB/s", 0, "min"),
    ]


def figures(quick: bool) -> list[Figure]:
    with (
        tempfile.TemporaryDirectory() as recorder_dir,
        tempfile.TemporaryDirectory() as decoder_dir,
    ):
        return (
            _recorder_figures(quick, Path(recorder_dir))
            + _encoder_figures(quick)
            + _decoder_figures(quick, Path(decoder_dir))
        )
