"""The hours the tests are set in."""

from __future__ import annotations

from pipeline.attribution.synthetic import HOUR as SYNTHETIC_HOUR
from pipeline.simulator.run import DEFAULT_START

# The hour of the hand-built tables and logs, the synthetic log's.
HOUR = SYNTHETIC_HOUR
# The first hour of a simulation (the simulator starts there unless told otherwise).
SIMULATED_HOUR = DEFAULT_START
