"""The bytes the recorder writes for a fixed step sequence are pinned: encoder changes must not move a byte."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.hook.recorder import StepRecorder
from schemas.records import FRAME_PREFIX, PREAMBLE
from tests.helpers.steplog_samples import HEADER, MONO_ANCHOR, fixed_clocks

# SHA-256 of every segment's frames after its header frame, concatenated in shipping order.
PINNED_FRAMES_SHA256 = "992bf1207701867275e8db3835670e22179daf2d647bee087f6f17c2e4519ab9"
PINNED_SEGMENTS = 5


# Engines may report block counts as numpy integers, which the encoder takes as it takes an
# int (step_frame checks for int or np.integer) though record_step is annotated `int`.
NUMPY_TOTAL_BLOCKS: Any = np.int64(5000)


def _record_fixed_sequence(recorder: StepRecorder) -> None:
    """Steps of every shape the encoder meets: numpy arrays of several dtypes, plain lists,
    empty steps, holders, counted drops and one rejected step."""
    rng = np.random.default_rng(7)
    for step in range(60):
        if step % 17 == 5:
            recorder.drop_step()
            continue
        slots = 0 if step % 13 == 0 else int(rng.integers(1, 9))
        holders = int(rng.integers(0, 4))
        new_tokens = rng.integers(1, 40, slots).astype(np.int32 if step % 2 else np.int64)
        drafted = np.minimum(new_tokens, rng.integers(0, 5, slots))
        accepted = drafted // 2
        if step == 31:
            accepted = drafted + 1
        as_list = step % 3 == 0

        def column(values: np.ndarray, as_list: bool = as_list) -> list[Any] | np.ndarray:
            return values.tolist() if as_list else values

        recorder.record_step(
            MONO_ANCHOR + step * 1_000_003,
            MONO_ANCHOR + step * 1_000_003 + int(rng.integers(0, 900_000)),
            [f"req-{step}-{i}-{'é' * (i % 3)}" for i in range(slots)],
            column(new_tokens),
            column(rng.integers(0, 100_000, slots)),
            column(rng.random(slots) * 50.0 if step % 4 else rng.integers(0, 60, slots)),
            column(rng.integers(0, 4000, slots).astype(np.uint32)),
            column(rng.integers(0, 200, slots)),
            column(drafted),
            column(accepted),
            holder_ids=[f"hold-{step}-{i}" for i in range(holders)],
            holder_blocks=rng.random(holders) * 8.0,
            holder_states=["waiting"] * holders,
            admission_blocked=step % 5 == 0,
            free_blocks=int(rng.integers(0, 5000)),
            total_blocks=NUMPY_TOTAL_BLOCKS,
        )


def _frames_after_header(segment: Path) -> bytes:
    data = segment.read_bytes()
    header_start = PREAMBLE.size
    header_payload = FRAME_PREFIX.unpack_from(data, header_start)[4]
    return data[header_start + FRAME_PREFIX.size + header_payload :]


def test_fixed_sequence_encodes_to_pinned_bytes(tmp_path):
    with StepRecorder(
        tmp_path, HEADER, overflow="block", rotate_bytes=4096, **fixed_clocks()
    ) as recorder:
        _record_fixed_sequence(recorder)
    segments = recorder.shipped_segments
    frames = b"".join(_frames_after_header(segment) for segment in segments)
    assert recorder.rejected_steps == 1
    assert len(segments) == PINNED_SEGMENTS
    assert hashlib.sha256(frames).hexdigest() == PINNED_FRAMES_SHA256
