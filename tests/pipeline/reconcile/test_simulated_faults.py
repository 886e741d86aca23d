"""Each simulator fault knob, end to end: simulated files -> decoder -> attribution -> the checks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import polars as pl
import pytest

from pipeline.attribution.hour import attribute_hour
from pipeline.attribution.workmodel import KernelWeights
from pipeline.ingestion.dcgm import read_dcgm_hour
from pipeline.ingestion.decoder import read_segments
from pipeline.ingestion.gateway import read_gateway_file
from pipeline.reconcile import (
    CheckResult,
    check_calibration,
    check_money,
    check_plausibility,
    check_sequence,
    check_time,
    check_unattributed,
)
from pipeline.simulator import simulate
from pipeline.simulator.faults import DRIVER_VERSION, ENGINE_VERSION, UNCALIBRATED_ENGINE_VERSION
from pricing import load_chip
from schemas.config import PoolsFile, load_pools
from tests.helpers.hours import SIMULATED_HOUR


def quiet_pool():
    """Three replicas of the default 8B pool with light traffic, so an hour simulates in seconds."""
    pools = load_pools()
    chat = pools.pool("chat-8b")
    assert chat.workload is not None
    tenant = next(t for t in chat.workload.tenants if t.name == "globex-search")
    feature = tenant.features[0].model_copy(update={"requests_per_s": 0.3})
    workload = chat.workload.model_copy(
        update={"tenants": [tenant.model_copy(update={"features": [feature]})]}
    )
    replicas = [
        replica.model_copy(update={"id": f"q-r{index}"})
        for index, replica in enumerate(chat.replicas[:3])
    ]
    return PoolsFile(
        settings=pools.settings,
        pools=[chat.model_copy(update={"name": "q", "replicas": replicas, "workload": workload})],
    )


@dataclass
class Run:
    results: list[CheckResult]
    drops: pl.DataFrame

    def of(self, check: str, replica: str | None) -> CheckResult:
        (result,) = [r for r in self.results if r.check_name == check and r.replica == replica]
        return result


def simulate_and_check(out_dir: Path, faults: dict[str, float | None]) -> Run:
    pools = quiet_pool()
    pool = pools.pools[0]
    simulate(out_dir, pools, hours=1, seed=11, faults=faults)
    log = read_segments(sorted(out_dir.glob("outbox/*/*.seg")))
    steps, slots, holders, segments, damage, drops = (
        pl.DataFrame(table)
        for table in (log.steps, log.slots, log.holders, log.segments, log.damage, log.drops)
    )
    context = pl.concat(
        [read_gateway_file(path, b"test-salt") for path in sorted(out_dir.glob("gateway/*.jsonl"))]
    )
    ledger = attribute_hour(
        SIMULATED_HOUR, pool, steps, slots, holders, context, KernelWeights.for_pool(pool)
    ).ledger
    stamp = [
        pl.lit(SIMULATED_HOUR.replace(tzinfo=None)).cast(pl.Datetime("us")).alias("hour"),
        pl.lit(pool.name).alias("pool"),
    ]
    lines = ledger.ledger_lines.with_columns(stamp)
    invoices = ledger.invoices.with_columns(stamp)
    settings = pools.settings
    # What a calibration sweep of the fleet before the hour stored (as `stepledger demo` does).
    known = {(pool.model, pool.gpu_type, ENGINE_VERSION, DRIVER_VERSION)}
    results = [
        *check_sequence(SIMULATED_HOUR, pool, steps, drops, damage, segments),
        *check_time(SIMULATED_HOUR, pool, steps, settings),
        *check_money(SIMULATED_HOUR, pool, invoices, lines),
        *check_plausibility(
            SIMULATED_HOUR, pool, steps, read_dcgm_hour(out_dir / "dcgm", SIMULATED_HOUR), settings
        ),
        *check_unattributed(SIMULATED_HOUR, pool, lines),
        *check_calibration(
            SIMULATED_HOUR,
            pool,
            segments,
            known,
            settings,
            kernel_engine_version=load_chip(pool.gpu_type).measured_engine.version,
        ),
    ]
    return Run(results, drops)


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Run:
    return simulate_and_check(tmp_path_factory.mktemp("clean"), {})


@pytest.fixture(scope="module")
def faulty(tmp_path_factory) -> Run:
    # These faults hit different checks, or different replicas: r0 takes the step-log faults,
    # the last replica (r2) idles, and r1 stays clean.
    faults = {
        "drop-records": None,
        "duplicate-segment": None,
        "host-stall": 3.0,
        "new-engine-version": None,
        "missing-context": None,
        "idle-replica": None,
    }
    return simulate_and_check(tmp_path_factory.mktemp("faulty"), faults)


@pytest.fixture(scope="module")
def torn_and_skewed(tmp_path_factory) -> Run:
    return simulate_and_check(
        tmp_path_factory.mktemp("torn"), {"torn-segment": None, "clock-skew": None}
    )


def test_clean_hour_passes_every_check(clean: Run):
    # Per replica: sequence, time, plausibility, calibration; per pool: money, unattributed.
    assert len(clean.results) == 3 * 4 + 2
    assert [r for r in clean.results if not r.passed] == []


def test_drop_records_fail_sequence_and_time(faulty: Run):
    # The burst spans segments, so the log counts it in several contiguous rows.
    first, last, steps = faulty.drops.select(
        pl.col("first_seq").min(), pl.col("last_seq").max(), pl.col("steps").sum()
    ).row(0)
    assert steps == last - first + 1
    sequence = faulty.of("sequence", "q-r0")
    assert not sequence.passed
    assert sequence.blocking
    assert sequence.finding == "dropped+duplicate_segment"
    assert sequence.detail.startswith(
        f"recorder dropped {steps} steps (seq {first}-{last}): its buffer overflowed; "
    )
    time = faulty.of("time", "q-r0")
    assert not time.passed
    assert time.blocking
    assert time.finding == "shortfall"
    assert "; 1 sequence break(s) span " in time.detail
    assert "step records are missing" in time.detail


def test_duplicate_segment_is_reported_as_ignored(faulty: Run):
    detail = faulty.of("sequence", "q-r0").detail
    assert detail.endswith(".seg")
    assert "1 segments delivered twice, the copies were ignored: " in detail


def test_host_stall_fails_plausibility(faulty: Run):
    result = faulty.of("plausibility", "q-r0")
    assert not result.passed
    assert result.finding == "host_stall"
    assert result.detail.endswith(
        "steps are stalling on the host, and customers would be charged for CPU waits"
    )


def test_new_engine_version_warns_in_calibration(faulty: Run):
    result = faulty.of("calibration", "q-r0")
    assert not result.passed
    assert result.severity == "WARN"
    assert result.finding == "new_engine_version"
    assert result.detail == (
        f"the log reports vllm {UNCALIBRATED_ENGINE_VERSION} / driver {DRIVER_VERSION}, the kernel's coefficients "
        f"were measured on vLLM 0.25.0 and stored coefficients are for {ENGINE_VERSION} / driver {DRIVER_VERSION} "
        "only (stale): run a calibration sweep to confirm the kernel's weights still hold"
    )
    assert not result.blocking
    assert result.observed == f"vllm {UNCALIBRATED_ENGINE_VERSION} / driver {DRIVER_VERSION}"


def test_the_fleet_version_passes_calibration_though_the_kernel_was_measured_on_another(clean: Run):
    # The kernel's h100 coefficients come from a vLLM 0.25.0 sweep; the fleet's own sweep
    # covers the version it runs.
    assert load_chip("h100").measured_engine.version == "0.25.0" != ENGINE_VERSION
    result = clean.of("calibration", "q-r0")
    assert result.passed
    assert (
        result.detail == f"coefficients known for vllm {ENGINE_VERSION} / driver {DRIVER_VERSION}"
    )


def test_missing_context_fails_unattributed_while_money_still_reconciles(faulty: Run):
    unattributed = faulty.of("unattributed", None)
    assert not unattributed.passed
    assert unattributed.finding == "over_threshold"
    assert "has no tenant context, above the pool's 2.00%" in unattributed.detail
    assert faulty.of("money", None).passed


def test_idle_replica_is_visible_but_no_false_alarm(faulty: Run):
    for check in ("sequence", "time", "plausibility", "calibration"):
        assert faulty.of(check, "q-r2").passed
    assert faulty.of("plausibility", "q-r2").detail.startswith(
        "replica idle (no steps): engine busy 0.0%"
    )
    assert faulty.of("time", "q-r2").observed == "no steps"


def test_untouched_replica_passes_beside_the_faults(faulty: Run):
    assert [r.check_name for r in faulty.results if r.replica == "q-r1" and not r.passed] == []


def test_torn_segment_fails_sequence_with_the_damage(torn_and_skewed: Run):
    result = torn_and_skewed.of("sequence", "q-r0")
    assert not result.passed
    assert result.blocking
    assert result.finding == "damage"
    assert "1 damaged frames: torn_tail in " in result.detail
    assert "steps lost (seq " in result.detail


def test_clock_skew_fails_time(torn_and_skewed: Run):
    result = torn_and_skewed.of("time", "q-r0")
    assert not result.passed
    assert result.blocking
    assert "clock_skew" in result.finding.split("+")
    assert "wall-clock placement disagrees with monotonic durations (clock skew): " in result.detail
