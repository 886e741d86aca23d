"""Deployments beyond one TP group: expert parallelism with EPLB, attention data parallelism;
and the laws of one model's own kernels (DeepSeek-V4.1's hyper-connections, its DSpark drafter).

Each law checked by hand on one step; that every slot split still sums to the step's NoOverlap
is the property tests' job (test_kernel.DEPLOYMENTS holds these deployments).
"""

from __future__ import annotations

from math import comb

import pytest
from pydantic import ValidationError

from pricing import Deployment, Kernel, PricingError, load_chip, load_model
from pricing.plan import MeasuredRecurrent
from pricing.spec import HyperConnectionBlock

H200_READ = 4.8e6 * 0.8  # bytes per us
# Every elementwise kernel (a norm) pays the chip's memory-op latency on top of its bytes.
MEMORY_OP_US = 3.0
H200_FP8 = 1.979e9  # FLOP per us
EXPERT_BYTES = 3 * 2048 * 7168  # one DeepSeek-V3 expert, fp8
EXPERT_FLOPS = 6 * 2048 * 7168
DSV3 = dict(model="deepseek-v3", chip="h200", tp=8, dtype="fp8")


def _decode(kernel: Kernel, batch: int):
    return kernel.price([1] * batch, [4095] * batch, [4096] * batch)


def _busiest(experts: int, reached: float, ranks: int) -> float:
    """The expected largest of `ranks` binomial(experts, reached) counts, summed from the
    distribution function: E[max] = sum over x < experts of 1 - P(count <= x)^ranks."""
    below = 0.0
    total = 0.0
    for x in range(experts):
        below += comb(experts, x) * reached**x * (1 - reached) ** (experts - x)
        total += 1 - min(below, 1.0) ** ranks
    return total


def test_expert_parallel_with_eplb_prices_the_busiest_rank_by_hand():
    kernel = Kernel.build(Deployment(**DSV3, expert_parallel=True, eplb_redundant_experts=32))
    moe = _decode(kernel, 1).per_kind["attn_moe"]
    # 256 + 32 physical experts over 8 ranks: 36 whole experts on each, 36/288 of the routing
    local = 36
    flops = 8 * EXPERT_FLOPS * 0.999 * local / 288
    assert moe["expert_sm_us"] == pytest.approx(flops * (1 + 113) / (H200_FP8 * 0.736), rel=1e-12)
    # a logical expert's tokens are dealt over its copies: one token reaches a given physical
    # expert with chance 8/288, and the busiest of the 8 ranks reads its touched experts whole
    assert moe["expert_hbm_us"] == pytest.approx(
        _busiest(local, 8 / 288, 8) * EXPERT_BYTES / H200_READ, rel=1e-12
    )
    # attention and MLP all-reduces (4.71 us + 14336 B at 104,250 B/us each) and the MoE
    # dispatch over the default all-gather/reduce-scatter backend (7.39 us + 14336 B at 143,750)
    assert moe["nvlink_us"] == pytest.approx(
        2 * (4.71 + 14336 / 104250) + 7.39 + 14336 / 143750, rel=1e-12
    )


def test_expert_parallel_under_go_compat_shares_routing_and_coverage_over_physical_experts():
    deployment = Deployment(**DSV3, expert_parallel=True, eplb_redundant_experts=32, compat="go")
    moe = _decode(Kernel.build(deployment), 1).per_kind["attn_moe"]
    # Go kernel (new.go localExpertShare = heaviest / (experts + redundant)): FLOPs_r = T_r *
    # top_k * L / E_phys * F_e * imbalance, L = ceil((256 + 32) / 8) = 36, E_phys = 288
    flops = 1 * 8 * (36 / 288) * EXPERT_FLOPS * 0.999
    assert moe["expert_sm_us"] == pytest.approx(flops * (1 + 113) / (H200_FP8 * 0.736), rel=1e-12)
    # Bytes_r = W_e * L * (1 - ((E_phys - k) / E_phys)^T_r), whole experts (one shard under EP)
    assert moe["expert_hbm_us"] == pytest.approx(36 * (8 / 288) * EXPERT_BYTES / H200_READ)


def test_attention_dp_under_go_compat_ramps_the_routed_gemm_at_the_steps_own_tokens():
    deployment = Deployment(
        model="deepseek-v3", chip="h200", tp=1, data_parallel=8, expert_parallel=True, compat="go"
    )
    moe = _decode(Kernel.build(deployment), 1).per_kind["attn_moe"]
    # 8 replicas' tokens reach the 32 experts of each rank, but eps is taken at T = 1:
    # T_r * top_k * (32 / 256) * F_e * imbalance / (peak * eps(1)), eps(1) = 0.736 / 114
    flops = 8 * 8 * (32 / 256) * EXPERT_FLOPS * 0.999
    assert moe["expert_sm_us"] == pytest.approx(flops * (1 + 113) / (H200_FP8 * 0.736), rel=1e-12)


def test_a_point_to_point_dispatch_moves_each_token_to_its_top_k():
    gathered = Kernel.build(Deployment(**DSV3, expert_parallel=True))
    direct = Kernel.build(
        Deployment(**DSV3, expert_parallel=True, all2all_backend="deepep_low_latency")
    )
    difference = (
        _decode(direct, 4).per_kind["attn_moe"]["nvlink_us"]
        - _decode(gathered, 4).per_kind["attn_moe"]["nvlink_us"]
    )
    assert difference == pytest.approx(4 * 14336 * (8 - 1) / 143750, rel=1e-12)


