"""What a check reads about one pool-hour, gathered once (`pipeline.reconcile.hour`), and the
protocol every check follows: the hour's facts in, its results out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

import polars as pl

from pipeline.reconcile.result import CheckResult
from schemas.config import Pool, Settings

# (model, gpu_type, engine_version, driver_version): what a calibration fit is valid for.
CalibrationKey = tuple[str, str, str, str]


@dataclass(frozen=True)
class CalibrationFacts:
    """What the calibration checks compare: the hour's segments (their headers name the
    versions), the calibration store's keys, the engine release the pricing kernel was measured
    on, and for a fitted-weights pool the stored and the fresh fit (coefficient name -> value),
    both None when there is no fit to compare."""

    segments: pl.DataFrame
    known_keys: Sequence[CalibrationKey]
    kernel_engine_version: str | None
    stored_fit: Mapping[str, float] | None
    fresh_fit: Mapping[str, float] | None


@dataclass(frozen=True)
class HourFacts:
    """Everything the checks read about one pool-hour (`hour` aware UTC, on the hour).

    `steps` (STEPS): the pool's steps of the hour's lake partition. `drops`, `damage`,
    `segments`, `clock_jumps`: the warehouse's rows for the pool's replicas. `last_seq_before`:
    each replica's last sequence number before the hour. `invoices`, `ledger_lines`: the
    warehouse's rows of the pool-hour. `dcgm`: the hour's DCGM samples. `kv_held`: `replica`, `seq`
    and the KV blocks each step's requests hold (`plausibility.kv_held_by_step`). `elsewhere`: `replica`,
    `seq` and `hour` (key) of the pool's steps in hours not attributed yet.
    """

    hour: datetime
    pool: Pool
    settings: Settings
    steps: pl.DataFrame
    drops: pl.DataFrame
    damage: pl.DataFrame
    segments: pl.DataFrame
    clock_jumps: pl.DataFrame
    last_seq_before: Mapping[str, int]
    invoices: pl.DataFrame
    ledger_lines: pl.DataFrame
    dcgm: pl.DataFrame
    kv_held: pl.DataFrame
    elsewhere: pl.DataFrame
    calibration: CalibrationFacts


class Check(Protocol):
    """A reconciliation check: one result per replica or for the pool, from the hour's facts."""

    def __call__(self, facts: HourFacts) -> list[CheckResult]:
        """The check's results of the pool-hour the facts describe."""
