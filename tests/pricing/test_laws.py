"""Each law against a hand calculation."""

from __future__ import annotations

import numpy as np
import pytest

from pricing import laws


def test_ramp_is_half_of_eps_max_at_m_half_and_zero_without_tokens():
    assert laws.ramp_efficiency(1, 0.736, 113) == pytest.approx(0.736 / 114, rel=1e-15)
    assert laws.ramp_efficiency(113, 0.736, 113) == pytest.approx(0.368, rel=1e-15)
    assert laws.ramp_efficiency(0, 0.736, 113) == 0.0
    assert laws.ramp_efficiency(-5, 0.736, 113) == 0.0


def test_ramped_arithmetic_is_linear_in_tokens():
    # 100 tokens x 1e9 FLOP at 1e9 FLOP/us and eps = 0.5 * 100 / 200 = 0.25: 400 us
    assert laws.ramped_arithmetic_us(100, 1e9, 1e9, 0.5, 100) == pytest.approx(400.0, rel=1e-15)
    # one more token adds exactly flops / (peak * eps_max) = 2 us
    assert laws.ramped_arithmetic_us(101, 1e9, 1e9, 0.5, 100) == pytest.approx(402.0, rel=1e-15)
    assert laws.ramped_arithmetic_us(0, 1e9, 1e9, 0.5, 100) == 0.0


def test_a_bf16_gemm_on_h200_takes_its_flops_at_the_ramped_fraction_of_peak():
    # M = 2048 tokens through an 8192 x 8192 weight: 2 x 2048 x 8192 x 8192 = 274,877,906,944
    # FLOP. h200.yaml: bf16 peak 989.5 TFLOP/s = 989.5e6 FLOP/us, ramp eps_max 0.992,
    # m_half 110, so eps(2048) = 0.992 x 2048 / 2158 = 0.94143466 and the rate is
    # 931,549,597.8 FLOP/us: 274,877,906,944 / 931,549,597.8 = 295.0760 us.
    flops_per_token = 2 * 8192 * 8192
    assert laws.ramped_arithmetic_us(2048, flops_per_token, 989.5e6, 0.992, 110) == pytest.approx(
        295.0760, abs=1e-4
    )
    # More tokens never take less time, and each further 512 adds the same time.
    times = laws.ramped_arithmetic_us(
        np.array([512, 1024, 1536, 2048]), flops_per_token, 989.5e6, 0.992, 110
    )
    assert (np.diff(times) > 0).all()
    np.testing.assert_allclose(np.diff(times), np.diff(times)[0], rtol=1e-12)


def test_memory_time_uses_the_derated_bandwidth():
    # H200: 4.8e6 B/us x 0.8 = 3.84e6 B/us
    assert laws.memory_time_us(3.84e6, 4.8e6, 0.8) == pytest.approx(1.0, rel=1e-15)
    assert laws.memory_time_us(72_933_376, 4.8e6, 0.8) == pytest.approx(
        18.993066666666667, rel=1e-12
    )


def test_a_gemm_costs_the_larger_of_its_arithmetic_and_its_read_on_the_resource_that_binds():
    # Llama-3.1-70B fp8 on one H200: 70.1e9 weights, 1 byte and 2 FLOP each. At 4 tokens the
    # arithmetic at the fp8 ramp (peak 1.979e9 FLOP/us, eps_max 0.736, m_half 113) is
    # 2 x 70.1e9 x 117 / (1.979e9 x 0.736) = 11,262 us, under the read of 70.1e9 B at
    # 3.84e6 B/us = 18,255 us: the read is the GEMMs' time, on HBM.
    weights = 70.1e9
    ramp = laws.ramped_arithmetic_us(np.array([4, 77, 78, 512]), 2 * weights, 1.979e9, 0.736, 113)
    read = laws.memory_time_us(weights, 4.8e6, 0.8)
    assert ramp[0] == pytest.approx(11_262.0, abs=1.0)
    assert read == pytest.approx(18_255.2, abs=0.1)
    sm, hbm = laws.gemm_kernel_us(ramp, np.full(4, read))
    # the crossover: 189.6 - 113 = 76.6 tokens; from 77 the arithmetic binds and hides the read
    np.testing.assert_array_equal(sm, [0.0, ramp[1], ramp[2], ramp[3]])
    np.testing.assert_array_equal(hbm, [read, 0.0, 0.0, 0.0])
    # a tie is SM's; nothing without tokens
    assert [float(t) for t in laws.gemm_kernel_us(5.0, 5.0)] == [5.0, 0.0]
    assert [float(t) for t in laws.gemm_kernel_us(0.0, 0.0)] == [0.0, 0.0]