def test_expert_parallel_reads_whole_experts_where_tp_reads_shards():
    tp = _decode(Kernel.build(Deployment(**DSV3)), 256).per_kind["attn_moe"]
    ep = _decode(Kernel.build(Deployment(**DSV3, expert_parallel=True)), 256).per_kind["attn_moe"]
    touched = 1 - (248 / 256) ** 256
    # TP: every rank reads its eighth of every touched expert, the same on every rank
    assert tp["expert_hbm_us"] == pytest.approx(256 * touched * EXPERT_BYTES / 8 / H200_READ)
    # EP: the busiest of the 8 ranks of 32 whole experts, above the mean rank's 32 x touched
    assert ep["expert_hbm_us"] == pytest.approx(
        _busiest(32, touched, 8) * EXPERT_BYTES / H200_READ, rel=1e-12
    )
    assert _busiest(32, touched, 8) > 32 * touched


def test_attention_data_parallel_funnels_every_replicas_tokens_into_the_experts():
    kernel = Kernel.build(
        Deployment(model="deepseek-v3", chip="h200", tp=1, data_parallel=8, expert_parallel=True)
    )
    price = _decode(kernel, 2)
    moe = price.per_kind["attn_moe"]
    # 8 attention replicas of 2 decodes each: 16 tokens reach the 32 experts of each rank
    assert moe["expert_sm_us"] == pytest.approx(
        8 * EXPERT_FLOPS * 0.999 * 32 / 256 * (16 + 113) / (H200_FP8 * 0.736), rel=1e-12
    )
    assert moe["expert_hbm_us"] == pytest.approx(
        _busiest(32, 1 - (248 / 256) ** 16, 8) * EXPERT_BYTES / H200_READ, rel=1e-12
    )
    # TP 1: no all-reduce; the dispatch spans the 8-rank MoE group
    assert moe["nvlink_us"] == pytest.approx(7.39 + 2 * 14336 / 143750, rel=1e-12)
    # TP 1: a dense layer reads all of its 583,467,008 weight bytes, four norms' activations
    # per token, and the bf16 latent cache of both decodes (1,152 B per token) after the floor
    assert price.per_kind["attn_dense"]["hbm_us"] == pytest.approx(
        (583_467_008 + 2 * 4 * 28672) / H200_READ
        + 4 * MEMORY_OP_US
        + 13.5
        + 2 * 4096 * 1152 / 2.928e6,
        rel=1e-12,
    )


def test_expert_options_without_expert_parallelism_are_refused():
    with pytest.raises(ValidationError, match="eplb_redundant_experts needs expert_parallel"):
        Deployment(**DSV3, eplb_redundant_experts=32)
    with pytest.raises(ValidationError, match="deepep_low_latency.*needs expert_parallel"):
        Deployment(**DSV3, all2all_backend="deepep_low_latency")


def test_a_moe_group_across_nodes_dispatches_over_the_nic():
    kernel = Kernel.build(
        Deployment(
            **DSV3, data_parallel=4, expert_parallel=True, all2all_backend="deepep_high_throughput"
        )
    )
    moe = _decode(kernel, 1).per_kind["attn_moe"]
    # 32 ranks on 4 nodes: the widest measured all2all (8: 7.39 us, 143,750 B/us); each token to
    # its 8 experts, 24 of the 31 peers off the node at 450/50 = 9x the NVLink time
    span = 1 + (9 - 1) * 24 / 31
    assert moe["nic_us"] == pytest.approx(7.39 + 8 * 14336 * span / 143750, rel=1e-12)
    # the all-reduces stay within this replica's TP group, over its own token
    assert moe["nvlink_us"] == pytest.approx(2 * (4.71 + 14336 / 104250), rel=1e-12)


def test_an_nvfp4_kv_cache_holds_and_reads_four_bits_and_a_scale_per_16_elements():
    kernel = Kernel.build(
        Deployment(model="llama-3.1-8b-instruct", chip="b200", cache_dtype="nvfp4")
    )
    # 8 KV heads x 128 x (K and V) x (0.5 + 1/16) bytes = 1,152 B per token per layer
    assert kernel.kv_bytes_per_token == 32 * 1152
    bf16 = Kernel.build(Deployment(model="llama-3.1-8b-instruct", chip="b200"))
    layer, bf16_layer = (
        k.price([1], [4095], [4096]).per_kind["decoder"]["hbm_us"] for k in (kernel, bf16)
    )
    # B200 full-attention decode rate 6,776,000 B/us over the 4,096-token context
    assert bf16_layer - layer == pytest.approx(4096 * (4096 - 1152) / 6_776_000, rel=1e-12)
    latent = Kernel.build(
        Deployment(model="deepseek-v3", chip="b200", tp=8, cache_dtype="nvfp4_ds_mla")
    )
    assert latent.kv_bytes_per_token == 8 * 61 * 352  # a full latent copy on every rank


