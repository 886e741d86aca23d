"""The default kernel's load response against measured TPOT sweeps (shared/reference/pricing/measured).

The figure is `cmd/shape`'s: every point's |priced relative / measured relative - 1|, each curve
relative to its sweep's lowest concurrency, averaged over all points (anchors score zero).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pricing import Deployment, Kernel, PricingError
from pricing.shape import load_sweeps, shape_error, steady_state_tpot_us
from tests.pricing.shared_reference import reference_file

SHAPE_MAE_TARGET_PCT = 8.0


def test_load_response_shape_error_is_within_eight_percent():
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
