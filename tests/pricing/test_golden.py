"""The Go kernel's published step anatomy, reproduced under compat="go".

Numbers from golden_steps.yaml (blis-latency-kernel docs/generated/step-anatomy.html @ e9cf217e,
read back from the SVG, and example_test.go @ b1db899f): DeepSeek-V3 fp8 on 8x H200, TP8,
piecewise graphs, decode threshold 8, every request decoding one token at 4,096 context.
"""

from __future__ import annotations

import numpy as np
import pytest

from pricing import Kernel
from tests.pricing.shared_reference import GOLDEN

# batch: sm, hbm, nvlink, host, overlap, nooverlap (ms), bottleneck -- figure read-back
FIGURE = {
    1: (3.52, 2.07, 0.60, 3.54, 8.81, 9.71, "host"),
    32: (4.47, 16.50, 1.12, 3.54, 24.11, 25.64, "hbm"),
    256: (11.37, 35.24, 4.88, 3.54, 49.17, 55.01, "hbm"),
}


def _decode_batch(kernel: Kernel, batch: int):
    return kernel.price(np.ones(batch, dtype=np.int64), np.full(batch, 4095), np.full(batch, 4095))


@pytest.fixture(scope="module")
def kernel() -> Kernel:
    return Kernel.build(GOLDEN)


@pytest.mark.parametrize("batch", sorted(FIGURE))
def test_every_resource_and_both_estimates_within_two_percent(kernel, batch):
    price = _decode_batch(kernel, batch)
    sm, hbm, nvlink, host, overlap, nooverlap, bottleneck = FIGURE[batch]
    got = (
        price.sm_us,
        price.hbm_us,
        price.nvlink_us,
        price.host_us,
        price.overlap_us,
        price.nooverlap_us,
    )
    np.testing.assert_allclose(
        np.array(got) / 1e3, [sm, hbm, nvlink, host, overlap, nooverlap], rtol=0.02
    )
    assert price.nic_us == 0.0
    assert price.bottleneck == bottleneck


def test_bottleneck_host_at_one_and_two_hbm_from_four_to_256(kernel):
    assert [_decode_batch(kernel, b).bottleneck for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)] == [
        "host"
    ] * 2 + ["hbm"] * 7


def test_batch_one_breakdown_matches_the_hand_derivation(kernel):
    price = _decode_batch(kernel, 1)
    dense, moe, head = (
        price.per_kind["attn_dense"],
        price.per_kind["attn_moe"],
        price.per_kind["head"],
    )
    assert price.host_us == pytest.approx(62 * 7.0 + 972 * 3.2, rel=1e-12)
    assert kernel.plan.host.kernels == 972
    attention = 13.5 + 4096 * 576 / 2.928e6
    assert dense["hbm_us"] == pytest.approx(
        583_467_008 / 8 / 3.84e6 + 4 * 28672 / 8 / 3.84e6 + attention, rel=1e-12
    )
    assert dense["sm_us"] == pytest.approx(1_166_934_016 / 8 / (1.979e9 * 0.736 / 114), rel=1e-12)
    assert dense["nvlink_us"] == pytest.approx(2 * (4.71 + 14336 / 104250), rel=1e-12)
    assert moe["expert_sm_us"] == pytest.approx(
        8 * 88_080_384 * 0.999 / (1.979e9 * 0.736 / 114), rel=1e-12
    )
    assert moe["expert_hbm_us"] == pytest.approx(8 * 44_040_192 / 8 / 3.84e6, rel=1e-12)
    assert moe["stage_us"] == pytest.approx(
        moe["hbm_us"] + moe["expert_sm_us"] + moe["expert_hbm_us"], rel=1e-12
    )
    assert head["sm_us"] == pytest.approx(
        2 * 129280 * 7168 / 8 / (1.979e9 * 0.736 / 114), rel=1e-12
    )
    assert head["hbm_us"] == pytest.approx(129280 * 7168 / 8 / 3.84e6, rel=1e-12)
    # the notes' rounded per-layer figures
    assert (dense["sm_us"], dense["stage_us"], moe["stage_us"], head["hbm_us"]) == pytest.approx(
        (11.42, 33.30, 88.40, 30.17), abs=0.01
    )
    assert price.overlap_us == pytest.approx(
        3 * dense["stage_us"] + 58 * moe["stage_us"] + head["hbm_us"] + price.host_us, rel=1e-12
    )


def test_example_test_exact_digits_at_batch_32(kernel):
    price = _decode_batch(kernel, 32)
    assert [
        round(v / 1e3, 1)
        for v in (
            price.overlap_us,
            price.nooverlap_us,
            price.sm_us,
            price.hbm_us,
            price.nvlink_us,
            price.host_us,
        )
    ] == [24.1, 25.6, 4.5, 16.5, 1.1, 3.5]


def test_physics_divides_routed_arithmetic_across_tp(kernel):
    physics = Kernel.build(GOLDEN.model_copy(update={"compat": "physics"}))
    go_price, physics_price = _decode_batch(kernel, 1), _decode_batch(physics, 1)
    routed = go_price.per_kind["attn_moe"]["expert_sm_us"]
    assert physics_price.per_kind["attn_moe"]["expert_sm_us"] == pytest.approx(
        routed / 8, rel=1e-12
    )
    # At one token every dense GEMM (and the head) costs its weight read, on HBM, which both
    # modes charge: SM is the routed experts' arithmetic alone, 1/8 of Go's
    assert physics_price.sm_us == pytest.approx(58 * routed / 8, rel=1e-12)
    assert physics_price.sm_us == pytest.approx(399.4, abs=0.1)  # "SM 3.51 ms" in Go
    # 244 norms (4 in each of 61 layers), each a memory op paying 3 us the Go kernel leaves out
    assert physics_price.hbm_us == pytest.approx(go_price.hbm_us + 244 * 3.0, rel=1e-12)
