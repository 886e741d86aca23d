"""The kernel's laws: small pure functions, each valid on scalars and numpy arrays.

Times are microseconds, rates bytes (or FLOP) per microsecond. Each law's comment names the
measurement that justified its form; the coefficient values live in `pricing/chips/*.yaml`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray


def _floats(values: ArrayLike) -> NDArray[np.float64]:
    return np.asarray(values, dtype=np.float64)


def ramp_efficiency(tokens: ArrayLike, eps_max: float, m_half: float) -> np.ndarray:
    """Fraction of peak a matrix multiply reaches with `tokens` rows: eps_max * m / (m + m_half).

    Saturating form fitted per chip and dtype on AISimulate's gemm_perf sweeps (vLLM lane);
    using the peak instead prices a 512-token step 1.2-2.8x too fast. Zero for m <= 0.
    """
    m = np.asarray(tokens, dtype=np.float64)
    return np.where(m > 0, eps_max * m / np.maximum(m + m_half, 1e-300), 0.0)


def ramped_arithmetic_us(
    tokens: ArrayLike,
    flops_per_token: ArrayLike,
    peak_flops_per_us: float,
    eps_max: float,
    m_half: float,
) -> np.ndarray:
    """Time of `tokens * flops_per_token` at the ramped efficiency eps(tokens).

    T / eps(T) = (T + m_half) / eps_max, so the time is exactly linear in tokens: a fixed
    m_half overhead plus a per-token part (zero when there are no tokens).
    """
    if peak_flops_per_us <= 0 or eps_max <= 0 or m_half < 0:
        raise ValueError(
            f"a GEMM ramp needs a positive peak and eps_max and m_half >= 0, got "
            f"{peak_flops_per_us}, {eps_max}, {m_half}"
        )
    m = _floats(tokens)
    return np.where(
        m > 0, _floats(flops_per_token) * (m + m_half) / (peak_flops_per_us * eps_max), 0.0
    )


def gemm_kernel_us(ramp_us: ArrayLike, read_us: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """A dense GEMM's time once, as (SM, HBM): the larger of its ramped arithmetic
    (`ramped_arithmetic_us`) and its weight read (`memory_time_us`), charged to the resource that
    binds (SM on a tie), nothing to the other.

    The ramp was fitted on whole GEMM kernels: AISimulate's vLLM collector times the
    RowParallelLinear forward over six weight copies (so the weights come from HBM, not L2),
    M = 1 to 32,768 rows, and the registry's fit takes the best fraction of peak at each M.
    Below the crossover those kernels are memory bound, their time the weight read; above it
    the read streams under the arithmetic. Charging the ramp on SM and the read on HBM as well
    counts a memory-bound GEMM's read twice, and a compute-bound one's read that the measured
    kernel hid. (As M goes to 0 the fitted curve is 0.43-0.69 of the derated read on every
    part: not a time an HBM-resident GEMM can take, so there the read binds.) Not for the
    routed experts, whose sum the step-pricing spec fitted to expert-GEMM timings."""
    ramp, read = _floats(ramp_us), _floats(read_us)
    binds_sm = ramp >= read
    return np.where(binds_sm, ramp, 0.0), np.where(binds_sm, 0.0, read)


def sm_derate(sm_count: int, sm_budget: int | None) -> float:
    """How much longer SM arithmetic takes on `sm_budget` of the part's `sm_count` SMs (a
    concurrent kernel, such as a Triton KV fetch, withholding the rest): sm_count / sm_budget,
    1 with no budget or one at least the part's. Arithmetic spreads over SMs evenly, so its
    rate is proportional to the SMs it runs on; launch floors are not."""
    if sm_count < 1 or (sm_budget is not None and sm_budget < 1):
        raise ValueError(f"an SM budget needs positive counts, got {sm_budget} of {sm_count}")
    if sm_budget is None or sm_budget >= sm_count:
        return 1.0
    return sm_count / sm_budget


def memory_time_us(nbytes: ArrayLike, bandwidth_bytes_per_us: float, derate: float) -> np.ndarray:
    """HBM read time at the derated bandwidth: no kernel reaches the datasheet rate, and the
    registry's 0.8 is the fraction its streaming-read measurements reach on every part."""
    if bandwidth_bytes_per_us <= 0 or derate <= 0:
        raise ValueError(f"HBM read needs a positive rate, got {bandwidth_bytes_per_us} x {derate}")
    return np.asarray(nbytes, dtype=np.float64) / (bandwidth_bytes_per_us * derate)


