"""Fault knobs: damage the simulated run in one known way, so each reconciliation check can be
shown to catch it. Each is given as `NAME` or `NAME=VALUE`; faults aimed at one replica hit
the first replica of the first pool that has traffic (`idle-replica`: the last replica of the
first pool with more than one), and `SimulationSummary.faults` says exactly what was done.

drop-records[=FRACTION]      The recorder loses a burst of steps, as an overflowing buffer does
                             at peak: a window of FRACTION of the span (default 0.02), starting
                             40% in, is recorded as counted drops (`StepRecorder.drop_step`).
                             The sequence numbers are consumed and the steps' time is missing,
                             so the time check sees a shortfall.
torn-segment                 One segment file (the middle one of the replica) is truncated in
                             the middle of a frame, as a crash during a write would leave it.
duplicate-segment            One segment file is delivered a second time under another name.
clock-skew[=SECONDS]         The replica's wall clock runs slow by SECONDS per hour (default
                             36, i.e. 1%). Every segment re-reads the wall clock when it opens,
                             so consecutive segments' UTC ranges overlap and drift off the
                             true hour.
missing-context[=FRACTION]   FRACTION of requests (default 0.05) have no gateway line.
idle-replica                 One replica receives no traffic; it still reports DCGM samples.
host-stall[=FRACTION]        Every step of the replica waits on the host for FRACTION of its GPU
                             time (default 0.5) while the GPU is idle: the engine looks busy and
                             DCGM shows the GPU idle for that time.
new-engine-version           The replica's log reports an engine version with no calibration.
"""

from __future__ import annotations

from dataclasses import dataclass

# name -> (default value, name of the value or None when it takes none, one-line help)
FAULTS: dict[str, tuple[float | None, str | None, str]] = {
    "drop-records": (
        0.02,
        "FRACTION",
        "lose a burst of FRACTION of the span's steps as counted drops",
    ),
    "torn-segment": (None, None, "truncate one segment mid-frame"),
    "duplicate-segment": (None, None, "deliver one segment twice under another name"),
    "clock-skew": (36.0, "SECONDS", "a replica's wall clock runs slow by SECONDS per hour"),
    "missing-context": (0.05, "FRACTION", "FRACTION of requests have no gateway line"),
    "idle-replica": (None, None, "one replica gets no traffic"),
    "host-stall": (0.5, "FRACTION", "steps wait on the host for FRACTION of their GPU time"),
    "new-engine-version": (None, None, "the log reports an engine version with no calibration"),
}

# What a replica's engine reports normally, and under `new-engine-version`.
ENGINE_NAME = "vllm"
ENGINE_VERSION = "0.11.0"
UNCALIBRATED_ENGINE_VERSION = "0.12.0rc2"
DRIVER_VERSION = "570.172.08"


class FaultError(ValueError):
    """A fault knob is unknown or has a bad value; the message names it."""


def parse_fault(text: str) -> tuple[str, float | None]:
    """`NAME` or `NAME=VALUE` -> (name, value or the fault's default)."""
    name, sep, raw = text.partition("=")
    name = name.strip()
    if name not in FAULTS:
        raise FaultError(f"unknown fault {name!r}; known faults: {', '.join(FAULTS)}")
    default, value_name, _ = FAULTS[name]
    if not sep:
        return name, default
    if value_name is None:
        raise FaultError(f"fault {name!r} takes no value (got {raw!r})")
    try:
        value = float(raw)
    except ValueError as err:
        raise FaultError(f"fault {name!r}: value {raw!r} is not a number") from err
    return name, validate_fault(name, value)


def validate_fault(name: str, value: float | None) -> float | None:
    if name not in FAULTS:
        raise FaultError(f"unknown fault {name!r}; known faults: {', '.join(FAULTS)}")
    default, value_name, _ = FAULTS[name]
    if value is None or value_name is None:
        return default
    if name in ("drop-records", "missing-context") and not 0.0 < value <= 1.0:
        raise FaultError(f"fault {name!r}: fraction {value} must be in (0, 1]")
    if name == "host-stall" and value <= 0.0:
        raise FaultError(f"fault {name!r}: fraction {value} must be positive")
    if name == "clock-skew" and not 0.0 < value < 3600.0:
        raise FaultError(f"fault {name!r}: {value} seconds per hour must be in (0, 3600)")
    return value


@dataclass(frozen=True)
class ReplicaFaults:
    """The faults that act while one replica is simulated."""

    drop_window_ns: tuple[int, int] | None = None  # steps starting in [a, b) are dropped
    wall_rate: float = 1.0  # wall-clock seconds per true second
    host_stall_fraction: float = 0.0
    engine_version: str = ENGINE_VERSION