def test_an_nvfp4_kv_cache_off_blackwell_is_refused():
    with pytest.raises(PricingError, match="nvfp4 KV cache needs a part with four-bit attention"):
        Kernel.build(Deployment(model="llama-3.1-8b-instruct", chip="h100", cache_dtype="nvfp4"))


DSV32 = Deployment(model="deepseek-v3.2-exp", chip="h200", tp=8, cache_dtype="fp8_ds_mla")


def test_sparse_mla_reads_the_selected_positions_and_its_indexer_scans_the_context():
    price = Kernel.build(DSV32).price([1], [32767], [32768])
    dense = price.per_kind["attn_dense"]
    # weights, 4 norms, the 2,048 selected latents (656 B) at the sparse rate after its floor,
    # and the indexer's scan of all 32,768 index keys (132 B) at the full-attention pair
    assert dense["hbm_us"] == pytest.approx(
        (583_467_008 / 8 + 4 * 28672 / 8) / H200_READ
        + 4 * MEMORY_OP_US
        + 13.5
        + 2048 * 656 / 398_400
        + 13.5
        + 32768 * 132 / 2_592_000,
        rel=1e-12,
    )


def test_sparse_prefill_attends_its_top_k_and_the_indexer_scores_every_pair():
    kernel = Kernel.build(DSV32)
    layer = kernel.price([4096], [0], [4096]).per_kind["attn_dense"]
    gemm_flops = 1_166_934_016 / 8 * (4096 + 113) / (H200_FP8 * 0.736)
    # attention: each query sees at most 2,048 keys; bf16 ramp at the prompt's own 4,096 rows
    pairs = 2048 * 2048 / 2 + (4096 - 2048) * 2048
    rate = 989.5e6 * 0.992 * 4096 / (4096 + 110) * 0.40
    attention = 18.5 + 2 * pairs * 128 * (192 + 128) / 8 / rate
    # indexer: 64 heads x 128 logits on every causal pair, on every rank, no value product
    indexer = 18.5 + 2 * (4096 * 4096 / 2) * 64 * 128 / rate
    assert layer["sm_us"] == pytest.approx(gemm_flops + attention + indexer, rel=1e-12)


def test_a_sparse_model_launches_and_splits_at_its_indexers():
    kernel = Kernel.build(DSV32.model_copy(update={"cudagraph_mode": "PIECEWISE"}))
    assert kernel.plan.host.kernels == 972 + 61 * 2
    assert kernel.price([1, 2], [10, 10], [11, 12]).host_us == pytest.approx(
        7.0 * (61 + 61 + 1) + (972 + 122) * 3.2
    )
    # every rank holds the packed latent and the indexer's key of each token
    assert kernel.kv_bytes_per_token == 8 * 61 * (656 + 132)


def test_decode_context_parallel_reads_a_dealt_share_and_combines_by_hand():
    kernel = Kernel.build(
        Deployment(model="deepseek-v3", chip="h200", tp=8, decode_context_parallel=8)
    )
    dense = kernel.price([1], [4099], [4100]).per_kind["attn_dense"]
    # the busiest rank holds ceil(4,100 / 8) = 513 of the request's bf16 latents (1,152 B)
    assert dense["hbm_us"] == pytest.approx(
        (583_467_008 / 8 + 4 * 28672 / 8) / H200_READ
        + 4 * MEMORY_OP_US
        + 13.5
        + 513 * 1152 / 2_928_000,
        rel=1e-12,
    )
    # two TP all-reduces, then the group gathers 16 heads x 8 ranks of 576-wide queries and
    # each rank's fp32 log-sum-exp per head, and reduce-scatters 512-wide outputs (h200
    # all_gather/reduce_scatter at width 8)
    assert dense["nvlink_us"] == pytest.approx(
        2 * (4.71 + 14336 / 104250)
        + (10.30 + 16 * 8 * 576 * 2 / 148_500)
        + (10.30 + 8 * 16 * 8 * 4 / 148_500)
        + (10.24 + 16 * 8 * 512 * 2 / 177_750),
        rel=1e-12,
    )
    # each token's latent is held once in the group: an eighth of the TP-replicated copies
    assert kernel.kv_bytes_per_token == 61 * 1152
    # three combine launches a layer
    assert kernel.plan.host.kernels == 972 + 61 * 3


def test_decode_context_parallel_gathers_a_prefills_cached_context_instead_of_combining():
    kernel = Kernel.build(
        Deployment(model="deepseek-v3", chip="h200", tp=8, decode_context_parallel=8)
    )
    dense = kernel.price([2048], [32768], [34816]).per_kind["attn_dense"]
    # a prefill row attends its whole context: the group all-gathers the 32,768 cached bf16
    # latents (576 wide) in one workspace chunk (65,536 rows); no query gather or combine
    assert dense["nvlink_us"] == pytest.approx(
        2 * (4.71 + 2048 * 14336 / 104250) + (10.30 + 32768 * 576 * 2 / 148_500), rel=1e-12
    )
    # two prefills with a cached prefix run in one gather run; one without a prefix ends it
    shared = kernel.price([16, 32, 64], [40_000, 30_000, 0], [40_016, 30_032, 64])
    gathers = shared.per_kind["attn_dense"]["nvlink_us"] - 2 * (4.71 + 112 * 14336 / 104250)
    # 70,000 context tokens: ceil(70,000 / 65,536) = 2 gathers of 35,000 rows each
    assert gathers == pytest.approx(2 * (10.30 + 35_000 * 1152 / 148_500), rel=1e-12)


