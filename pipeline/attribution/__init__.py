"""Attribution core: measured steps split exactly among requests, in integer nano-dollars."""

from __future__ import annotations

from pipeline.attribution.allocator import (
    AllocationError,
    BlendedSplit,
    GroupedRows,
    allocate_step,
    blend_and_allocate,
    largest_remainder,
    split_compute_kv,
    step_total_units,
)
from pipeline.attribution.calibration import (
    CalibrationEntry,
    CalibrationError,
    CalibrationMissing,
    CalibrationStore,
    FitResult,
    calibration_coverage,
    fit_coefficients,
    relative_drift,
    weights_for_log,
)
from pipeline.attribution.clock import cumulative_nano, step_costs_in_hour
from pipeline.attribution.hour import (
    LEDGER_LINE_SCHEMA,
    REPLICA_FACTS_SCHEMA,
    REQUEST_COST_SCHEMA,
    HourAttribution,
    attribute_hour,
    idle_lines,
)
from pipeline.attribution.kv import alpha_for_period
from pipeline.attribution.layout import AttributionError
from pipeline.attribution.workmodel import (
    Coefficients,
    FittedWeights,
    KernelWeights,
    SlotBatch,
    WeightSource,
    fitted_work_ms,
    kernel_work_us,
)

__all__ = [
    "LEDGER_LINE_SCHEMA",
    "REPLICA_FACTS_SCHEMA",
    "REQUEST_COST_SCHEMA",
    "AllocationError",
    "AttributionError",
    "BlendedSplit",
    "CalibrationEntry",
    "CalibrationError",
    "CalibrationMissing",
    "CalibrationStore",
    "Coefficients",
    "FitResult",
    "FittedWeights",
    "GroupedRows",
    "HourAttribution",
    "KernelWeights",
    "SlotBatch",
    "WeightSource",
    "allocate_step",
    "alpha_for_period",
    "attribute_hour",
    "blend_and_allocate",
    "calibration_coverage",
    "cumulative_nano",
    "fit_coefficients",
    "fitted_work_ms",
    "idle_lines",
    "kernel_work_us",
    "largest_remainder",
    "relative_drift",
    "split_compute_kv",
    "step_costs_in_hour",
    "step_total_units",
    "weights_for_log",
]
