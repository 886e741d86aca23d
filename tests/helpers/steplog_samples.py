"""The sample segment header, fixed clocks and frame walker shared by the step-log tests and
the hardening tests (which also fuzz these segments)."""

from __future__ import annotations

from pipeline.steplog import SegmentHeader
from schemas.records import FRAME_PREFIX, PREAMBLE

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


def fixed_clocks() -> dict:
    return {"mono_clock": lambda: MONO_ANCHOR, "wall_clock": lambda: WALL_ANCHOR}


def frame_spans(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of every frame after the preamble of an intact segment, from the length fields."""
    spans, pos = [], PREAMBLE.size
    while pos < len(data):
        length = FRAME_PREFIX.unpack_from(data, pos)[4]
        spans.append((pos, pos + FRAME_PREFIX.size + length))
        pos = spans[-1][1]
    return spans