def memory_op_latency_us(ops: ArrayLike, latency_us: float) -> np.ndarray:
    """The fixed part of `ops` memory-bound kernels (elementwise: norms, activations): each costs
    a constant latency on top of its bytes at the derated rate (`memory_time_us`), below which
    its size stops mattering. AISimulate prices every memory op so (aiconfigurator
    `PerfDatabase.query_mem_op`: bytes / (mem_bw x 0.8) + mem_empirical_constant_latency,
    which `ElementWise.query` calls once per elementwise op), with 3 us in the same system
    descriptor the 0.8 derate comes from. Within a decode step an elementwise kernel moves a few
    kilobytes, nanoseconds at the derated rate: the latency is all of its time."""
    if latency_us < 0:
        raise ValueError(f"a memory op's latency cannot be negative, got {latency_us}")
    return _floats(ops) * latency_us


def decode_read_tokens(
    context: ArrayLike,
    kind: str,
    *,
    window: int | None = None,
    top_k: int | None = None,
    compress_ratio: float | None = None,
    window_bounded: bool = True,
) -> np.ndarray:
    """Cached tokens one decode request reads in one layer.

    full/mla: the whole context. A layer with a window reads at most the window (the
    step-pricing spec; the swa rate was fitted on window-bounded reads); `window_bounded=False`
    reproduces a kernel version that reads the whole context on a windowed primary layer.
    sparse_mla reads min(ctx, top_k) selected positions, plus the rest of the context at
    1/compress_ratio where the architecture keeps a compressed stream (its generation
    measurements stay flat to 16k context and grow only with the compressed tail); without one
    (DeepSeek-V3.2's DSA) the unselected positions are not read.
    """
    ctx = np.maximum(np.asarray(context, dtype=np.float64), 0.0)
    if kind == "sparse_mla":
        if top_k is None or (compress_ratio is not None and compress_ratio < 1):
            raise ValueError(
                f"a sparse read needs top_k and a compress_ratio >= 1 if any, got {top_k}, "
                f"{compress_ratio}"
            )
        tail = 0.0 if compress_ratio is None else np.maximum(0.0, ctx - top_k) / compress_ratio
        return np.asarray(np.minimum(ctx, top_k) + tail)
    if window is not None and window_bounded:
        return np.minimum(ctx, window)
    return ctx


def context_shard(tokens: ArrayLike, ranks: int) -> np.ndarray:
    """Tokens the busiest of `ranks` holds when a sequence's KV is dealt across them in turn
    (vLLM's decode context parallelism): ceil(tokens / ranks)."""
    if ranks < 1:
        raise ValueError(f"a context is dealt over at least one rank, got {ranks}")
    return np.ceil(_floats(tokens) / ranks)


