"""The default kernel's load response against measured TPOT sweeps (shared/reference/pricing/measured).

The figure is `cmd/shape`'s: every point's |priced relative / measured relative - 1|, each curve
relative to its sweep's lowest concurrency, averaged over all points (anchors score zero).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pricing import Deployment, Kernel, PricingError
from pricing.shape import (
    EngineSettings,
    Sweep,
    engine_settings,
    load_sweeps,
    mean_length,
    shape_error,
    steady_state_tpot_us,
)
from tests.pricing.shared_reference import fp8_piecewise, reference_file

SHAPE_MAE_TARGET_PCT = 6.0


def _sweep(framework: str, isl: int = 8192) -> Sweep:
    return Sweep(
        model="deepseek-v3",
        chip="h200",
        framework=framework,
        dtype="fp8",
        tp=8,
        isl=isl,
        osl=1024,
        concurrency=(4, 64),
        tpot_us=(1.0, 2.0),
    )


def test_load_response_shape_error_is_within_target():
    sweeps = load_sweeps(reference_file("measured/inferencex_tpot_subset.csv"))
    error = shape_error(sweeps)
    print(
        f"load-response shape MAE {error.mae_pct:.2f}% over {error.points} points of "
        f"{len(sweeps)} sweeps ({error.mae_beyond_anchor_pct:.2f}% beyond the anchors)"
    )
    assert error.points == 136
    assert error.mae_pct <= SHAPE_MAE_TARGET_PCT


def test_a_short_prompt_workload_is_one_prompt_step_per_request_by_hand():
    kernel = Kernel.build(Deployment(model="llama-3.1-8b-instruct", chip="h100"))
    # 4 resident requests, 100-token prompts, 10 output tokens: context 105; of 10 steps, 4
    # carry one prompt (with the other 3 decoding) and 6 are pure decodes of 4.
    decode = kernel.price([1] * 4, [104] * 4, [105] * 4).nooverlap_us
    prompt = kernel.price([100, 1, 1, 1], [0, 104, 104, 104], [100, 105, 105, 105]).nooverlap_us
    assert steady_state_tpot_us(kernel, 4, 100, 10) == pytest.approx(
        (6 * decode + 4 * prompt) / 10, rel=1e-12
    )


def test_a_prompt_over_the_token_budget_is_chunked():
    kernel = Kernel.build(Deployment(model="llama-3.1-8b-instruct", chip="h100"))
    # H100 80 GiB: budget 8192; with 1 other decoding, chunks of 8191, 8191 and 18 tokens;
    # decodes at context 16,400 + 100 / 2
    decode = kernel.price([1, 1], [16_449, 16_449], [16_450] * 2).nooverlap_us
    chunks = [
        kernel.price([tokens, 1], [done, 16_449], [done + tokens, 16_450]).nooverlap_us
        for tokens, done in ((8191, 0), (8191, 8191), (18, 16_382))
    ]
    assert steady_state_tpot_us(kernel, 2, 16_400, 100) == pytest.approx(
        ((100 - 6) * decode + 2 * sum(chunks)) / 100, rel=1e-12
    )


def test_bad_sweeps_name_the_file_and_line(tmp_path: Path):
    path = tmp_path / "tpot.csv"
    header = "model,gpu,framework,precision,tp,isl,osl,concurrency,tpot_us\n"
    path.write_text(header + "llama-3.1-8b-instruct,h100,vllm,bf16,1,1024,1024,four,10.0\n")
    with pytest.raises(PricingError, match=r"tpot.csv:2"):
        load_sweeps(path)
    path.write_text(header + "llama-3.1-8b-instruct,h100,vllm,bf16,1,1024,1024,4,-1\n")
    with pytest.raises(PricingError, match=r"tpot.csv:2: .*positive tpot_us"):
        load_sweeps(path)
    path.write_text("model,gpu\nx,y\n")
    with pytest.raises(PricingError, match=r"missing column"):
        load_sweeps(path)


def test_the_steady_state_rises_with_concurrency():
    kernel = Kernel.build(Deployment(model="llama-3.1-70b-instruct", chip="h200", tp=4))
    tpot = [steady_state_tpot_us(kernel, c, 8192, 1024) for c in (1, 4, 16, 64)]
    assert np.all(np.diff(tpot) > 0)


def test_a_prefill_apart_stalls_every_decode_for_its_own_step():
    kernel = Kernel.build(Deployment(model="llama-3.1-8b-instruct", chip="h100"))
    # SGLang: the 4 prompts of 100 tokens run alone; all 10 decode steps still carry 4 decodes
    decode = kernel.price([1] * 4, [104] * 4, [105] * 4).nooverlap_us
    prompt = kernel.price([100], [0], [100]).nooverlap_us
    assert steady_state_tpot_us(kernel, 4, 100, 10, prefill_apart=True) == pytest.approx(
        (10 * decode + 4 * prompt) / 10, rel=1e-12
    )


def test_attention_replicas_each_take_a_prompt_in_the_same_step():
    kernel = Kernel.build(Deployment(model="llama-3.1-8b-instruct", chip="h100"))
    # 8 requests over 2 replicas: 4 on the priced one, whose 4 prompts take 4 of the 10 steps
    decode = kernel.price([1] * 4, [104] * 4, [105] * 4).nooverlap_us
    prompt = kernel.price([100, 1, 1, 1], [0, 104, 104, 104], [100, 105, 105, 105]).nooverlap_us
    assert steady_state_tpot_us(kernel, 8, 100, 10, replicas=2) == pytest.approx(
        (6 * decode + 4 * prompt) / 10, rel=1e-12
    )


def test_a_budget_past_the_prompt_prices_it_in_one_step():
    kernel = Kernel.build(Deployment(model="llama-3.1-8b-instruct", chip="h100"))
    decode = kernel.price([1, 1], [16_449, 16_449], [16_450] * 2).nooverlap_us
    prompt = kernel.price([16_400, 1], [0, 16_449], [16_400, 16_450]).nooverlap_us
    assert steady_state_tpot_us(kernel, 2, 16_400, 100, token_budget=16_512) == pytest.approx(
        (98 * decode + 2 * prompt) / 100, rel=1e-12
    )


def test_each_engine_serves_as_its_launch_script_says():
    vllm = engine_settings(
        Sweep("llama-3.1-70b-instruct", "h200", "vllm", "fp8", 4, 1024, 1024, (4,), (1.0,)), 16
    )
    assert vllm == EngineSettings(
        fp8_piecewise("llama-3.1-70b-instruct", "h200", tp=4, max_num_seqs=16),
        token_budget=8192,
    )
    sglang = engine_settings(_sweep("sglang"), 64)
    assert sglang == EngineSettings(
        Deployment(model="deepseek-v3", chip="h200", dtype="fp8", tp=8),
        token_budget=32768,
        prefill_apart=True,
        stream_interval=10,
    )
    ep = Deployment(
        model="deepseek-v3", chip="h200", dtype="fp8", tp=8, expert_parallel=True, cache_dtype="fp8"
    )
    # (32 + 8192 + 64) rounded up to 64 tokens: the whole prompt beside the decodes
    trt = EngineSettings(ep, token_budget=8320, stream_interval=10)
    assert engine_settings(_sweep("trt"), 32) == trt
    # attention data parallelism past 32 on 8k/1k: 8 replicas of TP 1 feeding EP 8
    dp = ep.model_copy(update={"tp": 1, "data_parallel": 8})
    assert engine_settings(_sweep("trt"), 64) == EngineSettings(
        dp, token_budget=8320, replicas=8, stream_interval=10
    )
    assert engine_settings(_sweep("trt", isl=1024), 64) == EngineSettings(
        ep, token_budget=1152, stream_interval=10
    )
    with pytest.raises(PricingError, match="no launch record for framework 'tgi'"):
        engine_settings(_sweep("tgi"), 4)


def test_every_emitted_token_adds_its_host_time_to_its_step():
    kernel = Kernel.build(Deployment(model="llama-3.1-8b-instruct", chip="h100"))
    decode = kernel.price([1] * 4, [104] * 4, [105] * 4).nooverlap_us
    prompt = kernel.price([100, 1, 1, 1], [0, 104, 104, 104], [100, 105, 105, 105]).nooverlap_us
    # a decode step emits its 4 tokens; a prompt step the 3 others' and the prompt's first
    assert steady_state_tpot_us(kernel, 4, 100, 10, output_token_us=10.0) == pytest.approx(
        (6 * (decode + 40) + 4 * (prompt + 40)) / 10, rel=1e-12
    )
    # apart, the prompt's step emits its first token alone
    alone = kernel.price([100], [0], [100]).nooverlap_us
    assert steady_state_tpot_us(
        kernel, 4, 100, 10, prefill_apart=True, output_token_us=10.0
    ) == pytest.approx((10 * (decode + 40) + 4 * (alone + 10)) / 10, rel=1e-12)
    # two replicas step together: the server emits both replicas' tokens
    assert steady_state_tpot_us(
        kernel, 8, 100, 10, replicas=2, output_token_us=10.0
    ) == pytest.approx((6 * (decode + 80) + 4 * (prompt + 80)) / 10, rel=1e-12)


def test_a_labelled_length_is_the_mean_of_the_clients_draws():
    # uniform on [int(0.8 * label), label]
    assert mean_length(1024) == (819 + 1024) // 2 == 921
    assert mean_length(8192) == (6553 + 8192) // 2 == 7372
