"""Fixtures shared across the suite; the helpers they use are in tests/helpers/."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from pipeline.hook.recorder import StepRecorder
from schemas.records import SegmentHeader
from tests.helpers.children import stop_leftovers
from tests.helpers.fleets import simulate_small
from tests.helpers.steplog_samples import HEADER, Clocks, fixed_clocks, record_numbered_steps

# Property tests try the same examples on every run, and neither an example nor the generation
# of examples has a time limit: a loaded machine makes any of them slow, and a failure must not
# depend on the run's seed or its load.
settings.register_profile(
    "deterministic",
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("deterministic")


@pytest.fixture(scope="module", autouse=True)
def no_child_left_running() -> Iterator[None]:
    """Every process a test module starts is stopped by it: one still running once the module's
    tests are done fails the module's last test, and is stopped here so that it cannot disturb
    the modules after it."""
    yield
    leftovers = stop_leftovers()
    if leftovers:
        pytest.fail("child processes left running: " + "; ".join(leftovers), pytrace=False)


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small fleet simulated for three minutes from the first simulated hour."""
    return simulate_small(tmp_path_factory.mktemp("sim") / "run")


@pytest.fixture(scope="session")
def header() -> SegmentHeader:
    return HEADER


@pytest.fixture(scope="session")
def clocks() -> Clocks:
    return fixed_clocks()


@pytest.fixture(scope="session")
def record_steps():
    return record_numbered_steps


@pytest.fixture
def write_segment(tmp_path: Path):
    """Write `count` simple steps through a real recorder; returns the shipped segment paths."""

    def write(count: int = 3, outbox: Path | None = None, **options) -> list[Path]:
        outbox = outbox or tmp_path / "outbox"
        with StepRecorder(
            outbox, HEADER, overflow="block", **{**fixed_clocks(), **options}
        ) as recorder:
            record_numbered_steps(recorder, 0, count)
        return recorder.shipped_segments

    return write