def test_each_memory_op_pays_a_fixed_latency_besides_its_bytes():
    # a decode of 4 rows: a norm moves 4 x 28,672 B, 0.03 us at the derated rate on H200; with
    # the 3 us latency the 244 norms of DeepSeek-V3 cost 732 us a step whatever the batch
    assert float(laws.memory_op_latency_us(244, 3.0)) == 732.0
    np.testing.assert_allclose(laws.memory_op_latency_us(np.array([0, 2, 4]), 3.0), [0, 6, 12])
    with pytest.raises(ValueError, match="latency cannot be negative"):
        laws.memory_op_latency_us(1, -1.0)


def test_decode_reads_per_kind():
    assert laws.decode_read_tokens(4096, "dense") == 4096
    assert laws.decode_read_tokens(4096, "dense", window=128) == 128
    assert laws.decode_read_tokens(100, "dense", window=128) == 100
    assert laws.decode_read_tokens(4096, "dense", window=128, window_bounded=False) == 4096
    # sparse latent: 2048 selected + (10000 - 2048) / 4 of the compressed stream
    assert (
        laws.decode_read_tokens(10000, "sparse_mla", top_k=2048, compress_ratio=4)
        == 2048 + 7952 / 4
    )
    assert laws.decode_read_tokens(100, "sparse_mla", top_k=2048, compress_ratio=4) == 100
    # DSA keeps no compressed stream: only the selected positions
    assert laws.decode_read_tokens(10000, "sparse_mla", top_k=2048) == 2048


def test_decode_attention_mla_at_4096_context_on_h200():
    # the golden file's per-layer figure: 4096 tokens x 576 B = 2,359,296 B read at
    # 2.928e6 B/us = 0.80577 us, on the 13.5 us floor: 14.30577 us
    assert float(laws.decode_attention_us(4096, 13.5, 576, 2.928e6)) == pytest.approx(
        14.30577, abs=1e-5
    )
    # twice the context reads twice the bytes: another 0.80577 us
    assert float(laws.decode_attention_us(8192, 13.5, 576, 2.928e6)) == pytest.approx(
        15.11154, abs=1e-5
    )


def test_prefill_pairs_causal_and_windowed():
    # 100 queries on 50 cached keys (5,000 pairs) and the causal half of their own 100 x 100
    # (5,000): 10,000
    assert laws.prefill_pairs(100, 50) == 10_000
    # window 128 from 50 cached tokens: the first 78 queries see all keys before them
    # (78 x 50 + 78 x 78 / 2 = 3,900 + 3,042), the other 22 see 128 each (2,816): 9,758
    assert laws.prefill_pairs(100, 50, 128) == 9_758
    # every query already past the window: 10 x 128
    assert laws.prefill_pairs(10, 200, 128) == 1_280
    # a window never reached changes nothing: 60 x 10 + 60 x 60 / 2 = 600 + 1,800
    assert laws.prefill_pairs(60, 10, 128) == 2_400
    assert laws.prefill_pairs(60, 10) == 2_400