def zigzag_chunks(scheduled: int, ranks: int) -> list[list[tuple[int, int]]]:
    """Each rank's part of a prefill chunk split by prefill context parallelism: vLLM cuts it
    into 2 x ranks pieces of ceil(scheduled / (2 x ranks)) tokens and gives rank r pieces r and
    2 x ranks - 1 - r (pcp_manager._iter_rank_chunks), pairing a cheap early piece with a costly
    late one. Per rank, its (offset, tokens) runs within the chunk."""
    if ranks < 1 or scheduled < 0:
        raise ValueError(f"a split needs ranks >= 1 and tokens >= 0, got {ranks}, {scheduled}")
    pieces = 2 * ranks
    size = -(-scheduled // pieces)
    runs = []
    for rank in range(ranks):
        held = []
        for index in (rank, pieces - 1 - rank):
            low = min(index * size, scheduled)
            high = min(low + size, scheduled)
            if high > low:
                held.append((low, high - low))
        runs.append(held)
    return runs


def busiest_rank_prefill(
    scheduled: int, computed: int, ranks: int, caps: list[int | None]
) -> tuple[int, list[float]]:
    """A prefill chunk split over `ranks` prefill-context ranks (`zigzag_chunks`): the tokens
    the busiest rank computes, and per key cap the query-key pairs it attends. The step waits
    for the busiest rank. Uncapped, the pairs are the most any rank attends; capped (a window,
    a sparse top-k), those of the rank with the most tokens, each run at its offset in the
    sequence (the Go kernel's pcpCausalPairs and appendPCPChunks)."""
    runs = zigzag_chunks(scheduled, ranks)
    held = [sum(n for _, n in rank) for rank in runs]
    busiest = runs[held.index(max(held))]
    pairs = []
    for cap in caps:
        if cap is None:
            pairs.append(
                max(
                    sum(float(prefill_pairs(n, computed + low)) for low, n in rank) for rank in runs
                )
            )
        else:
            pairs.append(sum(float(prefill_pairs(n, computed + low, cap)) for low, n in busiest))
    return max(held), pairs


def decode_attention_us(
    read_tokens: ArrayLike,
    floor_us: ArrayLike,
    kv_bytes_per_token_layer: ArrayLike,
    rate_bytes_per_us: ArrayLike,
) -> np.ndarray:
    """One layer's decode attention: a measured floor (one per layer whatever the batch) plus the
    KV bytes read at the kind's measured rate (generation_attention_perf, per kind)."""
    if np.any(np.asarray(rate_bytes_per_us) <= 0):
        raise ValueError("decode attention needs a positive read rate")
    return _floats(floor_us) + _floats(read_tokens) * _floats(kv_bytes_per_token_layer) / _floats(
        rate_bytes_per_us
    )


def prefill_pairs(
    scheduled: ArrayLike, computed: ArrayLike, window: int | None = None
) -> np.ndarray:
    """Query-key pairs of a prefill chunk: s*c + s^2/2 (the chunk attends its cached prefix and
    the causal half of itself). With a window each query sees at most `window` keys."""
    s = np.asarray(scheduled, dtype=np.float64)
    c = np.asarray(computed, dtype=np.float64)
    if window is None:
        return s * c + s * s / 2.0
    # Integrate min(c + x, W) over x in [0, s]: unbounded up to x0 = W - c, then W per query.
    x0 = np.clip(window - c, 0.0, s)
    return x0 * c + x0 * x0 / 2.0 + (s - x0) * window


def prefill_attention_flops(
    pairs: ArrayLike, q_heads: ArrayLike, qk_dim: ArrayLike, v_dim: ArrayLike, tp: int
) -> np.ndarray:
    """Attention FLOPs on one rank: QK^T over qk_dim and PV over v_dim, 2 FLOPs per multiply-add,
    per pair and head (4 * head_dim when both widths are the head's)."""
    if tp < 1:
        raise ValueError(f"tp must be at least 1, got {tp}")
    return 2.0 * _floats(pairs) * _floats(q_heads) * (_floats(qk_dim) + _floats(v_dim)) / tp


def prefill_attention_us(
    pairs: ArrayLike,
    q_heads: ArrayLike,
    qk_dim: ArrayLike,
    v_dim: ArrayLike,
    tp: int,
    floor_us: ArrayLike,
    peak_flops_per_us: float,
    efficiency: ArrayLike,
    work_scale: float,
) -> np.ndarray:
    """Prefill attention on SM: a floor plus its FLOPs at the GEMM ramp scaled by work_scale,
    the fraction of the GEMM rate context_attention_perf reaches."""
    rate = peak_flops_per_us * np.asarray(efficiency, dtype=np.float64) * work_scale
    if np.any(rate <= 0):
        raise ValueError("prefill attention needs a positive rate (peak, efficiency, work_scale)")
    return _floats(floor_us) + prefill_attention_flops(pairs, q_heads, qk_dim, v_dim, tp) / rate


def expert_miss_probability(experts: ArrayLike, top_k: ArrayLike) -> np.ndarray:
    """Chance one token's routing leaves a given expert out: (E - k) / E, each token choosing k
    of E uniformly."""
    e, k = _floats(experts), _floats(top_k)
    if np.any(e < 1) or np.any(k < 0) or np.any(k > e):
        raise ValueError("distinct experts needs experts >= 1 and 0 <= top_k <= experts")
    return (e - k) / e


def distinct_experts(tokens: ArrayLike, miss: ArrayLike, local_experts: ArrayLike) -> np.ndarray:
    """Expected distinct experts of a rank's `local_experts` a step touches:
    local * (1 - miss^T), `miss` from `expert_miss_probability`; median measured routing
    imbalance is within 0.4% of 1 on Hopper (moe_perf)."""
    return _floats(local_experts) * (1.0 - np.power(_floats(miss), _floats(tokens)))


def busiest_rank_distinct_experts(
    tokens: ArrayLike, miss: float, local_experts: int, ranks: int
) -> np.ndarray:
    """Expected distinct experts the busiest of `ranks` expert-parallel ranks touches, each
    holding `local_experts` whole experts: the largest of `ranks` counts, each binomial over its
    experts with the chance 1 - miss^T that T routed tokens reach a given one (the counts taken
    as independent, which for hundreds of experts and top_k of a few they nearly are).

    The MoE layer ends when its slowest rank does, and at small T the chance spread leaves one
    rank with up to twice the mean (`distinct_experts`): DeepSeek-V3 over 8 ranks of 32 experts,
    4 tokens: 6.6 experts on the busiest rank against 3.8 on the mean one. The expectation is
    E[max] = sum over x < n of 1 - F(x)^ranks, F the binomial's distribution function. One rank
    is `distinct_experts`."""
    t = _floats(tokens)
    if ranks < 1 or local_experts < 0 or not 0.0 <= miss <= 1.0:
        raise ValueError(
            f"busiest rank needs ranks >= 1, local_experts >= 0 and 0 <= miss <= 1, got "
            f"{ranks}, {local_experts} and {miss}"
        )
    if ranks == 1:
        return distinct_experts(t, miss, local_experts)
    reached = 1.0 - np.power(miss, t)  # chance a given expert is touched
    missed = 1.0 - reached
    none, every = reached <= 0.0, missed <= 0.0  # exact masses: all at 0, or all at n
    # binomial pmf in logs, so no term underflows at large n (the edge cases' logs are unused)
    log_reached = np.log(np.where(none, 1.0, reached))
    log_missed = np.log(np.where(every, 1.0, missed))
    n = local_experts
    cdf = np.zeros_like(t)
    expected = np.zeros_like(t)
    log_choose = 0.0
    for x in range(n):
        if x:
            log_choose += math.log((n - x + 1) / x)
        mass = np.exp(log_choose + x * log_reached + (n - x) * log_missed)
        term = np.where(none, float(x == 0), np.where(every, 0.0, mass))
        cdf = np.minimum(cdf + term, 1.0)
        expected += 1.0 - cdf**ranks
    return expected


def recurrent_state_bytes(
    key_heads: int,
    value_heads: int,
    key_dim: int,
    value_dim: int,
    conv_kernel: int,
    element_bytes: float,
) -> float:
    """One request's recurrent state in one layer: a key_dim x value_dim matrix per value head,
    plus the causal convolution's last conv_kernel - 1 inputs over its channels (the keys,
    queries and values: 2 * key_heads * key_dim + value_heads * value_dim). Fixed whatever the
    context: vLLM allocates it per request, apart from the paged KV cache."""
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    return float((value_heads * key_dim * value_dim + channels * (conv_kernel - 1)) * element_bytes)


def chunked_scan_flops(
    key_heads: int, value_heads: int, key_dim: int, value_dim: int, chunk: int, conv_kernel: int
) -> float:
    """Prefill FLOPs per token of a chunked linear-attention scan (Mamba2's SSD, the chunked
    gated delta rule), 2 per multiply-add: within a chunk the causal scores Q K^T (chunk x
    key_dim per key head) and their product with the values (chunk x value_dim per value head);
    across chunks the state written from and read into each token (key_dim x value_dim per value
    head, twice); and the convolution (conv_kernel taps per channel). Linear in tokens: the
    chunk length, not the context, bounds the quadratic part."""
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    return 2.0 * (
        key_heads * chunk * key_dim
        + value_heads * chunk * value_dim
        + 2 * value_heads * key_dim * value_dim
        + conv_kernel * channels
    )


def scan_us(
    tokens: ArrayLike,
    flops_per_token: ArrayLike,
    peak_flops_per_us: float,
    eps_max: float,
    work_scale: float,
) -> np.ndarray:
    """A chunked scan's time: its FLOPs at the fraction eps_max * work_scale of the peak that
    the fused attention kernels reach (prefill attention's measured work_scale); its tiles are
    whole chunks, so no ramp in the step's tokens."""
    rate = peak_flops_per_us * eps_max * work_scale
    if rate <= 0:
        raise ValueError(
            f"a scan needs a positive rate, got {peak_flops_per_us} x {eps_max} x {work_scale}"
        )
    return _floats(tokens) * _floats(flops_per_token) / rate


def hyper_connection_us(
    tokens: ArrayLike,
    floor_us: float,
    stream_bytes_per_token: float,
    pre_rate_bytes_per_us: float,
    post_rate_bytes_per_us: float,
) -> np.ndarray:
    """One mHC hyper-connection (DeepSeek-V4.1) where the chip has its measured form: a fixed
    cost plus the residual streams' bytes at a measured rate for each of its two halves, the
    pre-mix that collapses the streams and the post-mix that writes them back (the step-pricing
    spec). The measured kernels include the small mixing GEMM, so it replaces both the graph's
    stated bytes and that GEMM. Zero for a step without tokens."""
    if pre_rate_bytes_per_us <= 0 or post_rate_bytes_per_us <= 0 or floor_us < 0:
        raise ValueError(
            f"a hyper-connection needs positive rates and a floor >= 0, got "
            f"{pre_rate_bytes_per_us}, {post_rate_bytes_per_us}, {floor_us}"
        )
    m = _floats(tokens)
    per_token = stream_bytes_per_token / pre_rate_bytes_per_us
    per_token += stream_bytes_per_token / post_rate_bytes_per_us
    return np.where(m > 0, floor_us + m * per_token, 0.0)


def collective_us(
    message_bytes: ArrayLike, t0_us: ArrayLike, r_t: ArrayLike, r_peak: ArrayLike
) -> np.ndarray:
    """max(t0 + b / r_t, b / r_peak): nccl_perf and custom_allreduce_perf sweeps show a fixed
    launch cost and a slower rate over step-sized messages, and the peak rate on large ones.
    The rates are positive by the chip file's schema (CollectiveTriple), checked once on load."""
    b, t0, rt, rp = _floats(message_bytes), _floats(t0_us), _floats(r_t), _floats(r_peak)
    return np.maximum(t0 + b / rt, b / rp)


def collective_rate_in_force(
    message_bytes: ArrayLike, t0_us: ArrayLike, r_t: ArrayLike, r_peak: ArrayLike
) -> np.ndarray:
    """The byte rate `collective_us` charges a message of this size at: r_t while the launch
    cost plus the step-range rate sets the time, r_peak past the crossover."""
    b, t0, rt, rp = _floats(message_bytes), _floats(t0_us), _floats(r_t), _floats(r_peak)
    return np.where(t0 + b / rt >= b / rp, rt, rp)


def cross_node_span(bandwidth_ratio: float, nodes: int, group: int) -> float:
    """Byte multiplier of a ring collective whose group crosses nodes: 1 + (ratio - 1) * cross / total,
    with cross = nodes - 1 hops of `total = group - 1` on the slower fabric."""
    if nodes < 1 or bandwidth_ratio <= 0:
        raise ValueError(
            f"a span needs nodes >= 1 and a positive ratio, got {nodes}, {bandwidth_ratio}"
        )
    if group <= 1:
        return 1.0
    return 1.0 + (bandwidth_ratio - 1.0) * (nodes - 1) / (group - 1)


def capture_ceiling(max_num_seqs: int, num_spec_tokens: int, blackwell: bool) -> int:
    """Largest token count vLLM captures in a CUDA graph: min(max_num_seqs * (1 + spec) * 2, 512),
    1024 on data-center Blackwell whatever the served dtype (vLLM v0.31.0
    `VllmConfig._set_cudagraph_sizes` decides from the device, not the quantization)."""
    if max_num_seqs < 1 or num_spec_tokens < 0:
        raise ValueError(
            f"capture ceiling needs max_num_seqs >= 1 and num_spec_tokens >= 0, "
            f"got {max_num_seqs} and {num_spec_tokens}"
        )
    return min(max_num_seqs * (1 + num_spec_tokens) * 2, 1024 if blackwell else 512)


def drafter_capture_rows(capture_tokens: int, num_spec_tokens: int, target_decode_mode: str) -> int:
    """Most requests a parallel-block drafter (DSpark) replays its own CUDA graph for: its rows
    are num_spec_tokens wide, not the target's 1 + num_spec_tokens, so a 64-token capture with
    five draft tokens holds 12 of its rows against the target's 10 (the step-pricing spec). Its
    graphs are captured only when the target decodes in full mode; otherwise none (0)."""
    if capture_tokens < 0 or num_spec_tokens < 1:
        raise ValueError(
            f"a drafter's ceiling needs capture_tokens >= 0 and num_spec_tokens >= 1, got "
            f"{capture_tokens} and {num_spec_tokens}"
        )
    if target_decode_mode != "full":
        return 0
    return capture_tokens // num_spec_tokens


def drafter_host_us(
    rows: ArrayLike,
    prefilling: ArrayLike,
    ceiling_rows: int,
    replay_us: float,
    eager_us: float,
    store_us: float,
) -> np.ndarray:
    """CPU cost of a parallel-block drafter's pass over a step's `rows` requests: one replay of
    its own graph up to its ceiling (`drafter_capture_rows`), its kernels launched eagerly past
    it or without a graph; a step with a prefill row also stores the drafter's extra context
    eagerly before the replay (the step-pricing spec). Nothing for a step without rows."""
    n = _floats(rows)
    graph = np.where(n <= ceiling_rows, replay_us, eager_us)
    store = np.where(np.asarray(prefilling, dtype=bool), store_us, 0.0)
    return np.where(n > 0, graph + store, 0.0)


def graph_host_us(
    mode: str, layers: int, splits: int, replay_us: float, eager_per_layer_us: float
) -> float:
    """CPU cost of running the step's graph(s): one replay (full), one per piece (piecewise
    splits at every attention op, vLLM's CompilationConfig splitting ops: `splits` of them make
    splits + 1 pieces), or eager launches per layer (none). Values are registry assumptions;
    their sum with dispatch matches two Granite-5 ITL runs."""
    if layers < 1 or splits < 0:
        raise ValueError(f"a graph needs layers >= 1 and splits >= 0, got {layers}, {splits}")
    if mode == "full":
        return replay_us
    if mode == "piecewise":
        return replay_us * (splits + 1)
    return eager_per_layer_us * layers


def host_us(
    captured_graph_us: ArrayLike,
    eager_graph_us: float,
    tokens: ArrayLike,
    ceiling: int,
    kernels: int,
    dispatch_us: float,
) -> np.ndarray:
    """Host time per step: the graph cost of the step's capture mode plus a dispatch cost per
    kernel (3.2 us, backed out of two end-to-end ITL runs). Past the capture ceiling vLLM runs
    the step with no graph, a uniform decode included (vllm/v1/worker/gpu/cudagraph_utils.py
    at v0.31.0), so the CPU pays the eager launches, even where that is less than the
    piecewise replays it would have paid below the ceiling."""
    captured = np.asarray(captured_graph_us, dtype=np.float64)
    graph = np.where(np.asarray(tokens) > ceiling, eager_graph_us, captured)
    return graph + kernels * dispatch_us


@dataclass(frozen=True)
class ComposedStep:
    """Steps composed by `compose_step`: resource totals, both estimates, per-kind stages, bottlenecks."""

    totals: np.ndarray  # (5, steps) in the kernel's RESOURCES order
    overlap: np.ndarray
    nooverlap: np.ndarray
    stage: np.ndarray  # (kinds, steps) one layer's time with its resources overlapped
    bottleneck: np.ndarray


def compose_step(
    layer: np.ndarray, expert: np.ndarray, repeat: np.ndarray, head: np.ndarray, host: np.ndarray
) -> ComposedStep:
    """Compose steps from one layer's times per kind: `layer` (4, kinds, steps) on SM, HBM,
    NVLink and NIC without the routed experts, `expert` (2, kinds, steps) the experts' SM and
    HBM; `head` (2, steps) the head's SM and HBM, `host` (steps,). Steps are the last axis so
    every per-resource operation runs over contiguous memory.

    Within a layer the resources overlap (the busiest one sets its time) except the routed
    experts, whose arithmetic and reads are added: against NVIDIA's expert-GEMM measurements
    on four chips the sum fits better than the max on every one. Layers run in sequence; the
    head takes the larger of its arithmetic and reads; host is added last because a kernel
    cannot start before the CPU dispatched it. NoOverlap is the sum of the five resources'
    totals. Overlap is clamped to NoOverlap; the bottleneck is the largest total (first in
    RESOURCES order on a tie).
    """
    busiest = np.maximum(np.maximum(layer[0], layer[1]), np.maximum(layer[2], layer[3]))
    stage = busiest + expert[0] + expert[1]
    totals = np.empty((5, len(host)))
    totals[:4] = repeat @ layer
    totals[:2] += repeat @ expert + head
    totals[4] = host
    nooverlap = totals.sum(axis=0)
    overlap = np.minimum(repeat @ stage + np.maximum(head[0], head[1]) + host, nooverlap)
    return ComposedStep(
        totals=totals,
        overlap=overlap,
        nooverlap=nooverlap,
        stage=stage,
        bottleneck=np.argmax(totals, axis=0),
    )
