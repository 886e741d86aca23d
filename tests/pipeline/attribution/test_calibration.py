from __future__ import annotations

import json

import polars as pl
import pytest

from pipeline.attribution.calibration import (
    CalibrationError,
    CalibrationMissing,
    CalibrationStore,
    calibration_coverage,
    fit_by_version,
    fit_coefficients,
    relative_drift,
)
from pipeline.attribution.synthetic import synthetic_log, synthetic_pool
from pipeline.attribution.workmodel import Coefficients


def test_ols_recovers_known_coefficients_exactly_without_noise():
    log = synthetic_log(synthetic_pool(), steps_per_replica=300, coefficients=(9.0, 0.04, 0.00007))
    fit = fit_coefficients(log.steps, log.slots)
    # Durations are whole nanoseconds, so the recovery is exact to the ns rounding.
    assert fit.coefficients.c0_ms == pytest.approx(9.0, abs=1e-5)
    assert fit.coefficients.a_ms == pytest.approx(0.04, rel=1e-6)
    assert fit.coefficients.b_ms == pytest.approx(0.00007, rel=1e-6)
    assert fit.r_squared == pytest.approx(1.0, abs=1e-9)
    assert fit.n_steps == 600


def test_ols_with_measurement_noise_stays_close_and_reports_quality():
    log = synthetic_log(
        synthetic_pool(),
        steps_per_replica=1500,
        coefficients=(12.0, 0.05, 0.00005),
        noise=0.03,
        seed=3,
    )
    fit = fit_coefficients(log.steps, log.slots)
    assert fit.coefficients.c0_ms == pytest.approx(12.0, rel=0.05)
    assert fit.coefficients.a_ms == pytest.approx(0.05, rel=0.05)
    assert fit.coefficients.b_ms == pytest.approx(0.00005, rel=0.1)
    assert 0.9 < fit.r_squared < 1.0
    assert fit.rmse_ms > 0


def test_fit_refuses_data_that_cannot_separate_the_coefficients():
    log = synthetic_log(synthetic_pool(), steps_per_replica=2)
    with pytest.raises(CalibrationError, match="need at least 3 steps"):
        fit_coefficients(log.steps.head(2), log.slots)
    flat = log.slots.with_columns(
        pl.lit(1, dtype=pl.Int32).alias("new_tokens"),
        pl.lit(0, dtype=pl.Int32).alias("context_tokens"),
    )
    same = flat.filter(pl.col("slot_index") == 0)
    with pytest.raises(CalibrationError, match="do not vary enough"):
        fit_coefficients(log.steps, same)


def _segments(engine_by_segment: dict[str, str]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "segment_id": list(engine_by_segment),
            "model": ["llama-3.1-8b-instruct"] * len(engine_by_segment),
            "gpu_type": ["h100"] * len(engine_by_segment),
            "engine_version": list(engine_by_segment.values()),
            "driver_version": ["550.54"] * len(engine_by_segment),
            "steps": [200] * len(engine_by_segment),
        }
    )


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_store_round_trip_versions_and_a_drifted_engine_is_flagged(tmp_path, suffix):
    log = synthetic_log(synthetic_pool(), steps_per_replica=200)
    fits = fit_by_version(log.steps, log.slots, _segments({"r0-s0": "0.11.0", "r1-s0": "0.11.0"}))
    key = ("llama-3.1-8b-instruct", "h100", "0.11.0", "550.54")
    assert list(fits) == [key]
    assert fits[key].n_steps == 400
    store = CalibrationStore()
    entry = store.put(*key, fits[key])
    path = tmp_path / f"calibration{suffix}"
    store.save(path)
    loaded = CalibrationStore.load(path)
    assert loaded.lookup(*key) == entry.coefficients
    assert entry.version.startswith("fit-")
    assert loaded.lookup("llama-3.1-8b-instruct", "h100", "0.12.0", "550.54") is None
    with pytest.raises(
        CalibrationMissing,
        match=r"engine '0.12.0'.*stored for this model and GPU: engine 0.11.0 / driver 550.54",
    ):
        loaded.require("llama-3.1-8b-instruct", "h100", "0.12.0", "550.54")
    coverage = calibration_coverage(
        loaded, "llama-3.1-8b-instruct", "h100", _segments({"a": "0.11.0", "b": "0.12.0"})
    )
    assert coverage["coefficients_version"].to_list() == [entry.version, None]
    assert (
        coverage["detail"][1]
        == "no coefficients for llama-3.1-8b-instruct on h100 with engine 0.12.0 and driver 550.54"
    )


def test_store_errors_name_the_file_and_entry(tmp_path):
    assert CalibrationStore.load(tmp_path / "absent.yaml").entries == []
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"entries": [{"model": "m"}]}))
    with pytest.raises(CalibrationError, match=r"bad.json: entries\[0\]: missing \['gpu_type'"):
        CalibrationStore.load(bad)
    bad.write_text("{")
    with pytest.raises(CalibrationError, match="bad.json: not valid JSON"):
        CalibrationStore.load(bad)


def test_relative_drift():
    drift = relative_drift(Coefficients(10, 0.05, 0.0001), Coefficients(11, 0.05, 0.00008))
    assert drift == pytest.approx({"c0_ms": 0.1, "a_ms": 0.0, "b_ms": 0.2})
    with pytest.raises(ValueError, match="b_ms=-1"):
        Coefficients(1, 1, -1)


def test_weights_for_log_uses_stored_coefficients_and_flags_a_drifted_engine():
    from pipeline.attribution.calibration import weights_for_log
    from pipeline.attribution.workmodel import FittedWeights, KernelWeights

    pool = synthetic_pool(weights="fitted")
    store = CalibrationStore()
    log = synthetic_log(pool, steps_per_replica=50)
    entry = store.put(
        pool.model, pool.gpu_type, "0.11.0", "550.54", fit_coefficients(log.steps, log.slots)
    )
    fallback = KernelWeights(kernel=None, version="kernel-test")
    source, findings = weights_for_log(pool, _segments({"a": "0.11.0"}), store, fallback)
    assert source == FittedWeights(entry.coefficients)
    assert findings == []
    source, findings = weights_for_log(
        pool, _segments({"a": "0.11.0", "b": "0.12.0"}), store, fallback
    )
    assert source is fallback
    assert findings == [
        "pool chat: no coefficients for llama-3.1-8b-instruct on h100 with engine 0.12.0 and driver 550.54 "
        "(200 steps); kernel weights used instead"
    ]
    kernel_pool = synthetic_pool(weights="kernel")
    assert weights_for_log(kernel_pool, _segments({"a": "0.12.0"}), None, fallback) == (
        fallback,
        [],
    )
