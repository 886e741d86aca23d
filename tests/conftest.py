"""Fixtures shared across the suite; the helpers they use are in tests/helpers/."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.steplog import SegmentHeader, StepRecorder
from tests.helpers.fleets import simulate_small
from tests.helpers.steplog_samples import HEADER, MONO_ANCHOR, fixed_clocks


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small fleet simulated for three minutes from the first simulated hour."""
    return simulate_small(tmp_path_factory.mktemp("sim") / "run")


def record_simple(recorder: StepRecorder, seq_start: int, count: int) -> None:
    """Record `count` two-slot steps with one holder; values derived from the step number."""
    for step in range(seq_start, seq_start + count):
        recorder.record_step(
            MONO_ANCHOR + step * 1000,
            MONO_ANCHOR + step * 1000 + 700,
            [f"req-{step}-a", f"req-{step}-ü"],
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
            admission_blocked=step % 2 == 1,
            free_blocks=100 - step % 100,
            total_blocks=100,
        )


@pytest.fixture(scope="session")
def header() -> SegmentHeader:
    return HEADER


@pytest.fixture(scope="session")
def clocks() -> dict:
    return fixed_clocks()


@pytest.fixture(scope="session")
def record_steps():
    return record_simple


@pytest.fixture
def write_segment(tmp_path: Path):
    """Write `count` simple steps through a real recorder; returns the shipped segment paths."""

    def write(count: int = 3, outbox: Path | None = None, **options) -> list[Path]:
        outbox = outbox or tmp_path / "outbox"
        with StepRecorder(
            outbox, HEADER, overflow="block", **{**fixed_clocks(), **options}
        ) as recorder:
            record_simple(recorder, 0, count)
        return recorder.shipped_segments

    return write