def test_prefill_attention_flops_and_time():
    # per pair and head, QK^T and PV each take 128 multiply-adds of 2 FLOP: 512 FLOP;
    # 10,000 pairs x 32 heads x 512 = 163,840,000 FLOP, half on each of 2 ranks
    flops = laws.prefill_attention_flops(10_000, 32, 128, 128, 2)
    assert flops == 81_920_000
    # 18.5 us floor + 81.92e6 FLOP at 989.5e6 FLOP/us x 0.5 x 0.4 = 197.9e6 FLOP/us (0.41395 us)
    assert laws.prefill_attention_us(
        10_000, 32, 128, 128, 2, 18.5, 989.5e6, 0.5, 0.4
    ) == pytest.approx(18.91395, abs=1e-5)
    # DeepSeek-V3's expanded MLA prefill: scores over 192 (128 nope + 64 rope), values at 128:
    # 2 x (192 + 128) = 640 FLOP per pair and head, x 1,000 pairs x 128 heads / 8 ranks
    assert laws.prefill_attention_flops(1_000, 128, 192, 128, 8) == 10_240_000
    with pytest.raises(ValueError, match="tp"):
        laws.prefill_attention_flops(1, 1, 1, 1, 0)
    with pytest.raises(ValueError, match="positive rate"):
        laws.prefill_attention_us(1, 1, 1, 1, 1, 0.0, 989.5e6, 0.0, 0.4)


def test_laws_refuse_a_zero_rate_or_an_impossible_span():
    with pytest.raises(ValueError, match="positive rate"):
        laws.memory_time_us(1.0, 0.0, 0.8)
    with pytest.raises(ValueError, match="read rate"):
        laws.decode_attention_us(1.0, 0.0, 576, 0.0)
    with pytest.raises(ValueError, match="ramp"):
        laws.ramped_arithmetic_us(1.0, 1.0, 0.0, 0.5, 10.0)
    with pytest.raises(ValueError, match="top_k"):
        laws.expert_miss_probability(8, 9)
    with pytest.raises(ValueError, match="span"):
        laws.cross_node_span(9.0, 0, 8)
    with pytest.raises(ValueError, match="compress_ratio"):
        laws.decode_read_tokens(10, "sparse_mla", top_k=4, compress_ratio=0.5)


def test_distinct_experts():
    miss = laws.expert_miss_probability(256, 8)
    assert miss == 248 / 256
    assert laws.distinct_experts(1, miss, 256) == pytest.approx(8.0, rel=1e-14)
    # the second token's 8 experts are new unless the first chose them: 8 x 248 / 256 = 7.75
    assert laws.distinct_experts(2, miss, 256) == pytest.approx(8 + 7.75, rel=1e-14)
    assert laws.distinct_experts(0, miss, 256) == 0.0
    assert laws.distinct_experts(100_000, miss, 256) == pytest.approx(256.0, rel=1e-12)


def test_the_busiest_of_several_ranks_touches_the_largest_expected_count():
    # two ranks of two experts, each touched with chance 1/2: a rank's count is 0, 1, 2 with
    # chances 1/4, 1/2, 1/4; the larger of two is 0 with 1/16, at most 1 with 9/16, so its
    # expectation is (1 - 1/16) + (1 - 9/16) = 1.375
    assert laws.busiest_rank_distinct_experts(1, 0.5, 2, 2) == pytest.approx(1.375, rel=1e-14)
    # one rank is the mean rank; no token touches nothing; every expert reached is all of them
    assert laws.busiest_rank_distinct_experts(4, 248 / 256, 32, 1) == pytest.approx(
        laws.distinct_experts(4, 248 / 256, 32), rel=1e-15
    )
    assert laws.busiest_rank_distinct_experts(0, 248 / 256, 32, 8) == 0.0
    assert laws.busiest_rank_distinct_experts(3, 0.0, 32, 8) == 32.0
    # DeepSeek-V3 over 8 ranks: between the mean rank and all 32, rising with the tokens
    tokens = np.array([1, 4, 16, 64, 256])
    busiest = laws.busiest_rank_distinct_experts(tokens, 248 / 256, 32, 8)
    assert np.all(busiest > laws.distinct_experts(tokens, 248 / 256, 32))
    assert np.all(busiest <= 32.0)
    assert np.all(np.diff(busiest) > 0)
    with pytest.raises(ValueError, match="ranks >= 1"):
        laws.busiest_rank_distinct_experts(1, 0.5, 2, 0)


