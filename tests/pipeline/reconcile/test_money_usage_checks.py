from __future__ import annotations

from datetime import datetime

import polars as pl
import pytest

from pipeline.reconcile import (
    CheckResult,
    check_calibration,
    check_money,
    check_plausibility,
    check_unattributed,
)
from schemas.config import Settings
from tests.helpers.hours import HOUR
from tests.helpers.reconcile_builders import (
    S,
    clean_steps,
    make_dcgm,
    make_invoice,
    make_ledger,
    make_pool,
    make_segments,
    make_steps,
)

POOL = make_pool()
SETTINGS = Settings()
# Two H100s for an hour at 3.60 USD.
INVOICE_NANO = 7_200_000_000
LEDGER = [
    ("acme", "usage", 3_000_000_001, 120),
    ("globex", "usage", 1_199_999_999, 80),
    ("platform", "idle", 2_000_000_000, 0),
    ("platform", "headroom", 900_000_000, 0),
    (None, "unattributed", 60_000_000, 4),
    ("platform", "platform_retry", 40_000_000, 2),
]


def by_replica(results):
    return {r.replica: r for r in results}


# --- money --------------------------------------------------------------------------------


def test_money_passes_when_every_line_kind_sums_to_the_invoice():
    (result,) = check_money(HOUR, POOL, make_invoice(POOL, INVOICE_NANO), make_ledger(POOL, LEDGER))
    assert result.passed
    assert result.blocking
    assert result.severity == "ERROR"
    assert result.expected == "7200000000 nano-dollars (invoice)"
    assert result.observed == "7200000000 nano-dollars in 6 ledger lines"
    assert result.detail == (
        "ledger equals the invoice exactly (headroom 900000000, idle 2000000000, platform_retry 40000000, "
        "unattributed 60000000, usage 4200000000)"
    )


def test_money_fails_on_one_nano_dollar():
    lines = [*LEDGER[:-1], ("platform", "platform_retry", 39999999, 2)]
    (result,) = check_money(HOUR, POOL, make_invoice(POOL, INVOICE_NANO), make_ledger(POOL, lines))
    assert not result.passed
    assert result.blocking
    assert result.finding == "mismatch"
    assert result.detail.startswith(
        "ledger lines sum to 7199999999 nano-dollars, the invoice is 7200000000: off by -1 (headroom 900000000"
    )


def test_money_fails_on_float_amounts_and_on_a_mispriced_invoice():
    floats = make_ledger(POOL, LEDGER).with_columns(pl.col("amount_nano").cast(pl.Float64))
    (result,) = check_money(HOUR, POOL, make_invoice(POOL, INVOICE_NANO), floats)
    assert not result.passed
    assert result.finding == "not_integer"
    assert (
        result.detail == "ledger_lines.amount_nano is Float64: money must be integer nano-dollars"
    )
    (result,) = check_money(
        HOUR, POOL, make_invoice(POOL, INVOICE_NANO + 5), make_ledger(POOL, LEDGER)
    )
    assert result.finding == "invoice_price+mismatch"
    assert result.detail.startswith(
        "invoice 7200000005 nano-dollars != 2 GPUs x 3.6 USD/GPU-hour = 7200000000"
    )


def test_money_needs_exactly_one_invoice_for_the_hour_and_pool():
    later = make_invoice(POOL, INVOICE_NANO).with_columns(pl.col("hour").dt.offset_by("1h"))
    (result,) = check_money(HOUR, POOL, later, make_ledger(POOL, LEDGER))
    assert not result.passed
    assert result.finding == "invoice_count"
    assert result.detail == "expected exactly one invoice for pool chat hour 2026-11-30T05, found 0"


def test_money_accepts_zoned_hour_columns():
    invoice = make_invoice(POOL, INVOICE_NANO).with_columns(
        pl.col("hour").dt.replace_time_zone("UTC")
    )
    ledger = make_ledger(POOL, LEDGER).with_columns(pl.col("hour").dt.replace_time_zone("UTC"))
    assert check_money(HOUR, POOL, invoice, ledger)[0].passed


# --- unattributed -------------------------------------------------------------------------


def test_unattributed_share_of_usage_below_threshold_passes():
    # 60_000_000 of 4_300_000_000 usage-like nano-dollars: 1.40% < 2%.
    (result,) = check_unattributed(HOUR, POOL, make_ledger(POOL, LEDGER))
    assert result.passed
    assert not result.blocking
    assert result.observed == "1.40%: 60000000 of 4300000000 nano-dollars, 4 requests"


def test_missing_context_above_threshold_pages():
    lines = [
        *LEDGER[:4],
        (None, "unattributed", 500000000, 31),
        ("platform", "platform_retry", 40000000, 2),
    ]
    (result,) = check_unattributed(HOUR, POOL, make_ledger(POOL, lines))
    assert not result.passed
    assert result.severity == "ERROR"
    assert not result.blocking
    assert result.finding == "over_threshold"
    assert result.detail == (
        "10.55% of the hour's usage (500000000 of 4740000000 nano-dollars, 31 requests) has no tenant context, "
        "above the pool's 2.00%: requests are missing from the gateway context log"
    )