def test_decode_context_parallel_needs_a_latent_attention_and_a_dividing_group():
    with pytest.raises(PricingError, match="needs a latent attention stating kv_lora_rank"):
        Kernel.build(
            Deployment(model="llama-3.1-70b-instruct", chip="h200", tp=4, decode_context_parallel=2)
        )
    with pytest.raises(ValidationError, match="decode_context_parallel 3 does not divide tp 8"):
        Deployment(model="deepseek-v3", chip="h200", tp=8, decode_context_parallel=3)


# Qwen3-Next-80B-A3B at TP 2 on H200: 36 gated delta-net layers, 12 full-attention layers.
QWEN3_NEXT = dict(model="qwen3-next-80b-a3b", chip="h200", tp=2)
H200_BF16 = 989.5e6 * 0.992  # FLOP per us at the bf16 eps_max
# One request's delta-net state on one rank: 16 of the 32 value heads, each 128 x 128 bf16,
# plus the convolution's last 3 inputs over its 2 x 8 x 128 + 16 x 128 = 4,096 channels.
STATE = (16 * 128 * 128 + 4096 * 3) * 2
# A delta-net layer's weights on one rank (bf16, halved by TP): q/k/v/z and beta/alpha in,
# out, and the shared expert's three 512 x 2,048 matrices; 2 FLOP per weight per token.
DELTA_NET_WEIGHTS = (12288 * 2048 + 64 * 2048 + 2048 * 4096 + 3 * 512 * 2048) * 2 // 2


def test_a_recurrent_mixer_reads_and_writes_each_rows_state_once_per_decode():
    kernel = Kernel.build(Deployment(**QWEN3_NEXT))
    price = kernel.price([1] * 64, [3999] * 64, [4000] * 64)
    assert STATE == 548_864
    # weights once, three norms' read + write per token (2 x 8,192 + 24,576 B, halved by TP),
    # each row's state read and written back, and the decode floor the update kernel pays
    assert price.per_kind["delta_net_moe"]["hbm_us"] == pytest.approx(
        (DELTA_NET_WEIGHTS + 64 * 40960 / 2 + 64 * 2 * STATE) / H200_READ + 3 * MEMORY_OP_US + 13.5,
        rel=1e-12,
    )
    # the full-attention layers read the KV cache instead: one of the 2 KV heads per rank
    full = price.per_kind["full_attention_moe"]
    weights = (9216 * 2048 + 2048 * 4096 + 3 * 512 * 2048) * 2 / 2
    norms = (8192 + 16384 + 2048 + 8192) / 2
    assert full["hbm_us"] == pytest.approx(
        (weights + 64 * norms) / H200_READ
        + 4 * MEMORY_OP_US
        + 13.5
        + 64 * 4000 * 2 * 256 * 2 / 2_592_000,
        rel=1e-12,
    )


def test_a_recurrent_mixer_prices_a_prefill_as_a_chunked_scan():
    kernel = Kernel.build(Deployment(**QWEN3_NEXT))
    price = kernel.price([2048], [0], [2048])
    # per token on one rank: intra-chunk scores 8 x 64 x 128 and values 16 x 64 x 128, the
    # state written and read 2 x 16 x 128 x 128, the 4-tap convolution over 4,096 channels
    scan_flops = 2 * (8 * 64 * 128 + 16 * 64 * 128 + 2 * 16 * 128 * 128 + 4 * 4096)
    assert scan_flops == 1_474_560
    delta = price.per_kind["delta_net_moe"]
    # the GEMMs at the ramp, 2,158 / (989.5 x 0.992) us a weight pair, past their weight read
    # (2 / 3.84): the arithmetic is their time, the read under it
    gemm = DELTA_NET_WEIGHTS * (2048 + 110) / H200_BF16
    assert gemm > DELTA_NET_WEIGHTS / H200_READ
    assert delta["sm_us"] == pytest.approx(
        gemm
        + 2048 * scan_flops / (H200_BF16 * 0.40)  # the scan at prefill attention's work_scale
        + 18.5,  # the prefill floor
        rel=1e-12,
    )
    # one row: its state read and written once, whatever its length
    assert delta["hbm_us"] == pytest.approx(
        (2048 * 40960 / 2 + 2 * STATE) / H200_READ + 3 * MEMORY_OP_US,
        rel=1e-12,
    )


