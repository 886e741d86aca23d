"""Kernel behaviour: hand-checked terms, invariants as properties, work per slot, errors."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pricing import Deployment, Kernel, PricingError, Slots, spec
from pricing.spec import ChipSpec, ModelSpec, _load, chip_names, load_chip
from schemas.config import load_pools
from tests.pricing.shared_reference import GOLDEN
from tests.pricing.test_deployments import DSPARK, DSV41, mhc_measured_kernel

DEPLOYMENTS = [
    GOLDEN,  # priced in both modes below
    Deployment(model="gpt-oss-120b", chip="h100", tp=4, cache_dtype="fp8"),
    Deployment(model="gpt-oss-120b", chip="b200", tp=2, cudagraph_mode="FULL_DECODE_ONLY"),
    Deployment(model="llama-3.1-8b-instruct", chip="h100", max_num_seqs=16, decode_threshold=4),
    Deployment(model="llama-3.1-70b-instruct", chip="a100", tp=8, cudagraph_mode="NONE"),
    Deployment(model="llama-3.1-70b-instruct", chip="h200", tp=32, nodes=4, dtype="fp8"),
    Deployment(model="qwen3-30b-a3b", chip="b200", tp=2, num_spec_tokens=1, cudagraph_mode="FULL"),
    Deployment(
        model="deepseek-v3",
        chip="h200",
        tp=8,
        expert_parallel=True,
        eplb_redundant_experts=32,
        all2all_backend="deepep_low_latency",
    ),
    Deployment(model="qwen3-30b-a3b", chip="h100", tp=2, data_parallel=4, expert_parallel=True),
    Deployment(model="deepseek-v3.2-exp", chip="b200", tp=8, cache_dtype="nvfp4_ds_mla"),
    Deployment(model="deepseek-v3", chip="h200", tp=8, decode_context_parallel=4),
    Deployment(
        model="deepseek-v3",
        chip="h200",
        tp=8,
        data_parallel=4,
        expert_parallel=True,
        all2all_backend="deepep_high_throughput",
    ),
    Deployment(model="qwen3-next-80b-a3b", chip="h200", tp=2, decode_threshold=4),
    Deployment(model="nemotron-h-8b", chip="h100", tp=2, cudagraph_mode="PIECEWISE"),
    Deployment(
        model="deepseek-v3",
        chip="gb200-nvl72",
        tp=8,
        nodes=2,
        data_parallel=18,
        expert_parallel=True,
        dtype="fp8",
    ),
    Deployment(
        model="deepseek-v3.2-exp",
        chip="h200",
        tp=4,
        prefill_context_parallel=2,
        cache_dtype="fp8_ds_mla",
    ),
    Deployment(model="kimi-k3", chip="h100", tp=8),
    DSPARK,  # its drafter's own graphs and ceiling
    DSV41,  # its hyper-connections at the graph's bytes here, at the measured form below
    DSV41.model_copy(update={"expert_parallel": True}),
]
# Deployments priced on their chip with the mHC kernels' measured form stated.
MEASURED_MHC = {len(DEPLOYMENTS) - 1}


@cache
def kernel_for(index: int, compat: str) -> Kernel:
    deployment = DEPLOYMENTS[index].model_copy(update={"compat": compat})
    if index in MEASURED_MHC:
        return mhc_measured_kernel(deployment)
    return Kernel.build(deployment)


requests = st.lists(
    st.tuples(st.one_of(st.integers(1, 3), st.integers(1, 4096)), st.integers(0, 60_000)),
    min_size=0,
    max_size=40,
)
deployment_index = st.integers(0, len(DEPLOYMENTS) - 1)
compat = st.sampled_from(["physics", "go"])


def _arrays(batch: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scheduled = np.array([s for s, _ in batch], dtype=np.int64)
    computed = np.array([c for _, c in batch], dtype=np.int64)
    return scheduled, computed, computed + scheduled


# ------------------------------------------------------------------ invariants
@settings(max_examples=150, deadline=None)
@given(deployment_index, compat, requests)
def test_overlap_never_exceeds_nooverlap_and_nooverlap_is_the_sum(index, mode, batch):
    price = kernel_for(index, mode).price(*_arrays(batch))
    assert price.overlap_us <= price.nooverlap_us
    total = price.sm_us + price.hbm_us + price.nvlink_us + price.nic_us + price.host_us
    assert price.nooverlap_us == pytest.approx(total, rel=1e-12)


@settings(max_examples=150, deadline=None)
@given(deployment_index, requests, st.tuples(st.integers(1, 4096), st.integers(0, 60_000)))
def test_adding_a_request_never_lowers_the_price(index, batch, extra):
    # The price is NoOverlap. A single resource (and so Overlap) may drop: a mixed step pays one
    # attention floor, which moves from HBM (decode) to SM (prefill) when a prompt joins. The
    # one other drop is the host's, by at most the captured graph's excess over eager
    # launches, when the request pushes the step past the capture ceiling.
    kernel = kernel_for(index, "physics")
    before = kernel.price(*_arrays(batch))
    after = kernel.price(*_arrays([*batch, extra]))
    tokens = sum(s for s, _ in batch)
    crossed = tokens <= kernel.capture_ceiling < tokens + extra[0]
    allowance = max(0.0, before.host_us - after.host_us) if crossed else 0.0
    assert after.nooverlap_us >= (before.nooverlap_us - allowance) * (1 - 1e-12)


@settings(max_examples=150, deadline=None)
@given(deployment_index, compat, requests)
def test_slot_parts_sum_to_nooverlap(index, mode, batch):
    kernel = kernel_for(index, mode)
    arrays = _arrays(batch)
    work = kernel.slot_work(*arrays)
    price = kernel.price(*arrays)
    assert work.slot_us.shape == (len(batch), 5)
    assert (work.slot_us >= 0).all()
    assert (work.fixed_us >= 0).all()
    total = work.fixed_us.sum() + work.slot_us.sum()
    assert total == pytest.approx(price.nooverlap_us, rel=1e-9)
    per_resource = work.fixed_us + work.slot_us.sum(axis=0)
    expected = [price.sm_us, price.hbm_us, price.nvlink_us, price.nic_us, price.host_us]
    np.testing.assert_allclose(per_resource, expected, rtol=1e-9, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(deployment_index, compat, st.lists(requests, min_size=1, max_size=6))
def test_many_steps_match_one_step_at_a_time(index, mode, steps):
    kernel = kernel_for(index, mode)
    step_index = np.concatenate([np.full(len(b), i, dtype=np.int64) for i, b in enumerate(steps)])
    arrays = [np.concatenate([_arrays(b)[j] for b in steps]) for j in range(3)]
    many = kernel.price_many(Slots(step_index, *arrays), n_steps=len(steps))
    fixed, slots = kernel.slot_work_many(Slots(step_index, *arrays), n_steps=len(steps))
    for i, batch in enumerate(steps):
        one = kernel.price(*_arrays(batch))
        assert many.nooverlap_us[i] == pytest.approx(one.nooverlap_us, rel=1e-12)
        assert many.overlap_us[i] == pytest.approx(one.overlap_us, rel=1e-12)
        assert many.bottleneck_names[i] == one.bottleneck
        total = fixed[i].sum() + slots[step_index == i].sum()
        assert total == pytest.approx(one.nooverlap_us, rel=1e-9)


# ------------------------------------------------------------------ hand-checked terms
def test_empty_step_costs_host_only():
    kernel = kernel_for(0, "go")
    price = kernel.price([], [], [])
    assert (
        price.nooverlap_us
        == price.overlap_us
        == price.host_us
        == pytest.approx(62 * 7.0 + 972 * 3.2)
    )
    assert price.bottleneck == "host"
    prices = kernel.price_many(Slots(np.array([0, 2]), [1, 1], [10, 10], [10, 10]), n_steps=4)
    np.testing.assert_allclose(prices.nooverlap_us[[1, 3]], 62 * 7.0 + 972 * 3.2)


LLAMA_8B_LAYER_WEIGHT_BYTES = (6144 * 4096 + 4096 * 4096 + 28672 * 4096 + 4096 * 14336) * 2
H100_BANDWIDTH = 3.35e6 * 0.8
# A Llama layer's two norms, each a memory op paying the 3 us latency besides its bytes.
LLAMA_LAYER_MEMORY_OPS_US = 2 * 3.0


def test_llama_decode_layer_by_hand():
    kernel = Kernel.build(Deployment(model="llama-3.1-8b-instruct", chip="h100"))
    layer = kernel.price([1, 1], [999, 1999], [999, 1999]).per_kind["decoder"]
    kv_per_token = 2 * 8 * 128 * 2
    hbm = (
        (LLAMA_8B_LAYER_WEIGHT_BYTES + 2 * 2 * 16384) / H100_BANDWIDTH
        + LLAMA_LAYER_MEMORY_OPS_US
        + 14.5
        + 3000 * kv_per_token / 2_412_000
    )
    assert layer["hbm_us"] == pytest.approx(hbm, rel=1e-12)
    # The GEMMs' arithmetic at eps(2), 2 FLOP per bf16 weight: 75.8 us, under their 162.8 us
    # weight read, so the read is their time and SM carries none of it.
    flops = 2 * LLAMA_8B_LAYER_WEIGHT_BYTES / 2
    assert 2 * flops / (989.5e6 * 1.0 * 2 / 172) == pytest.approx(75.82, abs=0.01)
    read = LLAMA_8B_LAYER_WEIGHT_BYTES / H100_BANDWIDTH
    assert read == pytest.approx(162.77, abs=0.01)
    assert layer["sm_us"] == 0.0
    assert layer["nvlink_us"] == 0.0
    go = Kernel.build(Deployment(model="llama-3.1-8b-instruct", chip="h100", compat="go"))
    go_layer = go.price([1, 1], [999, 1999], [999, 1999]).per_kind["decoder"]
    assert go_layer["sm_us"] == pytest.approx(2 * flops / (989.5e6 * 1.0 * 2 / 172), rel=1e-12)
    assert go_layer["hbm_us"] == pytest.approx(hbm - LLAMA_LAYER_MEMORY_OPS_US, rel=1e-12)


def test_a_gemm_costs_its_arithmetic_once_past_its_weight_read():
    kernel = Kernel.build(Deployment(model="llama-3.1-8b-instruct", chip="h100"))
    # 512 tokens of prefill, so no decode read: at eps(512) the arithmetic, 2 FLOP per bf16
    # weight over 989.5 x 512 / 682 FLOP/us, is 300.7 us past the 162.8 us weight read, which
    # it hides: SM carries it all and HBM only the activations and the norms' latency.
    layer = kernel.price([512], [0], [512]).per_kind["decoder"]
    flops = 2 * LLAMA_8B_LAYER_WEIGHT_BYTES / 2
    gemm = 512 * flops / (989.5e6 * 1.0 * 512 / 682)
    assert gemm == pytest.approx(300.65, abs=0.01)
    attention = 19.5 + 4 * (512 * 512 / 2) * 32 * 128 / (989.5e6 * (1.0 * 512 / 682) * 0.40)
    assert layer["sm_us"] == pytest.approx(gemm + attention, rel=1e-12)
    hbm = 512 * 2 * 16384 / H100_BANDWIDTH + LLAMA_LAYER_MEMORY_OPS_US
    assert layer["hbm_us"] == pytest.approx(hbm, rel=1e-12)


def test_slot_work_by_hand_for_two_llama_decodes():
    kernel = Kernel.build(Deployment(model="llama-3.1-8b-instruct", chip="h100"))
    work = kernel.slot_work([1, 1], [999, 2999], [999, 2999])
    flops_per_token = 32 * LLAMA_8B_LAYER_WEIGHT_BYTES + 2 * 128256 * 4096  # 2 FLOP per bf16 weight
    gemm_us_per_token = flops_per_token / (989.5e6 * 1.0)
    head_bytes = 128256 * 4096 * 2
    # At two tokens every GEMM's weight read outlasts its arithmetic, so each GEMM costs its
    # read, on HBM: each token's arithmetic at eps_max is its own there, the rest of the read
    # is fixed.
    fixed = [
        0.0,
        32 * (LLAMA_8B_LAYER_WEIGHT_BYTES / H100_BANDWIDTH + LLAMA_LAYER_MEMORY_OPS_US + 14.5)
        + head_bytes / H100_BANDWIDTH
        - 2 * gemm_us_per_token,
        0.0,
        0.0,
        7.0 + 258 * 3.2,  # one full-graph replay + 258 kernels dispatched
    ]
    np.testing.assert_allclose(work.fixed_us, fixed, rtol=1e-12)
    activations = 32 * 2 * 16384 / H100_BANDWIDTH
    reads = [32 * context * 4096 / 2_412_000 for context in (1000, 3000)]
    np.testing.assert_allclose(
        work.slot_us,
        [
            [0, gemm_us_per_token + activations + reads[0], 0, 0, 0],
            [0, gemm_us_per_token + activations + reads[1], 0, 0, 0],
        ],
        rtol=1e-12,
    )
    # Under compat "go" the arithmetic stays on SM, its m_half overhead fixed, and the weights
    # are read besides.
    go = Kernel.build(Deployment(model="llama-3.1-8b-instruct", chip="h100", compat="go"))
    go_work = go.slot_work([1, 1], [999, 2999], [999, 2999])
    np.testing.assert_allclose(
        go_work.fixed_us[:2],
        [
            gemm_us_per_token * 170,
            fixed[1] + 2 * gemm_us_per_token - 32 * LLAMA_LAYER_MEMORY_OPS_US,
        ],
        rtol=1e-12,
    )
    np.testing.assert_allclose(go_work.slot_us[:, 0], [gemm_us_per_token] * 2, rtol=1e-12)


def test_mixed_step_pays_one_attention_floor_and_prefill_at_its_own_ramp():
    kernel = Kernel.build(Deployment(model="llama-3.1-8b-instruct", chip="h100"))
    layer = kernel.price([1, 100], [999, 0], [999, 100]).per_kind["decoder"]
    # H100: prefill floor 19.5 > decode floor 14.5, so the decode floor is not paid
    hbm = (
        (LLAMA_8B_LAYER_WEIGHT_BYTES + 101 * 2 * 16384) / H100_BANDWIDTH
        + LLAMA_LAYER_MEMORY_OPS_US
        + 1000 * 4096 / 2_412_000
    )
    assert layer["hbm_us"] == pytest.approx(hbm, rel=1e-12)
    # at eps(101) the GEMMs' arithmetic (119.5 us) is under their weight read (162.8 us), which
    # HBM already carries: SM holds the prefill attention alone
    gemm = 101 * LLAMA_8B_LAYER_WEIGHT_BYTES / (989.5e6 * 1.0 * 101 / 271)
    assert gemm == pytest.approx(119.47, abs=0.01)
    # physics: the 100-token prompt's attention at eps(100) of the bf16 ramp
    attention = 19.5 + 4 * (100 * 100 / 2) * 32 * 128 / (989.5e6 * (1.0 * 100 / 270) * 0.40)
    assert layer["sm_us"] == pytest.approx(attention, rel=1e-12)
    go = Kernel.build(Deployment(model="llama-3.1-8b-instruct", chip="h100", compat="go"))
    go_layer = go.price([1, 100], [999, 0], [999, 100]).per_kind["decoder"]
    go_attention = 19.5 + 4 * 5000 * 32 * 128 / (989.5e6 * (1.0 * 101 / 271) * 0.40)
    assert go_layer["sm_us"] == pytest.approx(gemm + go_attention, rel=1e-12)


def test_sliding_window_reads_at_most_the_window_unless_go():
    physics = Kernel.build(Deployment(model="gpt-oss-120b", chip="h100", tp=4))
    go = Kernel.build(Deployment(model="gpt-oss-120b", chip="h100", tp=4, compat="go"))
    batch = ([1], [4095], [4095])
    swa_physics, swa_go = (
        physics.price(*batch).per_kind["swa_moe"],
        go.price(*batch).per_kind["swa_moe"],
    )
    kv_per_token = 2 * 2 * 64 * 2  # 8 KV heads over TP4, bf16
    # physics also pays its two norms' memory-op latency, which the Go kernel does not price
    norms_us = 2 * 3.0
    assert swa_go["hbm_us"] - swa_physics["hbm_us"] == pytest.approx(
        (4096 - 128) * kv_per_token / 871_000 - norms_us, rel=1e-9
    )
    assert physics.price(*batch).per_kind["full_moe"]["hbm_us"] == pytest.approx(
        go.price(*batch).per_kind["full_moe"]["hbm_us"] + norms_us, rel=1e-12
    )


def test_host_time_follows_the_graph_mode_and_the_capture_ceiling():
    # llama-3.1-8b TP1: 32 layers x 8 kernels + 2 head kernels; max_num_seqs 16 -> ceiling 32 tokens
    kernel = kernel_for(3, "physics")
    dispatch = 258 * 3.2
    assert kernel.price([1] * 4, [10] * 4, [10] * 4).host_us == pytest.approx(7.0 + dispatch)
    assert kernel.price([1, 2], [10, 10], [10, 10]).host_us == pytest.approx(7.0 * 33 + dispatch)
    assert kernel.price([1] * 40, [10] * 40, [10] * 40).host_us == pytest.approx(
        7.0 * 32 + dispatch
    )
    # past the ceiling the engine runs eager: 32 layers of launches, below the 33 replays
    assert kernel.price([40], [0], [40]).host_us == pytest.approx(7.0 * 32 + dispatch)


def test_cross_node_collectives_go_to_nic_with_the_span_factor():
    # TP32 over 4 nodes: the widest measured all-reduce (8 GPUs) with bytes spread over the
    # 3 slower inter-node hops of 31: span = 1 + (450 / 50 - 1) * 3 / 31
    price = kernel_for(5, "physics").price([1], [100], [100])
    span = 1 + (450 / 50 - 1) * 3 / 31
    assert price.nvlink_us == 0.0
    assert price.per_kind["decoder"]["nic_us"] == pytest.approx(
        2 * (4.71 + 8192 * 2 * span / 104250), rel=1e-12
    )
    assert price.nic_us == pytest.approx(80 * price.per_kind["decoder"]["nic_us"], rel=1e-12)


def test_kv_bytes_per_token_whole_replica():
    assert (
        Kernel.build(Deployment(model="llama-3.1-8b-instruct", chip="h100")).kv_bytes_per_token
        == 131072
    )
    assert (
        Kernel.build(
            Deployment(model="llama-3.1-70b-instruct", chip="h100", tp=8, cache_dtype="fp8")
        ).kv_bytes_per_token
        == 8 * 80 * 2 * 1 * 128
    )
    deepseek = kernel_for(0, "physics")
    assert deepseek.kv_bytes_per_token == 8 * 35136  # the latent is replicated on every rank
    packed = Kernel.build(DEPLOYMENTS[0].model_copy(update={"cache_dtype": "fp8_ds_mla"}))
    assert packed.kv_bytes_per_token == 8 * 61 * 656
    gpt_oss = Kernel.build(Deployment(model="gpt-oss-120b", chip="h100", tp=4))
    per_layer_all_ranks = 4 * 2 * 2 * 64 * 2
    assert gpt_oss.kv_bytes_per_token == 18 * per_layer_all_ranks  # full layers only
    np.testing.assert_array_equal(
        gpt_oss.kv_bytes([1000, 100, 0]),
        [
            1000 * 18 * per_layer_all_ranks + 128 * 18 * per_layer_all_ranks,
            100 * 18 * per_layer_all_ranks + 100 * 18 * per_layer_all_ranks,
            0,
        ],
    )


def test_a_pools_deployment_uses_the_pool_and_engine_settings():
    pools = load_pools()
    chat = pools.pool("chat-8b").deployment()
    # every field the pool states; the rest at the deployment's defaults
    stated = dict(model="llama-3.1-8b-instruct", chip="h100", dtype="bf16", cache_dtype="bf16")
    engine = dict(cudagraph_mode="FULL_AND_PIECEWISE", max_num_seqs=256, decode_threshold=1)
    assert chat == Deployment(**stated, **engine, tp=1, nodes=1, num_spec_tokens=0)
    reason = pools.pool("reason-dsv3").deployment()
    assert (
        reason.chip,
        reason.tp,
        reason.nodes,
        reason.num_spec_tokens,
        reason.cudagraph_mode,
    ) == ("h200", 8, 1, 1, "PIECEWISE")
    Kernel.build(reason)
    wide = pools.pool("reason-dsv3").model_copy(
        update={
            "gpus_per_replica": 16,
            "data_parallel": 4,
            "expert_parallel": True,
            "eplb_redundant_experts": 32,
            "decode_context_parallel": 2,
        }
    )
    expert = wide.deployment()
    assert expert.decode_context_parallel == 2
    assert (expert.tp, expert.nodes, expert.data_parallel, expert.moe_group) == (4, 1, 4, 16)
    assert (expert.expert_parallel, expert.eplb_redundant_experts) == (True, 32)


def test_a_pool_whose_gpus_do_not_divide_into_its_data_parallel_replicas_is_refused():
    raw = load_pools().pool("chat-8b").model_dump()
    raw.update(gpus_per_replica=1, data_parallel=2)
    with pytest.raises(ValueError, match="not a multiple of data_parallel 2"):
        type(load_pools().pool("chat-8b")).model_validate(raw)


def test_a_pools_file_cudagraph_mode_is_read_in_any_case():
    raw = load_pools().pool("chat-8b").model_dump()
    raw["engine"]["cudagraph_mode"] = "piecewise"
    pool = type(load_pools().pool("chat-8b")).model_validate(raw)
    assert pool.deployment().cudagraph_mode == "PIECEWISE"


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("deployment", "message"),
    [
        (Deployment(model="llama-9", chip="h100"), "unknown model 'llama-9'"),
        (Deployment(model="llama-3.1-8b-instruct", chip="mi300"), "unknown chip 'mi300'"),
        (
            Deployment(model="llama-3.1-8b-instruct", chip="h100", tp=3),
            "all_reduce collective for a group of 3 GPUs",
        ),
        (
            Deployment(model="llama-3.1-8b-instruct", chip="h100", tp=16, nodes=2),
            "no inter_node_gb_s",
        ),
        (
            Deployment(model="llama-3.1-70b-instruct", chip="h200", tp=16, nodes=2),
            "group of 16 GPUs",
        ),
        (
            Deployment(model="llama-3.1-8b-instruct", chip="h100", tp=16),
            "does not fit 'h100' nodes of 8 GPUs",
        ),
        (
            Deployment(model="llama-3.1-8b-instruct", chip="h100", dtype="fp6"),
            "unknown dtype 'fp6'",
        ),
        (
            Deployment(model="llama-3.1-8b-instruct", chip="h100", cache_dtype="int3"),
            "unknown cache dtype 'int3'",
        ),
    ],
)
def test_bad_deployments_name_what_is_missing(deployment, message):
    with pytest.raises(PricingError, match=message):
        Kernel.build(deployment)


def test_bad_batches_name_the_field():
    kernel = kernel_for(3, "physics")
    with pytest.raises(PricingError, match=r"scheduled\[1\] is negative \(-2\)"):
        kernel.price([1, -2], [0, 0], [0, 0])
    with pytest.raises(PricingError, match="differ in length"):
        kernel.price([1, 2], [0], [0, 0])
    with pytest.raises(PricingError, match="whole token counts"):
        kernel.price([1.5], [0], [0])
    with pytest.raises(PricingError, match="outside 0..1"):
        kernel.price_many(Slots([0, 2], [1, 1], [0, 0], [0, 0]), n_steps=2)


def _refused(tmp_path: Path, source: str, edits: dict[str, str], message: str) -> None:
    """A copy of pricing's `source` data file ("chips/h100") with `edits` applied is refused
    with `message`, which names the copy's file and field."""
    directory, name = source.split("/")
    text = (Path(__file__).resolve().parents[2] / "pricing" / f"{source}.yaml").read_text()
    for old, new in {f"name: {name}": "name: copy", **edits}.items():
        text = text.replace(old, new)
    (tmp_path / "copy.yaml").write_text(text)

    def load_copy() -> ChipSpec | ModelSpec:
        if directory == "chips":
            return _load(tmp_path, "copy", "chip", ChipSpec)
        return _load(tmp_path, "copy", "model", ModelSpec)

    with pytest.raises(PricingError, match=message):
        load_copy()


