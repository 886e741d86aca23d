"""The calibration check as the pool-hour job runs it: the data directory's calibration store,
the segments' engine and driver versions, and the kernel's measured engine release."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import yaml

from assets.cli.demo import calibrate_from_segments
from assets.definitions import build_definitions
from assets.partitions import partition_key
from assets.runner import QUIET_RUN_CONFIG as QUIET
from assets.runner import pool_hour_outcome
from pipeline import finance
from pipeline.simulator import simulate
from pipeline.simulator.faults import DRIVER_VERSION, ENGINE_VERSION, UNCALIBRATED_ENGINE_VERSION
from schemas.config import PoolsFile
from tests.helpers.fleets import SIMULATED_HOURS, small_pools
from tests.helpers.hours import SIMULATED_HOUR


def run_hour(data: Path, pools: PoolsFile) -> dg.ExecuteInProcessResult:
    defs = build_definitions(pools, data)
    return defs.resolve_job_def("pool_hour_job").execute_in_process(
        partition_key=partition_key(SIMULATED_HOUR, "chat-8b"),
        instance=dg.DagsterInstance.ephemeral(),
        run_config=QUIET,
        raise_on_error=False,
    )


def calibration_rows(data: Path) -> list[tuple[Any, ...]]:
    with finance.connect(data) as con:
        return con.execute(
            "SELECT check_name, replica, passed, severity, detail FROM reconciliation "
            "WHERE check_name LIKE 'calibration%' ORDER BY check_name, replica"
        ).fetchall()


def checks_of(result: dg.ExecuteInProcessResult) -> dict[str, tuple[bool, dg.AssetCheckSeverity]]:
    return {e.check_name: (e.passed, e.severity) for e in result.get_asset_check_evaluations()}


def run_hour_warning_of_calibration(data: Path) -> None:
    """Bill the hour of the small fleet, whose calibration check must fail with a WARN: the
    hour is published and nobody is paged."""
    result = run_hour(data, small_pools())
    assert result.success
    assert checks_of(result)["calibration"] == (False, dg.AssetCheckSeverity.WARN)


def fitted(pools: PoolsFile) -> PoolsFile:
    chat = pools.pool("chat-8b")
    return pools.model_copy(
        update={
            "pools": [
                chat.model_copy(
                    update={"policies": chat.policies.model_copy(update={"weights": "fitted"})}
                )
            ]
        }
    )


@pytest.fixture
def calibrated(simulated: Path, tmp_path: Path) -> Path:
    """The simulated fleet, calibrated on its own clean log."""
    data = tmp_path / "run"
    shutil.copytree(simulated, data)
    calibrate_from_segments(sorted((data / "outbox").glob("*/*.seg")), data / "calibration.yaml")
    return data


def test_a_calibrated_engine_version_passes(calibrated: Path) -> None:
    result = run_hour(calibrated, small_pools())
    assert result.success
    assert checks_of(result)["calibration"] == (True, dg.AssetCheckSeverity.ERROR)
    known = f"coefficients known for vllm {ENGINE_VERSION} / driver {DRIVER_VERSION}"
    assert calibration_rows(calibrated) == [
        ("calibration", "chat-8b-r0", True, "WARN", known),
        ("calibration", "chat-8b-r1", True, "WARN", known),
    ]


def test_without_a_sweep_the_kernels_own_release_is_the_only_one_it_vouches_for(
    simulated: Path, tmp_path: Path
) -> None:
    data = tmp_path / "run"
    shutil.copytree(simulated, data)
    run_hour_warning_of_calibration(data)
    detail = (
        f"the log reports vllm {ENGINE_VERSION} / driver {DRIVER_VERSION}, the kernel's coefficients were "
        "measured on vLLM 0.25.0 and the calibration store has nothing for llama-3.1-8b-instruct on h100: "
        "run a calibration sweep to confirm the kernel's weights still hold"
    )
    assert calibration_rows(data) == [
        ("calibration", "chat-8b-r0", False, "WARN", detail),
        ("calibration", "chat-8b-r1", False, "WARN", detail),
    ]


def test_a_new_engine_version_warns_without_paging(simulated: Path, tmp_path: Path) -> None:
    data = tmp_path / "new-engine"
    simulate(
        data, small_pools(), hours=SIMULATED_HOURS, seed=7, faults={"new-engine-version": None}
    )
    calibrate_from_segments(
        sorted((simulated / "outbox").glob("*/*.seg")), data / "calibration.yaml"
    )
    run_hour_warning_of_calibration(data)
    stale = (
        f"the log reports vllm {UNCALIBRATED_ENGINE_VERSION} / driver {DRIVER_VERSION}, the kernel's coefficients "
        f"were measured on vLLM 0.25.0 and stored coefficients are for {ENGINE_VERSION} / driver "
        f"{DRIVER_VERSION} only (stale): run a calibration sweep to confirm the kernel's weights still hold"
    )
    known = f"coefficients known for vllm {ENGINE_VERSION} / driver {DRIVER_VERSION}"
    assert calibration_rows(data) == [
        ("calibration", "chat-8b-r0", False, "WARN", stale),
        ("calibration", "chat-8b-r1", True, "WARN", known),
    ]
    with finance.connect(data) as con:
        assert con.execute(
            "SELECT severity, kind, replica FROM alerts WHERE kind LIKE 'calibration%'"
        ).fetchall() == [("WARN", "calibration", "chat-8b-r0")]


def test_a_fitted_pool_compares_a_fresh_fit_with_the_stored_one(calibrated: Path) -> None:
    result = run_hour(calibrated, fitted(small_pools()))
    assert result.success
    assert checks_of(result)["calibration_drift"] == (
        True,
        dg.AssetCheckSeverity.ERROR,
    )
    ((name, replica, passed, severity, detail),) = [
        r for r in calibration_rows(calibrated) if r[0] == "calibration_drift"
    ]
    # The stored fit is of the same steps: no drift at all.
    assert (name, replica, passed, severity) == ("calibration_drift", None, True, "ERROR")
    assert detail.startswith("fresh fit within 15%: a_ms ")
    assert detail.count("(0.0%)") == 3


def test_a_drifted_fit_of_a_fitted_pool_fails_the_run(calibrated: Path) -> None:
    store = yaml.safe_load((calibrated / "calibration.yaml").read_text())
    (entry,) = store["entries"]
    entry["c0_ms"] = entry["c0_ms"] * 2
    (calibrated / "calibration.yaml").write_text(yaml.safe_dump(store))
    result = run_hour(calibrated, fitted(small_pools()))
    assert not result.success
    assert checks_of(result)["calibration_drift"] == (
        False,
        dg.AssetCheckSeverity.ERROR,
    )
    # Not a blocking check: the hour is published, and the run fails so that on-call is paged.
    outcome = pool_hour_outcome(result)
    assert (outcome["success"], outcome["held_back"], outcome["error"]) == (False, False, None)
    (failure,) = result.get_step_failure_events()
    assert failure.step_key == "reconciliation"
    error = failure.step_failure_data.error
    assert error is not None
    assert error.message.startswith(
        "dagster._core.definitions.events.Failure: ERROR findings of checks that hold no hour "
        "back: calibration_drift (2026-11-30T00 chat-8b: the hour is published)"
    )
    ((detail,),) = [(r[4],) for r in calibration_rows(calibrated) if r[0] == "calibration_drift"]
    assert detail.startswith("a fresh fit drifted beyond 15% in c0_ms: ")
    assert "(50.0%)" in detail
    assert detail.endswith(
        "charges shift between prefill-heavy and decode-heavy tenants: recalibrate"
    )