def test_a_hybrid_holds_kv_for_its_attention_layers_and_a_fixed_state_per_request():
    kernel = Kernel.build(Deployment(**QWEN3_NEXT))
    # two ranks, 12 full-attention layers, one 256-wide KV head pair of bf16 on each rank
    assert kernel.kv_bytes_per_token == 2 * 12 * 2 * 256 * 2 == 24_576
    assert kernel.state_bytes_per_request == 2 * 36 * STATE == 39_518_208
    assert kernel.kv_bytes([0, 1000]).tolist() == [0.0, 1000 * 24_576]
    # A request's own work includes its state's traffic, the same at any context: the two
    # decodes differ only by their attention reads.
    work = kernel.slot_work([1, 1], [99, 9999], [100, 10000])
    state = 36 * 2 * STATE
    attention = 100 * 12 * 2 * 256 * 2 / 2_592_000
    norms = 36 * 40960 / 2 + 12 * (8192 + 16384 + 2048 + 8192) / 2
    # the 48 layers' routed experts: two tokens touch 512 x (1 - (502/512)^2) experts, each a
    # half shard of 3 x 512 x 2,048 bf16; each token is charged half
    experts = 48 * 512 * (1 - (502 / 512) ** 2) * 3 * 512 * 2048 * 2 / 2 / H200_READ / 2
    # at two tokens every GEMM costs its weight read, so a token's arithmetic at eps_max is its
    # own on HBM: the 36 delta-net and 12 attention layers' GEMMs and the head's (2 FLOP per
    # bf16 weight, halved by TP)
    full_attention_weights = (9216 * 2048 + 2048 * 4096 + 3 * 512 * 2048) * 2 // 2
    gemms = (36 * DELTA_NET_WEIGHTS + 12 * full_attention_weights + 151936 * 2048) / H200_BF16
    assert work.slot_us[0, 1] == pytest.approx(
        (state + norms) / H200_READ + attention + experts + gemms, rel=1e-12
    )
    assert work.slot_us[1, 1] - work.slot_us[0, 1] == pytest.approx(99 * attention, rel=1e-9)


def test_a_hybrid_splits_its_piecewise_graph_at_every_mixer():
    kernel = Kernel.build(Deployment(**QWEN3_NEXT))
    # 14 kernels a layer: 3 norms, 3 GEMMs, the recurrent update (2) or 4 norms, 2 GEMMs and
    # attention (2); two all-reduces, the grouped experts (4); plus the head's 2
    assert kernel.plan.host.kernels == 48 * 14 + 2
    # a step with a prefill row replays 49 pieces: split at 36 delta nets and 12 attentions
    assert kernel.price([1, 64], [100, 0], [101, 64]).host_us == pytest.approx(
        7.0 * 49 + 674 * 3.2, rel=1e-12
    )


def test_a_mamba2_hybrid_by_hand():
    kernel = Kernel.build(Deployment(model="nemotron-h-8b", chip="h100"))
    # one request's Mamba2 state in a layer: 128 heads of 64 x 128 bf16, and the convolution's
    # last 3 inputs over x, B and C (8,192 + 2 x 8 x 128 = 10,240 channels)
    state = (128 * 64 * 128 + 10240 * 3) * 2
    assert state == 2_158_592
    assert kernel.state_bytes_per_request == 24 * state
    assert kernel.kv_bytes_per_token == 4 * 2 * 8 * 128 * 2
    price = kernel.price([1] * 64, [2047] * 64, [2048] * 64)
    weights = (18560 * 4096 + 4096 * 8192) * 2
    # weights, two norms' traffic per token (16,384 + 49,152 B), each row's state read and
    # written back, H100's full-attention decode floor
    assert price.per_kind["mamba2"]["hbm_us"] == pytest.approx(
        (weights + 64 * 65536 + 64 * 2 * state) / (3.35e6 * 0.8) + 2 * MEMORY_OP_US + 14.5,
        rel=1e-12,
    )
    # an MLP layer has no mixer: no floor, no state
    assert price.per_kind["mlp"]["hbm_us"] == pytest.approx(
        (2 * 21504 * 4096 * 2 + 64 * 16384) / (3.35e6 * 0.8) + MEMORY_OP_US, rel=1e-12
    )
    # a piecewise graph splits at the 28 mixers, not at all 52 layers: 29 replays; kernels:
    # 24 x (2 norms, 2 GEMMs, the update's 2) + 4 x (norm, 2 GEMMs, attention's 2)
    # + 24 x (norm, 2 GEMMs) + the head's 2
    assert kernel.plan.host.kernels == 24 * 6 + 4 * 5 + 24 * 3 + 2 == 238
    assert kernel.price([1, 64], [100, 0], [101, 64]).host_us == pytest.approx(
        7.0 * 29 + 238 * 3.2, rel=1e-12
    )


# GB200 NVL72: 4-GPU trays, one NVLink domain of 72 GPUs per rack, InfiniBand (50 GB/s) past it.
GB200 = dict(model="deepseek-v3", chip="gb200-nvl72", dtype="fp8")


def test_a_tp_group_over_two_trays_of_an_nvl72_rack_stays_on_nvlink():
    kernel = Kernel.build(Deployment(**GB200, tp=8, nodes=2))
    dense = _decode(kernel, 4).per_kind["attn_dense"]
    # two all-reduces of 4 tokens x 14,336 B at B200's width-8 triple (7.33 us, 155,750 B/us)
    assert dense["nvlink_us"] == pytest.approx(2 * (7.33 + 4 * 14336 / 155_750), rel=1e-12)
    assert dense["nic_us"] == 0.0