def test_bad_data_files_name_file_and_field(tmp_path: Path):
    _refused(
        tmp_path,
        "chips/h100",
        {"hbm_derate: 0.8": "hbm_derate: 1.8"},
        r"copy.yaml: field gemm.hbm_derate",
    )
    # a collective's rates are checked here, once, not by the law on every step
    _refused(
        tmp_path,
        "chips/h100",
        {"2: [4.18, 128000,": "2: [4.18, 0,"},
        r"copy.yaml: field collectives.all_reduce.2.1",
    )
    _refused(
        tmp_path,
        "models/llama-3.1-8b-instruct",
        {"kv_heads: 8": "kv_heads: 4"},
        r"copy.yaml: .*kv_bytes_per_token_tp1\[bf16\] states 131072 but the attention nodes give 65536",
    )
    _refused(
        tmp_path,
        "models/nemotron-h-8b",
        {"key_heads: 8,": "key_heads: 3,"},
        r"copy.yaml: field layer_kinds.0.nodes.2.recurrent: .*key_heads 3 must divide",
    )


def test_go_compat_keeps_the_single_step_ramp_on_prefill_attention():
    # Under the Go kernel's one eps(T) per step, a decode row joining a long-context prefill
    # chunk raises the ramp of the chunk's attention and lowers the step's price; the default
    # prices each prompt's attention at its own ramp and never drops.
    deployment = Deployment(model="deepseek-v3", chip="h200", tp=8, dtype="fp8", decode_threshold=8)
    chunk, with_decode = ([9], [100_000], [100_009]), ([9, 1], [100_000, 0], [100_009, 0])
    go = Kernel.build(deployment.model_copy(update={"compat": "go"}))
    assert go.price(*with_decode).nooverlap_us < go.price(*chunk).nooverlap_us
    physics = Kernel.build(deployment)
    assert physics.price(*with_decode).nooverlap_us > physics.price(*chunk).nooverlap_us


