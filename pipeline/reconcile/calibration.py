"""The calibration checks: coefficients for the engine and driver versions in the log
(`calibration`) and, for a fitted-weights pool, the drift of a fresh fit (`calibration_drift`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Any

import polars as pl

from pipeline.attribution.calibration import CalibrationError, CalibrationStore, fit_coefficients
from pipeline.reconcile.facts import CalibrationFacts, CalibrationKey, HourFacts
from pipeline.reconcile.findings import (
    DRIFT,
    KERNEL_DRIFT,
    MISSING,
    NEW_ENGINE_VERSION,
    STALE,
    Finding,
)
from pipeline.reconcile.result import CheckResult, fold
from pipeline.storage.lake import HourInput
from pricing import load_chip
from schemas.config import Pool, Settings

_KEY_COLUMNS = ["model", "gpu_type", "engine_version", "driver_version"]


def run(facts: HourFacts) -> list[CheckResult]:
    """The calibration checks of the gathered pool-hour."""
    calibration = facts.calibration
    return check_calibration(
        facts.hour,
        facts.pool,
        calibration.segments,
        calibration.known_keys,
        facts.settings,
        kernel_engine_version=calibration.kernel_engine_version,
        stored_fit=calibration.stored_fit,
        fresh_fit=calibration.fresh_fit,
    )


def calibration_facts(
    pool: Pool, segments: pl.DataFrame, data: HourInput, store: CalibrationStore
) -> CalibrationFacts:
    """What the calibration checks of one pool-hour compare: the segments (of the pool's
    `segments`) the hour's steps came from, against the calibration `store` and the engine
    release the pricing kernel's chip coefficients were measured on.

    For a fitted-weights pool the hour's own steps are fitted afresh and compared with the
    stored fit of the version that logged most of them. Kernel-weights pools get no fit:
    their charges do not use it, and a linear fit's coefficients move with the workload's
    batch mix (a few minutes' sweep against a busy hour differ by over 10%), which would only
    warn about traffic."""
    segments = segments.filter(
        pl.col("segment_id").is_in(data.steps["segment_id"].unique().implode())
    )
    versions = (
        segments.group_by(_KEY_COLUMNS)
        .agg(pl.col("steps").sum(), pl.col("segment_id"))
        .sort("steps", *_KEY_COLUMNS, descending=[True, False, False, False, False])
    )
    stored_fit = fresh_fit = None
    # Fit only the steps of the version that logged most of the hour among those with a
    # stored fit: other versions' steps would blur the fresh fit.
    calibrated = pool.policies.weights == "fitted" and next(
        (
            (version, stored)
            for version in versions.iter_rows(named=True)
            if (stored := store.lookup(*(version[c] for c in _KEY_COLUMNS))) is not None
        ),
        None,
    )
    if calibrated:
        version, stored = calibrated
        steps = data.steps.filter(pl.col("segment_id").is_in(version["segment_id"]))
        slots = data.slots.join(steps.select("replica", "seq"), on=["replica", "seq"], how="semi")
        try:
            fresh = fit_coefficients(steps, slots).coefficients
        except CalibrationError:
            pass  # too few or too uniform steps in the hour to fit: no drift to measure
        else:
            stored_fit, fresh_fit = (
                {n: getattr(c, n) for n in ("c0_ms", "a_ms", "b_ms")} for c in (stored, fresh)
            )
    return CalibrationFacts(
        segments,
        [entry.key for entry in store.entries],
        load_chip(pool.gpu_type).measured_engine.version,
        stored_fit,
        fresh_fit,
    )


def check_calibration(
    hour: datetime,
    pool: Pool,
    segments: pl.DataFrame,
    known_keys: Collection[CalibrationKey],
    settings: Settings,
    *,
    kernel_engine_version: str | None = None,
    stored_fit: Mapping[str, float] | None = None,
    fresh_fit: Mapping[str, float] | None = None,
) -> list[CheckResult]:
    """Coefficients for the engine and driver versions in the log, and drift of a fresh fit.

    `segments` (SEGMENTS): the hour's segments (other pools ignored); their headers name the
    model, GPU type, engine and driver version per replica. `known_keys`: the
    (model, gpu_type, engine_version, driver_version) keys the calibration store holds.
    `kernel_engine_version`: the engine version the pricing kernel's coefficients were measured
    on. With fitted weights a version without coefficients is an ERROR; with kernel weights it
    is a WARN unless it is the kernel's own version. `stored_fit`/`fresh_fit`: coefficient name
    -> value (e.g. c0_ms, a_ms, b_ms); given both, a pool-level `calibration_drift` row
    compares them against `settings.calibration_drift_fraction`.
    """
    fitted = pool.policies.weights == "fitted"
    known = set(known_keys)
    versions = (
        segments.filter(pl.col("pool") == pool.name)
        .select("replica", "model", "gpu_type", "engine_name", "engine_version", "driver_version")
        .unique()
        .sort("engine_version", "driver_version")
    )
    results = []
    for replica in pool.streams:
        findings = []
        described = []
        for row in versions.filter(pl.col("replica") == replica.id).iter_rows(named=True):
            version = (
                f"{row['engine_name']} {row['engine_version']} / driver {row['driver_version']}"
            )
            described.append(version)
            finding = _uncalibrated(row, version, known, fitted, kernel_engine_version)
            if finding is not None:
                findings.append(finding)
        observed = ", ".join(described) if described else "no segments in the hour"
        expected = (
            "fitted coefficients for every version in the log"
            if fitted
            else (
                f"kernel measured on vLLM {kernel_engine_version} or a calibration for the version"
            )
        )
        results.append(
            fold(
                (hour, pool.name, replica.id),
                "calibration",
                expected,
                observed,
                findings,
                passed_detail=f"coefficients known for {observed}" if described else observed,
                weights=pool.policies.weights,
            )
        )
    if stored_fit is not None and fresh_fit is not None:
        results.append(_drift(hour, pool, stored_fit, fresh_fit, settings, fitted))
    return results


def _uncalibrated(
    row: Mapping[str, Any],
    version: str,
    known: set[CalibrationKey],
    fitted: bool,
    kernel_engine_version: str | None,
) -> Finding | None:
    """The finding for a version of the log (`row` of segments, `version` its name) that has
    no coefficients, or None when it has them."""
    key = (row["model"], row["gpu_type"], row["engine_version"], row["driver_version"])
    if key in known or (not fitted and row["engine_version"] == kernel_engine_version):
        return None
    stored = sorted(
        f"{engine} / driver {driver}"
        for model, gpu, engine, driver in known
        if (model, gpu) == (row["model"], row["gpu_type"])
    )
    store_says = (
        f"stored coefficients are for {', '.join(stored)} only (stale)"
        if stored
        else f"the calibration store has nothing for {row['model']} on {row['gpu_type']}"
    )
    if fitted:
        return (STALE if stored else MISSING).found(
            f"the log reports {version}: {store_says}; the pool charges with fitted "
            "weights, so recalibrate (stepledger calibrate) for this version"
        )
    measured = (
        f"the kernel's coefficients were measured on vLLM {kernel_engine_version}"
        if kernel_engine_version
        else "the kernel's measured engine version is unknown"
    )
    return NEW_ENGINE_VERSION.found(
        f"the log reports {version}, {measured} and {store_says}: "
        "run a calibration sweep to confirm the kernel's weights still hold"
    )


def _drift(
    hour: datetime,
    pool: Pool,
    stored: Mapping[str, float],
    fresh: Mapping[str, float],
    settings: Settings,
    fitted: bool,
) -> CheckResult:
    limit = settings.calibration_drift_fraction
    drifts = {}
    for name in sorted(set(stored) | set(fresh)):
        if name not in stored or name not in fresh:
            drifts[name] = float("inf")
        elif stored[name] == 0:
            drifts[name] = 0.0 if fresh[name] == 0 else float("inf")
        else:
            drifts[name] = abs(fresh[name] - stored[name]) / abs(stored[name])
    over = {name: value for name, value in drifts.items() if value > limit}
    listed = ", ".join(
        f"{name} {stored.get(name, 'absent')} -> {fresh.get(name, 'absent')} ({drifts[name]:.1%})"
        for name in sorted(drifts)
    )
    findings = []
    if over:
        consequence = (
            "charges shift between prefill-heavy and decode-heavy tenants: recalibrate"
            if fitted
            else "the kernel's weights may no longer match this engine"
        )
        findings.append(
            (DRIFT if fitted else KERNEL_DRIFT).found(
                f"a fresh fit drifted beyond {limit:.0%} in {', '.join(sorted(over))}: {listed}; {consequence}"
            )
        )
    return fold(
        (hour, pool.name, None),
        "calibration_drift",
        f"every coefficient within {limit:.0%} of the stored fit",
        listed,
        findings,
        passed_detail=f"fresh fit within {limit:.0%}: {listed}",
        weights=pool.policies.weights,
    )