def test_collective_fixed_cost_then_peak_rate():
    # DeepSeek-V3 all-reduce of one token's 7168 bf16 activations on 8 H200s
    # 14,336 B at 104,250 B/us is 0.13752 us after the 4.71 us launch cost
    assert laws.collective_us(14336, 4.71, 104250, 134260) == pytest.approx(4.84752, abs=1e-5)
    # the peak rate binds only where it is below the step-range rate's line
    assert laws.collective_us(1e6, 1.0, 2e6, 1e5) == pytest.approx(10.0, rel=1e-15)
    assert laws.collective_us(1e3, 1.0, 2e6, 1e5) == pytest.approx(1.0005, rel=1e-15)
    assert laws.collective_rate_in_force(1e6, 1.0, 2e6, 1e5) == 1e5
    assert laws.collective_rate_in_force(1e3, 1.0, 2e6, 1e5) == 2e6


def test_cross_node_span():
    assert laws.cross_node_span(9.0, 2, 16) == pytest.approx(1 + 8 / 15, rel=1e-15)
    assert laws.cross_node_span(9.0, 1, 8) == 1.0
    assert laws.cross_node_span(9.0, 1, 1) == 1.0


def test_capture_ceiling():
    assert laws.capture_ceiling(256, 0, False) == 512
    assert laws.capture_ceiling(64, 0, False) == 128
    assert laws.capture_ceiling(64, 1, False) == 256
    assert laws.capture_ceiling(1024, 0, True) == 1024
    assert laws.capture_ceiling(256, 0, True) == 512
    with pytest.raises(ValueError, match="max_num_seqs"):
        laws.capture_ceiling(0, 0, False)


def test_graph_cost_per_mode_and_host_time():
    assert laws.graph_host_us("full", 61, 61, 7.0, 7.0) == 7.0
    assert laws.graph_host_us("piecewise", 61, 61, 7.0, 7.0) == 7.0 * 62
    assert laws.graph_host_us("none", 61, 61, 7.0, 7.0) == 7.0 * 61
    # a sparse model splits at each indexer too
    assert laws.graph_host_us("piecewise", 61, 122, 7.0, 7.0) == 7.0 * 123
    # DeepSeek-V3 TP8 piecewise: 62 replays + 972 kernels x 3.2 us = 3544.4 us
    host = laws.host_us(np.array([434.0, 434.0]), 427.0, np.array([1, 512]), 512, 972, 3.2)
    np.testing.assert_allclose(host, [3544.4, 3544.4], rtol=1e-15)
    # past the ceiling a step is charged eager launches, more or less than its captured cost
    host = laws.host_us(np.array([7.0, 7.0]), 427.0, np.array([512, 513]), 512, 972, 3.2)
    np.testing.assert_allclose(host, [7.0 + 3110.4, 427.0 + 3110.4], rtol=1e-15)
    host = laws.host_us(np.array([434.0, 434.0]), 427.0, np.array([512, 513]), 512, 972, 3.2)
    np.testing.assert_allclose(host, [434.0 + 3110.4, 427.0 + 3110.4], rtol=1e-15)


def test_compose_step_by_hand():
    # one step, two layer kinds (repeat 2 and 3)
    composed = laws.compose_step(
        # (resource, kind, step): SM, HBM, NVLink, NIC; the experts' SM, HBM; the head's
        layer=np.array([[12.0, 1.0], [5.0, 8.0], [3.0, 3.0], [0.0, 9.0]])[:, :, None],
        expert=np.array([[0.0, 4.0], [0.0, 6.0]])[:, :, None],
        repeat=np.array([2.0, 3.0]),
        head=np.array([[7.0], [11.0]]),
        host=np.array([20.0]),
    )
    # stages: max(12, 5, 3, 0) = 12; max(1, 8, 3, 9) + 4 + 6 = 19
    np.testing.assert_allclose(composed.stage, [[12.0], [19.0]])
    sm = 2 * 12 + 3 * (1 + 4) + 7
    hbm = 2 * 5 + 3 * (8 + 6) + 11
    totals: list[list[float]] = [[sm], [hbm], [15.0], [27.0], [20.0]]
    np.testing.assert_allclose(composed.totals, totals)
    assert composed.nooverlap[0] == sm + hbm + 15 + 27 + 20
    assert composed.overlap[0] == 2 * 12 + 3 * 19 + 11 + 20
    assert composed.bottleneck[0] == 1  # hbm