def test_each_chip_names_the_engine_release_its_coefficients_were_measured_on():
    measured = {name: load_chip(name).measured_engine for name in chip_names()}
    assert {name: (engine.name, engine.version) for name, engine in measured.items()} == {
        "a100": ("vllm", "0.14.0"),
        "b200": ("vllm", "0.27.1"),
        "gb200-nvl72": ("vllm", "0.27.1"),  # B200's sweep, reused for the same die
        "h100": ("vllm", "0.25.0"),
        "h200": ("vllm", "0.25.0"),
    }
    kernel = Kernel.build(Deployment(model="llama-3.1-8b-instruct", chip="h200"))
    assert (kernel.measured_engine.name, kernel.measured_engine.version) == ("vllm", "0.25.0")


def test_a_chip_without_its_measured_engine_is_refused(tmp_path: Path):
    good = (Path(__file__).resolve().parents[2] / "pricing" / "chips" / "h100.yaml").read_text()
    without = "".join(
        line for line in good.splitlines(keepends=True) if not line.startswith("measured_engine:")
    )
    (tmp_path / "x2.yaml").write_text(without.replace("name: h100", "name: x2"))
    with pytest.raises(PricingError, match=r"x2.yaml: field measured_engine: Field required"):
        _load(tmp_path, "x2", "chip", ChipSpec)
    _refused(
        tmp_path,
        "chips/h100",
        {'version: "0.25.0"': 'version: ""'},
        r"copy.yaml: field measured_engine.version: String should have at least 1 character",
    )