def test_unattributed_of_an_hour_without_usage_passes():
    (result,) = check_unattributed(
        HOUR, POOL, make_ledger(POOL, [("platform", "idle", 7_200_000_000, 0)])
    )
    assert result.passed
    assert result.detail == "no usage in the hour"


# --- plausibility -------------------------------------------------------------------------

UUID0, UUID1 = "GPU-0000-0000", "GPU-0001-0000"


def test_plausibility_passes_when_dcgm_tracks_busy_time():
    dcgm = make_dcgm(POOL, {UUID0: [0.55, 0.70], UUID1: [0.62]})
    results = by_replica(check_plausibility(HOUR, POOL, clean_steps(POOL), dcgm, SETTINGS))
    assert results["chat-r0"].passed
    assert results["chat-r1"].passed
    assert (
        results["chat-r0"].detail
        == "engine busy 60.0% vs DCGM_FI_PROF_GR_ENGINE_ACTIVE mean 62.5% (band ±10%)"
    )
    assert results["chat-r0"].observed == "DCGM mean 0.625 over 240 samples of 1 GPUs"


def test_idle_replica_passes_plausibility_and_says_idle():
    steps = make_steps(POOL, "chat-r0")
    dcgm = make_dcgm(POOL, {UUID0: [0.6], UUID1: [0.0, 0.01]})
    r1 = by_replica(check_plausibility(HOUR, POOL, steps, dcgm, SETTINGS))["chat-r1"]
    assert r1.passed
    assert (
        r1.detail
        == "replica idle (no steps): engine busy 0.0% vs DCGM_FI_PROF_GR_ENGINE_ACTIVE mean 0.5% (band ±10%)"
    )


def test_host_stall_fails_plausibility_with_the_cpu_wait_explanation():
    dcgm = make_dcgm(POOL, {UUID0: [0.6], UUID1: [0.2, 0.3]})
    r1 = by_replica(check_plausibility(HOUR, POOL, clean_steps(POOL), dcgm, SETTINGS))["chat-r1"]
    assert not r1.passed
    assert r1.severity == "ERROR"
    assert not r1.blocking
    assert r1.finding == "host_stall"
    assert r1.detail == (
        "engine busy 60.0% vs DCGM_FI_PROF_GR_ENGINE_ACTIVE mean 25.0% (band ±10%): steps are stalling on the "
        "host, and customers would be charged for CPU waits"
    )


def test_gpu_busier_than_the_log_fails_plausibility():
    dcgm = make_dcgm(POOL, {UUID0: [0.95], UUID1: [0.6]})
    r0 = by_replica(check_plausibility(HOUR, POOL, clean_steps(POOL), dcgm, SETTINGS))["chat-r0"]
    assert not r0.passed
    assert r0.finding == "gpu_busier"
    assert r0.severity == "WARN"
    assert r0.detail == (
        "engine busy 60.0% vs DCGM_FI_PROF_GR_ENGINE_ACTIVE mean 95.0% (band ±10%): the GPU is busier than the "
        "engine's log, so steps went unlogged or another process shares the GPU"
    )


def test_missing_dcgm_is_its_own_failed_finding():
    dcgm = make_dcgm(POOL, {UUID0: [0.6]})
    r1 = by_replica(check_plausibility(HOUR, POOL, clean_steps(POOL), dcgm, SETTINGS))["chat-r1"]
    assert not r1.passed
    assert r1.finding == "dcgm_missing"
    assert r1.severity == "WARN"
    assert r1.detail == (
        "no DCGM samples for GPU GPU-0001-0000 in hour 2026-11-30T05 (host gpu-node-01): "
        "engine activity cannot be cross-checked"
    )
    assert r1.observed == "no DCGM samples"


def test_samples_of_another_hour_do_not_count():
    dcgm = make_dcgm(POOL, {UUID0: [0.6], UUID1: [0.6]}).with_columns(
        pl.when(pl.col("uuid") == UUID1)
        .then(pl.col("timestamp_ns") - 3_600 * S)
        .otherwise(pl.col("timestamp_ns"))
    )
    r1 = by_replica(check_plausibility(HOUR, POOL, clean_steps(POOL), dcgm, SETTINGS))["chat-r1"]
    assert r1.finding == "dcgm_missing"


def test_tp8_replica_uses_the_mean_of_its_gpus_and_lists_each_missing_one():
    tp8 = make_pool(name="big", replicas=1, gpus=8)
    uuids = tp8.replicas[0].gpu_uuids
    dcgm = make_dcgm(tp8, {uuid: [0.3 + 0.1 * index] for index, uuid in enumerate(uuids[:6])})
    (result,) = check_plausibility(HOUR, tp8, make_steps(tp8, "big-r0"), dcgm, SETTINGS)
    # mean of 0.3..0.8 = 0.55 against 0.6 busy: within the band; two GPUs report nothing.
    assert result.observed == "DCGM mean 0.550 over 1440 samples of 6 GPUs"
    assert result.finding == "dcgm_missing"
    assert result.detail.startswith(
        "no DCGM samples for GPU GPU-0000-0006, GPU-0000-0007 in hour 2026-11-30T05"
    )