def test_an_expert_group_crosses_to_the_fabric_only_past_the_rack():
    in_rack = Kernel.build(Deployment(**GB200, tp=4, data_parallel=18, expert_parallel=True))
    assert _decode(in_rack, 4).per_kind["attn_moe"]["nic_us"] == 0.0
    two_racks = Kernel.build(
        Deployment(**GB200, tp=8, nodes=2, data_parallel=18, expert_parallel=True)
    )
    moe = _decode(two_racks, 4).per_kind["attn_moe"]
    # the 144-rank dispatch spans 2 racks: ring span 1 + (900/50 - 1) * 1/143 on 4 tokens'
    # 14,336 B, at the widest measured all2all triple (10.65 us, 261,750 B/us)
    message = 4 * 14336 * (1 + 17 / 143)
    assert moe["nic_us"] == pytest.approx(10.65 + message / 261_750, rel=1e-12)


def test_a_rack_holds_whole_trays():
    from pricing.spec import ChipSpec, load_chip

    chip = load_chip("gb200-nvl72").model_dump()
    with pytest.raises(ValidationError, match="not a whole number of 4-GPU nodes"):
        ChipSpec.model_validate({**chip, "gpus_per_rack": 70})


def test_a_reduced_sm_budget_slows_arithmetic_but_not_floors_or_reads():
    full = Kernel.build(Deployment(model="llama-3.1-8b-instruct", chip="h100"))
    budget = Kernel.build(Deployment(model="llama-3.1-8b-instruct", chip="h100", sm_budget=120))
    # 120 of H100's 132 SMs: arithmetic takes 132/120 = 1.1 times as long
    decode = (
        full.price([1] * 8, [999] * 8, [1000] * 8),
        budget.price([1] * 8, [999] * 8, [1000] * 8),
    )
    assert decode[1].sm_us == pytest.approx(1.1 * decode[0].sm_us, rel=1e-12)
    assert decode[1].hbm_us == decode[0].hbm_us
    # a prefill's 32 attention floors (19.5 us each) are launches, not arithmetic
    floors = 32 * 19.5
    prefill = full.price([2048], [0], [2048]), budget.price([2048], [0], [2048])
    assert prefill[1].sm_us - floors == pytest.approx(1.1 * (prefill[0].sm_us - floors), rel=1e-12)
    # a budget at or above the part's SMs changes nothing
    whole = Kernel.build(Deployment(model="llama-3.1-8b-instruct", chip="h100", sm_budget=132))
    assert whole.price([2048], [0], [2048]).sm_us == prefill[0].sm_us


def test_go_compat_prices_a_recurrent_mixer_at_the_registrys_floor_and_rate():
    kernel = Kernel.build(Deployment(model="nemotron-h-8b", chip="h100", compat="go"))
    plain = Kernel.build(Deployment(model="nemotron-h-8b", chip="h100", tp=1, compat="go"))
    assert kernel.version == plain.version
    mamba = kernel.price([1] * 16, [999] * 16, [1000] * 16).per_kind["mamba2"]
    # per layer on SM: the registry's Mamba2 floor 3.5 us plus 16 tokens at 8.5 tokens per us,
    # beside in_proj (18,560 x 4,096) and out_proj (4,096 x 8,192) at bf16 eps(16) on H100
    gemms = 2 * (18560 * 4096 + 4096 * 8192) * (16 + 170) / (989.5e6 * 1.0)
    assert mamba["sm_us"] == pytest.approx(gemms + 3.5 + 16 / 8.5, rel=1e-12)
    # no registry entry for gated delta-net: those layers' mixers cost nothing
    qwen = Kernel.build(Deployment(model="qwen3-next-80b-a3b", chip="h100", tp=2, compat="go"))
    physics = Kernel.build(Deployment(model="qwen3-next-80b-a3b", chip="h100", tp=2))
    assert physics.plan.layers[0].recurrent is not None
    assert qwen.plan.layers[0].recurrent == MeasuredRecurrent(
        floor_us=0.0, us_per_token=0.0, state_bytes=physics.plan.layers[0].recurrent.state_bytes
    )


def test_go_compat_prices_a_kda_mixer_at_its_registry_entry(tmp_path):
    from pricing.spec import MODELS_DIR, ModelSpec, _load, load_chip

    # Nemotron-H's graph with its mixers stated as Kimi delta attention
    text = (MODELS_DIR / "nemotron-h-8b.yaml").read_text().replace("kind: mamba2", "kind: kda")
    (tmp_path / "nemotron-h-8b.yaml").write_text(text)
    model = _load(tmp_path, "nemotron-h-8b", "model", ModelSpec)
    deployment = Deployment(model="nemotron-h-8b", chip="h100", compat="go")
    kda = Kernel(deployment, load_chip("h100"), model).price([1] * 16, [999] * 16, [1000] * 16)
    mamba = Kernel.build(deployment).price([1] * 16, [999] * 16, [1000] * 16)
    # registry KDA on H100: 3.8 us + tokens / 0.235 per us, against Mamba2's 3.5 + tokens / 8.5
    assert kda.per_kind["mamba2"]["sm_us"] - mamba.per_kind["mamba2"]["sm_us"] == pytest.approx(
        (3.8 + 16 / 0.235) - (3.5 + 16 / 8.5), rel=1e-9
    )


def test_a_prefill_split_zigzag_loads_its_busiest_rank_by_hand():
    from pricing import laws

    # 100 tokens over 8 ranks: 16 pieces of 7; rank 1 holds [7, 14) and [98, 100), rank 2
    # [14, 21) and [91, 98). The busiest rank computes 14 tokens (0.14 of the chunk) and, over
    # every rank, at most 0.1568 of its 5,000 causal pairs (the Go kernel's figures)
    assert laws.zigzag_chunks(100, 8)[1] == [(7, 7), (98, 2)]
    assert laws.busiest_rank_prefill(100, 0, 8, [None]) == (14, [784.0])
    assert 784.0 / 5000 == 0.1568


