"""A fleet simulator: realistic step logs, gateway context and DCGM samples for whole pools.

`simulate()` runs a continuous-batching engine per replica (`engine`), fed by per-feature
Poisson traffic (`workload`), timed by the pricing kernel and logged through the real
StepRecorder (`replica`), and writes the gateway and DCGM files production would deliver
(`telemetry`). Fault knobs (`faults`) damage a run in known ways for the reconciliation checks.
"""

from __future__ import annotations

from pipeline.simulator.faults import FAULTS, FaultError, parse_fault
from pipeline.simulator.run import DEFAULT_START, ReplicaSummary, SimulationSummary, simulate

__all__ = [
    "DEFAULT_START",
    "FAULTS",
    "FaultError",
    "ReplicaSummary",
    "SimulationSummary",
    "parse_fault",
    "simulate",
]