def test_every_coefficient_states_whether_it_was_measured_or_assumed(tmp_path: Path):
    h200 = load_chip("h200")
    assert h200.attention.decode["mla"].basis == {
        "floor_us": "assumed",
        "rate_bytes_per_us": "measured",
    }
    assert h200.host.basis["dispatch_per_kernel_us"] == "fitted"
    _refused(
        tmp_path,
        "chips/h100",
        {"basis: {floor_us: measured, work_scale: measured}": "basis: {floor_us: measured}"},
        r"copy.yaml: field attention.prefill: .*missing \['work_scale'\]",
    )


def test_the_version_changes_with_the_chip_file_the_model_file_and_the_deployment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    deployment = Deployment(model="llama-3.1-8b-instruct", chip="h100")
    kernel = Kernel.build(deployment)
    assert kernel.version == Kernel.build(deployment).version
    assert kernel.version.startswith("kernel-llama-3.1-8b-instruct-h100-tp1-")
    assert Kernel.build(deployment.model_copy(update={"tp": 2})).version != kernel.version
    for directory, name in (("CHIPS_DIR", "h100"), ("MODELS_DIR", "llama-3.1-8b-instruct")):
        edited = tmp_path / directory
        edited.mkdir()
        text = (getattr(spec, directory) / f"{name}.yaml").read_text()
        (edited / f"{name}.yaml").write_text(text + "# a comment is a change of the file\n")
        with monkeypatch.context() as patched:
            patched.setattr(spec, directory, edited)
            spec.load_chip.cache_clear()
            spec.load_model.cache_clear()
            assert Kernel.build(deployment).version != kernel.version
        spec.load_chip.cache_clear()
        spec.load_model.cache_clear()
    assert Kernel.build(deployment).version == kernel.version