def test_prefill_context_parallel_splits_the_chunk_and_gathers_its_kv():
    split = Kernel.build(Deployment(**DSV3, prefill_context_parallel=2))
    price = split.price([4096], [0], [4096])
    dense = price.per_kind["attn_dense"]
    # each rank computes 2,048 of the 4,096 tokens (pieces 0 and 3 or 1 and 2 of 1,024): its
    # two TP all-reduces move 2,048 x 14,336 B (h200 width 8)
    all_reduces = 2 * (4.71 + 2048 * 14336 / 104250)
    # the two ranks of a group sit 8 apart, one per 8-GPU node: the latent (512) and rope (64)
    # gathers of 2 x 2,048 rows cross the fabric, ring span 1 + (450 / 50 - 1) x 1 / 1 = 9,
    # at the width-2 all_gather triple (5.08 us, 197,000 B/us; peak 257,645.3)
    gathers = sum(
        max(5.08 + b / 197_000, b / 257_645.3) for b in (2 * 2048 * w * 2 * 9 for w in (512, 64))
    )
    assert dense["nvlink_us"] == pytest.approx(all_reduces, rel=1e-12)
    assert dense["nic_us"] == pytest.approx(gathers, rel=1e-12)
    # a decode row is replicated, not split, and gathers nothing
    decode = split.price([1], [4095], [4096]).per_kind["attn_dense"]
    assert decode["nic_us"] == 0.0


def test_prefill_context_parallel_needs_latent_attention_everywhere():
    with pytest.raises(PricingError, match="needs latent attention in every layer"):
        Kernel.build(
            Deployment(model="llama-3.1-8b-instruct", chip="h200", prefill_context_parallel=2)
        )
    with pytest.raises(PricingError, match="prefill and decode context parallelism together"):
        Kernel.build(Deployment(**DSV3, prefill_context_parallel=2, decode_context_parallel=2))


def test_kimi_k3_holds_a_kda_state_per_request_and_go_prices_its_mixer_from_the_registry():
    physics = Kernel.build(Deployment(model="kimi-k3", chip="h100", tp=8))
    # per rank and KDA layer: 12 of the 96 heads' 128 x 128 fp32 states, and the 4-tap
    # convolution's last 3 inputs over their 2 x 12 x 128 + 12 x 128 channels; 69 KDA layers
    state = 12 * 128 * 128 * 4 + (2 * 12 * 128 + 12 * 128) * 3 * 4
    assert physics.state_bytes_per_request == 8 * 69 * state
    # the 24 MLA layers cache one 576-wide bf16 latent a token on every rank
    assert physics.kv_bytes_per_token == 8 * 24 * 576 * 2
    go = Kernel.build(Deployment(model="kimi-k3", chip="h100", tp=8, compat="go"))
    dense = go.price([1] * 16, [3999] * 16, [4000] * 16).per_kind["kda_dense"]
    # mxfp4 GEMMs on H100's fp8 lane at eps(16) = 0.648 x 16 / 147, beside the registry's KDA
    # decode: 3.8 us + 16 tokens at 0.235 per us
    gemm_flops = 2 * (67584 * 7168 + 7168 * 33792) / 8
    gemms = gemm_flops * (16 + 131) / (1979e6 * 0.648)
    assert dense["sm_us"] == pytest.approx(gemms + 3.8 + 16 / 0.235, rel=1e-12)


# Stated for these tests only: no published sweep has measured the mHC kernels on any part in
# pricing/chips/, so no chip file states them and the shipped model prices the graph's bytes.
STATED_MHC = HyperConnectionBlock(
    source="stated for the tests",
    floor_us=4.0,
    pre_rate_bytes_per_us=2e6,
    post_rate_bytes_per_us=1.6e6,
    basis={
        "floor_us": "assumed",
        "pre_rate_bytes_per_us": "assumed",
        "post_rate_bytes_per_us": "assumed",
    },
)
DSV41 = Deployment(model="deepseek-v4.1", chip="b200", tp=8)


def mhc_measured_kernel(deployment: Deployment) -> Kernel:
    """`deployment` on its chip with the mHC kernels' measured form stated."""
    chip = load_chip(deployment.chip).model_copy(update={"hyper_connections": STATED_MHC})
    return Kernel(deployment, chip, load_model(deployment.model))