def test_recurrent_state_is_one_matrix_per_value_head_plus_the_convolutions_window():
    # Qwen3-Next's gated delta-net: 32 value heads of 128 x 128 bf16, and 3 past inputs over
    # q, k (16 x 128 each) and v (32 x 128): 524,288 x 2 B + 8,192 channels x 3 x 2 B
    # = 1,048,576 + 49,152
    assert laws.recurrent_state_bytes(16, 32, 128, 128, 4, 2) == 1_097_728
    # a Mamba2 layer: 8 groups of B and C with state 128, 128 heads of 64, fp32 state:
    # (128 x 128 x 64 + (2 x 8 x 128 + 128 x 64) x 3) x 4 B = (1,048,576 + 30,720) x 4
    assert laws.recurrent_state_bytes(8, 128, 128, 64, 4, 4) == 4_317_184


def test_chunked_scan_flops_are_linear_in_tokens_with_the_chunk_bounding_the_quadratic_part():
    # Mamba2 with 256-token chunks: C B^T per group, its product with x per head, the state
    # written and read per head, the 4-tap convolution over 10,240 channels, in multiply-adds:
    # 262,144 + 2,097,152 + 2,097,152 + 40,960 = 4,497,408, at 2 FLOP each
    assert laws.chunked_scan_flops(8, 128, 128, 64, 256, 4) == 8_994_816
    # the delta net's 64-token chunks: 131,072 + 262,144 + 1,048,576 + 4 x 8,192 = 1,474,560
    # multiply-adds
    assert laws.chunked_scan_flops(16, 32, 128, 128, 64, 4) == 2_949_120
    # at prefill attention's work_scale of the bf16 eps_max rate, no ramp in the step's tokens:
    # 2.94912e9 FLOP at 989.5e6 x 0.992 x 0.4 = 392,633,600 FLOP/us
    assert laws.scan_us(1000, 2_949_120, 989.5e6, 0.992, 0.4) == pytest.approx(7.51112, abs=1e-5)
    assert laws.scan_us(0, 2_949_120, 989.5e6, 0.992, 0.4) == 0.0
    with pytest.raises(ValueError, match="positive rate"):
        laws.scan_us(1, 1, 989.5e6, 0.992, 0.0)


def test_a_hyper_connection_is_a_floor_plus_the_streams_bytes_at_each_halfs_rate():
    # 4 streams of a 7168-wide bf16 hidden state: 57,344 B a token. 100 tokens at a 2e6 B/us
    # pre-mix and a 1.6e6 B/us post-mix over a 4 us floor:
    # 4 + 5,734,400 / 2e6 + 5,734,400 / 1.6e6 = 4 + 2.8672 + 3.584 = 10.4512 us
    streams = 4 * 7168 * 2
    assert laws.hyper_connection_us(100, 4.0, streams, 2e6, 1.6e6) == pytest.approx(
        10.4512, rel=1e-15
    )
    assert laws.hyper_connection_us(0, 4.0, streams, 2e6, 1.6e6) == 0.0
    with pytest.raises(ValueError, match="positive rates"):
        laws.hyper_connection_us(1, 4.0, streams, 0.0, 1.6e6)


def test_a_parallel_block_drafter_fits_more_requests_in_the_same_capture():
    # The spec's example: a 64-token capture with five draft tokens holds 12 of the drafter's
    # 5-token rows, against the target's 10 rows of 1 + 5 tokens.
    assert laws.drafter_capture_rows(64, 5, "full") == 12 == 64 // 5
    assert 64 // (1 + 5) == 10
    # captured only when the target decodes in full mode
    assert laws.drafter_capture_rows(64, 5, "piecewise") == 0
    assert laws.drafter_capture_rows(64, 5, "none") == 0
    with pytest.raises(ValueError, match="num_spec_tokens >= 1"):
        laws.drafter_capture_rows(64, 0, "full")


def test_a_drafter_replays_to_its_ceiling_launches_eagerly_past_it_and_stores_on_prefill():
    rows = np.array([0, 1, 12, 13, 12, 0])
    prefilling = np.array([False, False, False, False, True, True])
    host = laws.drafter_host_us(rows, prefilling, 12, replay_us=7.0, eager_us=21.0, store_us=14.0)
    np.testing.assert_array_equal(host, [0.0, 7.0, 7.0, 21.0, 7.0 + 14.0, 0.0])
