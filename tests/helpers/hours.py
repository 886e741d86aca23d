"""The hours the tests are set in."""

from __future__ import annotations

from datetime import UTC, datetime

from pipeline.simulator.run import DEFAULT_START

# The hour of the hand-built tables and logs.
HOUR = datetime(2026, 11, 30, 5, tzinfo=UTC)
# The first hour of a simulation (the simulator starts there unless told otherwise).
SIMULATED_HOUR = DEFAULT_START