# --- calibration --------------------------------------------------------------------------

KEY = ("llama-3.1-8b-instruct", "h100", "0.25.0", "570.86")


def test_calibration_passes_for_a_known_version():
    fitted = make_pool(weights="fitted")
    results = check_calibration(HOUR, fitted, make_segments(fitted), {KEY}, SETTINGS)
    assert [r.passed for r in results] == [True, True]
    assert results[0].detail == "coefficients known for vllm 0.25.0 / driver 570.86"


def test_new_engine_version_with_fitted_weights_is_stale_error():
    fitted = make_pool(weights="fitted")
    segments = make_segments(fitted, engine_version="0.26.1")
    r0 = check_calibration(HOUR, fitted, segments, {KEY}, SETTINGS)[0]
    assert not r0.passed
    assert r0.severity == "ERROR"
    assert not r0.blocking
    assert r0.finding == "stale"
    assert r0.detail == (
        "the log reports vllm 0.26.1 / driver 570.86: stored coefficients are for 0.25.0 / driver 570.86 only "
        "(stale); the pool charges with fitted weights, so recalibrate (stepledger calibrate) for this version"
    )
    missing = check_calibration(HOUR, fitted, segments, set(), SETTINGS)[0]
    assert missing.finding == "missing"
    assert "the calibration store has nothing for llama-3.1-8b-instruct on h100" in missing.detail


def test_new_engine_version_with_kernel_weights_warns_naming_the_kernel_version():
    segments = make_segments(POOL, engine_version="0.26.1")
    r0 = check_calibration(HOUR, POOL, segments, set(), SETTINGS, kernel_engine_version="0.25.0")[0]
    assert not r0.passed
    assert r0.severity == "WARN"
    assert r0.finding == "new_engine_version"
    assert r0.detail == (
        "the log reports vllm 0.26.1 / driver 570.86, the kernel's coefficients were measured on vLLM 0.25.0 and "
        "the calibration store has nothing for llama-3.1-8b-instruct on h100: run a calibration sweep to confirm "
        "the kernel's weights still hold"
    )
    same = check_calibration(
        HOUR, POOL, make_segments(POOL), set(), SETTINGS, kernel_engine_version="0.25.0"
    )
    assert all(r.passed for r in same)


def test_calibration_drift_beyond_the_threshold():
    fitted = make_pool(weights="fitted")

    def drift_check(fresh_fit: dict[str, float]) -> CheckResult:
        stored = {"c0_ms": 4.0, "a_ms": 0.02, "b_ms": 0.001}
        segments = make_segments(fitted)
        return check_calibration(
            HOUR, fitted, segments, {KEY}, SETTINGS, stored_fit=stored, fresh_fit=fresh_fit
        )[-1]

    drift = drift_check({"c0_ms": 4.2, "a_ms": 0.025, "b_ms": 0.001})
    assert drift.check_name == "calibration_drift"
    assert drift.replica is None
    assert not drift.passed
    assert drift.severity == "ERROR"
    assert drift.finding == "drift"
    assert drift.detail.startswith(
        "a fresh fit drifted beyond 15% in a_ms: a_ms 0.02 -> 0.025 (25.0%), b_ms"
    )
    assert drift_check({"c0_ms": 4.4, "a_ms": 0.021, "b_ms": 0.00099}).passed


def test_naive_hour_is_refused():
    with pytest.raises(ValueError, match="no time zone"):
        check_money(
            datetime(2026, 11, 30, 5), POOL, make_invoice(POOL, 1), make_ledger(POOL, LEDGER)
        )


def test_steps_holding_more_kv_blocks_than_the_engine_has_are_flagged_without_holding():
    """A block shared by k requests counts 1/k, so a step's requests hold at most its
    total_blocks (6000 here); shares summing to it exactly are plausible."""
    dcgm = make_dcgm(POOL, {"GPU-0000-0000": [0.6], "GPU-0001-0000": [0.6]})
    held = pl.DataFrame(
        {
            "replica": ["chat-r0"] * 4 + ["chat-r1"],
            "seq": [10, 11, 12, 40, 10],
            "kv_blocks": [6000.5, 600_000.0, 7000.0, 9000.0, 6000.0],
        }
    )
    results = by_replica(
        check_plausibility(HOUR, POOL, clean_steps(POOL), dcgm, SETTINGS, kv_held=held)
    )
    r0 = results["chat-r0"]
    assert (r0.passed, r0.severity, r0.blocking, r0.finding) == (
        False,
        "ERROR",
        False,
        "impossible_kv",
    )
    assert r0.detail == (
        "4 steps (seq 10-12, 40) hold more KV blocks than the engine has; the most, step 11: "
        "600000.0 blocks of 6000"
    )
    assert results["chat-r1"].passed
