"""The sample segment header, fixed clocks and frame walker shared by the step-log tests and
the hardening tests (which also fuzz these segments)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypedDict

from pipeline.hook.recorder import StepRecorder
from schemas.records import FRAME_PREFIX, PREAMBLE, SegmentHeader

HEADER = SegmentHeader(
    pool="chat-8b",
    replica="chat-8b-r0",
    engine_name="vllm",
    engine_version="0.11.0",
    driver_version="550.54.15",
    model="llama-3.1-8b-instruct",
    gpu_type="h100",
    gpus_per_replica=1,
    kv_block_size=16,
)
MONO_ANCHOR = 5_000_000_000
# 2026-11-30T05:00:00Z
WALL_ANCHOR = 1_796_014_800_000_000_000


class Clocks(TypedDict):
    """A StepRecorder's clocks, as keyword arguments."""

    mono_clock: Callable[[], int]
    wall_clock: Callable[[], int]


def fixed_clocks() -> Clocks:
    return {"mono_clock": lambda: MONO_ANCHOR, "wall_clock": lambda: WALL_ANCHOR}


def record_numbered_steps(
    recorder: StepRecorder,
    first: int,
    count: int,
    *,
    request_ids: Callable[[int], list[str]] = lambda step: [f"req-{step}-a", f"req-{step}-ü"],
    blocked: Callable[[int], bool] = lambda step: step % 2 == 1,
) -> None:
    """Record `count` steps from step number `first`, two slots and one holder each, every value
    derived from the step number; the request ids and `admission_blocked` are functions of it
    too."""
    for step in range(first, first + count):
        recorder.record_step(
            MONO_ANCHOR + step * 1000,
            MONO_ANCHOR + step * 1000 + 700,
            request_ids(step),
            [step + 1, 1],
            [step * 10, 5],
            [0.5, 1.25],
            [100, 7],
            [16, 0],
            [1, 0],
            [1, 0],
            holder_ids=[f"wait-{step}"],
            holder_blocks=[3.0],
            holder_states=["waiting"],
            admission_blocked=blocked(step),
            free_blocks=100 - step % 100,
            total_blocks=100,
        )


def complete_frames(data: bytes) -> int:
    """Frames of a segment's bytes that end before the file does (a torn last one excluded)."""
    count, pos = 0, PREAMBLE.size
    while pos + FRAME_PREFIX.size <= len(data):
        pos += FRAME_PREFIX.size + FRAME_PREFIX.unpack_from(data, pos)[4]
        count += pos <= len(data)
    return count


def frame_spans(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of every frame after the preamble of an intact segment, from the length fields."""
    spans, pos = [], PREAMBLE.size
    while pos < len(data):
        length = FRAME_PREFIX.unpack_from(data, pos)[4]
        spans.append((pos, pos + FRAME_PREFIX.size + length))
        pos = spans[-1][1]
    return spans