def test_measured_hyper_connections_replace_the_graphs_bytes_and_mixing_gemm_by_hand():
    graph = Kernel.build(DSV41)
    measured = mhc_measured_kernel(DSV41)
    batch = ([1] * 4, [4095] * 4, [4096] * 4)
    # Each layer has two hyper-connections of 4 streams x 7168 x 2 B = 57,344 B a token. With
    # the measured form each costs 4 + 4 x 57,344 / 2e6 + 4 x 57,344 / 1.6e6 us on HBM; without
    # it, 200,704 B a token plus the 24 x 28,672 fp32 mixing weights at B200's derated
    # 7.7e6 x 0.8 B/us, and the mixing GEMM's 2 x 24 x 28,672 FLOP a token on every rank at the
    # fp8 ramp (peak 4.5e9 FLOP/us, eps_max 0.764, m_half 177).
    streams = 4 * 7168 * 2
    law = 2 * (4.0 + 4 * streams / 2e6 + 4 * streams / 1.6e6)
    traffic = 2 * (200704 * 4 + 24 * 28672 * 4) / (7.7e6 * 0.8)
    # at 4 tokens the mixing GEMM's arithmetic (0.072 us) is under its fp32 weights' read
    # (0.447 us), which is its time: none of it is on SM
    mixing = (2 * 24 * 28672) * (4 + 177) / (4.5e9 * 0.764)
    assert mixing < 24 * 28672 * 4 / (7.7e6 * 0.8)
    for kind in ("csa128_moe", "csa4_moe"):
        with_law = measured.price(*batch).per_kind[kind]
        stated = graph.price(*batch).per_kind[kind]
        assert with_law["hbm_us"] - stated["hbm_us"] == pytest.approx(law - traffic, rel=1e-9)
        assert stated["sm_us"] == with_law["sm_us"]
    # the same kernels launch either way: 31 x 18 + 30 x 21 + 2 head kernels
    assert measured.kernels == graph.kernels == 31 * 18 + 30 * 21 + 2
    # a token's share is its streams' bytes; the fixed cost is no single request's
    split = measured.slot_work(*batch)
    graph_split = graph.slot_work(*batch)
    # less, without the graph's mixing GEMM, each token's arithmetic of it (read-bound, so
    # its own on HBM)
    own = (
        61 * 2 * (streams / 2e6 + streams / 1.6e6)
        - 61 * 2 * 200704 / (7.7e6 * 0.8)
        - 61 * 2 * (2 * 24 * 28672) / (4.5e9 * 0.764)
    )
    assert split.slot_us[0, 1] - graph_split.slot_us[0, 1] == pytest.approx(own, rel=1e-9)


DSPARK = Deployment(
    model="deepseek-v4.1",
    chip="b200",
    tp=8,
    num_spec_tokens=5,
    decode_threshold=6,  # a decode row schedules its token and its five drafts
    drafter="dspark",
    max_num_seqs=8,
)


def test_the_dspark_drafter_replays_its_own_graph_to_its_own_ceiling_by_hand():
    kernel = Kernel.build(DSPARK)
    # ceiling min(8 x (1 + 5) x 2, 1024) = 96 tokens: the target's uniform decodes of 6 tokens
    # replay its full graph up to 16 requests, the drafter's 5-token rows up to 96 // 5 = 19.
    assert kernel.capture_ceiling == 96
    assert kernel.plan.host.drafter.ceiling_rows == 19
    target = 31 * 18 + 30 * 21 + 2  # kernels, each dispatched at 3.2 us
    drafter = 12  # norm, qkv, attention (2), o_proj, all-reduce, norm, experts (4), all-reduce
    replay = 7.0 + drafter * 3.2
    decodes = kernel.price([6] * 16, [4090] * 16, [4096] * 16)
    assert decodes.host_us == pytest.approx(7.0 + target * 3.2 + replay, rel=1e-12)
    # 17 requests: the target is past its ceiling (102 tokens) and launches its 61 layers
    # eagerly, while the drafter, 17 of 19 rows, still replays its graph
    past = kernel.price([6] * 17, [4090] * 17, [4096] * 17)
    assert past.host_us == pytest.approx(61 * 7.0 + target * 3.2 + replay, rel=1e-12)
    # a prefill row: the target's piecewise pieces, and the drafter stores its extra context
    # eagerly (one launch per drafter layer) before its replay
    mixed = kernel.price([6, 50], [4090, 0], [4096, 50])  # 56 tokens, below the ceiling
    pieces = 61 + 30 + 1  # a split at every attention and indexer
    assert mixed.host_us == pytest.approx(7.0 * pieces + target * 3.2 + replay + 7.0, rel=1e-12)
    # without a full decode graph the drafter captures none and always launches eagerly
    piecewise = Kernel.build(DSPARK.model_copy(update={"cudagraph_mode": "PIECEWISE"}))
    assert piecewise.plan.host.drafter.ceiling_rows == 0
    assert piecewise.price([6], [4090], [4096]).host_us == pytest.approx(
        7.0 * pieces + target * 3.2 + 1 * 7.0 + drafter * 3.2, rel=1e-12
    )
    # an empty step runs no drafter
    assert kernel.price([], [], []).host_us == pytest.approx(7.0 + target * 3.2, rel=1e-12)


def test_a_drafter_needs_draft_tokens_and_the_model_stating_it():
    with pytest.raises(ValidationError, match="needs num_spec_tokens >= 1"):
        Deployment(model="deepseek-v4.1", chip="b200", tp=8, drafter="dspark")
    with pytest.raises(PricingError, match="drafter 'eagle' is not the one 'deepseek-v4.1' states"):
        Kernel.build(DSPARK.model_copy(update={"drafter": "eagle"}))
    with pytest.raises(PricingError, match="its drafter: none"):
        Kernel.build(
            Deployment(model="deepseek-v3", chip="h200", tp=8, num_spec_tokens=1, drafter="dspark")
        )
