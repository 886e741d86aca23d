"""The pricing kernel: a deployment's step time on five resources, and each slot's share of it.

`Kernel.build` resolves a deployment's chip and model files once and reduces the model graph
to per-layer-kind coefficients; pricing a batch then touches only per-request arrays. Every
entry point is vectorised over many steps (a single step is the one-step case of the same
code), so an hour of step logs is priced in a few numpy passes.

These behaviours differ from the Go kernel by default ("physics"); `compat="go"` restores them:
routed-expert arithmetic is divided across the TP group (the Go kernel's own per-step
measurements favour this: per-step error 27.5% -> 23.0%), a sliding-window layer's decode
reads at most its window (the step-pricing spec says so; the swa rate was fitted on
window-bounded reads), four-bit weights without a four-bit peak compute at the bf16 rate
(`compute_lane`), and prefill attention runs at the bf16 ramp its work_scale was fitted against, at
each request's own query count (a varlen attention kernel's occupancy depends on the
sequence, not on the step's other tokens, which also keeps the price monotone in requests;
under the Go kernel's single eps(T), a decode row joining a long prefill chunk lowers it).

Both modes keep the Go kernel's one-kernel rule: a step holding decode and prefill rows of a
non-latent attention pays one floor, the larger. NoOverlap never drops when a request joins,
but the floor moves from HBM to SM, so one resource (and Overlap) can.
Not modelled: expert and context parallelism, recurrent mixers, speculative drafter passes
(speculation only sets the uniform-decode width and the capture ceiling), and a sparse
layer's indexer scan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike
from pydantic import BaseModel, ConfigDict, Field

from pricing import laws
from pricing.spec import (
    CACHE_BYTES,
    WEIGHT_BYTES,
    AttentionNode,
    ChipSpec,
    CollectiveNode,
    ElementwiseNode,
    GemmNode,
    GroupedGemmNode,
    LayerKind,
    MeasuredEngine,
    ModelSpec,
    PricingError,
    kv_bytes_per_token_layer,
    load_chip,
    load_model,
)

RESOURCES = ("sm", "hbm", "nvlink", "nic", "host")
SM, HBM, NVLINK, NIC, HOST = range(5)

# GPU kernels each graph node launches (blis-latency-kernel plan constants); a collective
# whose emit condition does not hold launches none.
KERNELS_PER_NODE = {
    "gemm": 1,
    "grouped_gemm": 4,
    "attention": 2,
    "elementwise": 1,
    "all_reduce": 1,
    "all_gather": 1,
    "reduce_scatter": 1,
    "all2all": 2,
}
HEAD_KERNELS = 2  # final norm + lm_head
ACTIVATION_BYTES = 2  # collectives, norms and hidden states move bf16 activations

CudagraphMode = Literal["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]
# vLLM's per-batch choice: (uniform decode or empty batch, any other batch).
GRAPH_MODES: dict[str, tuple[str, str]] = {
    "PIECEWISE": ("piecewise", "piecewise"),
    "FULL": ("full", "full"),
    "FULL_AND_PIECEWISE": ("full", "piecewise"),
    "FULL_DECODE_ONLY": ("full", "none"),
    "NONE": ("none", "none"),
}
# Collective widths searched by the registry; wider groups use the widest measured width.
WIDEST_SEARCHED_WIDTH = 16


class Deployment(BaseModel):
    """What the kernel needs to know about one serving replica."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    chip: str
    dtype: str | None = None  # served weight dtype; None = the model's checkpoint dtype
    cache_dtype: str | None = None  # KV cache dtype; None = "auto" (bf16)
    tp: int = Field(default=1, gt=0)
    nodes: int = Field(default=1, gt=0)
    cudagraph_mode: CudagraphMode = "FULL_AND_PIECEWISE"
    max_num_seqs: int | None = Field(default=None, gt=0)
    decode_threshold: int = Field(default=1, gt=0)
    num_spec_tokens: int = Field(default=0, ge=0)
    compat: Literal["physics", "go"] = "physics"


@dataclass(frozen=True)
class StepPrice:
    sm_us: float
    hbm_us: float
    nvlink_us: float
    nic_us: float
    host_us: float
    overlap_us: float
    nooverlap_us: float
    bottleneck: str
    # layer kind -> {"repeat", per-layer "sm_us", "hbm_us", "nvlink_us", "nic_us",
    # "expert_sm_us", "expert_hbm_us", "stage_us"}; "head" -> {"sm_us", "hbm_us"}
    per_kind: dict


@dataclass(frozen=True)
class StepPrices:
    """Per-step arrays (n_steps,); `bottleneck` indexes RESOURCES."""

    sm_us: np.ndarray
    hbm_us: np.ndarray
    nvlink_us: np.ndarray
    nic_us: np.ndarray
    host_us: np.ndarray
    overlap_us: np.ndarray
    nooverlap_us: np.ndarray
    bottleneck: np.ndarray

    @property
    def bottleneck_names(self) -> np.ndarray:
        return np.asarray(RESOURCES)[self.bottleneck]


@dataclass(frozen=True)
class SlotWork:
    """A step's NoOverlap split: `fixed_us` (5,) no single request caused, `slot_us` (n, 5) each
    slot's own work, per resource in RESOURCES order. fixed + slots == NoOverlap."""

    fixed_us: np.ndarray
    slot_us: np.ndarray


def compute_lane(dtype: str, chip: ChipSpec, compat: str) -> str:
    """The peak/ramp a served dtype computes at on this chip.

    bf16/fp16 and int4 (W4A16) compute in bf16; fp8 and int8 at fp8 where the chip has it.
    Four-bit floats use a native four-bit peak where there is one; otherwise vLLM runs them
    as weight-only kernels at the bf16 rate (the step-pricing spec), while the Go kernel tries fp8 first.
    """
    peaks = chip.peak_tflops
    if dtype in ("fp8", "int8"):
        return "fp8" if "fp8" in peaks else "bf16"
    if dtype in ("mxfp4", "nvfp4"):
        if "nvfp4" in peaks:
            return "nvfp4"
        return "fp8" if compat == "go" and "fp8" in peaks else "bf16"
    return "bf16"


def _snap_width(chip: ChipSpec, op: str, width: int) -> tuple[float, float, float]:
    measured: dict[int, list[float]] = getattr(chip.collectives, op)
    if not measured:
        raise PricingError(
            f"chip {chip.name!r} has no measured {op} collective (pricing/chips/{chip.name}.yaml)"
        )
    widths = sorted(measured)
    if width in measured:
        chosen = width
    elif width < widths[0]:
        chosen = widths[0]
    elif width > WIDEST_SEARCHED_WIDTH:
        chosen = widths[-1]
    else:
        raise PricingError(
            f"chip {chip.name!r} has no measured {op} collective for a group of {width} GPUs "
            f"(measured widths: {widths})"
        )
    t0, r_t, r_peak = measured[chosen]
    return t0, r_t, r_peak


def _emits(node: CollectiveNode, tp: int) -> bool:
    if node.emit == "always":
        return True
    if node.emit == "expert_parallel":
        return False
    return tp > 1


def _as_counts(name: str, values: ArrayLike) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise PricingError(f"{name} must be one-dimensional, got shape {array.shape}")
    if (
        array.size
        and not np.issubdtype(array.dtype, np.integer)
        and (
            not np.issubdtype(array.dtype, np.floating)
            or not np.all(np.isfinite(array))
            or not np.array_equal(array, np.round(array))
        )
    ):
        raise PricingError(f"{name} must hold whole token counts")
    array = array.astype(np.int64, copy=False)
    if array.size and array.min() < 0:
        first = int(np.argmax(array < 0))
        raise PricingError(f"{name}[{first}] is negative ({int(array[first])})")
    return array


class Kernel:
    """A deployment's pricing kernel; build with `Kernel.build(deployment)`."""

    def __init__(self, deployment: Deployment, chip: ChipSpec, model: ModelSpec) -> None:
        self.deployment = deployment
        self.chip = chip
        self.model = model
        tp, nodes = deployment.tp, deployment.nodes
        served = deployment.dtype or model.weight_dtype
        if served not in WEIGHT_BYTES:
            raise PricingError(f"unknown dtype {served!r}; known: {sorted(WEIGHT_BYTES)}")
        self.cache_dtype = deployment.cache_dtype or "auto"
        if self.cache_dtype not in CACHE_BYTES:
            raise PricingError(
                f"unknown cache dtype {self.cache_dtype!r}; known: {sorted(CACHE_BYTES)}"
            )
        if tp % nodes or tp // nodes > chip.gpus_per_node:
            raise PricingError(
                f"tp {tp} over {nodes} node(s) does not fit {chip.name!r} nodes of {chip.gpus_per_node} GPUs"
            )
        physics = deployment.compat == "physics"
        self.lane = compute_lane(served, chip, deployment.compat)
        ramp = chip.gemm.ramps[self.lane]
        self.eps_max, self.m_half = ramp.eps_max, ramp.m_half
        self.peak = chip.peak_tflops[self.lane] * 1e6  # FLOP per microsecond
        bandwidth, derate = chip.hbm_tb_s * 1e6, chip.gemm.hbm_derate
        self._bandwidth, self._derate = bandwidth, derate
        if chip.attention.prefill is None:
            raise PricingError(
                f"chip {chip.name!r} has no prefill attention coefficients (attention.prefill)"
            )
        attention_lane = "bf16" if physics else self.lane
        if attention_lane not in chip.peak_tflops:
            raise PricingError(
                f"chip {chip.name!r} has no {attention_lane} peak for prefill attention"
            )
        self._attention_peak = chip.peak_tflops[attention_lane] * 1e6
        self._attention_ramp = chip.gemm.ramps[attention_lane]
        self.per_request_attention_ramp = physics

        if nodes > 1:
            if chip.inter_node_gb_s is None:
                raise PricingError(
                    f"chip {chip.name!r} states no inter_node_gb_s, needed for a TP group over {nodes} nodes"
                )
            span = laws.cross_node_span(chip.nvlink_gb_s / chip.inter_node_gb_s, nodes, tp)
        else:
            span = 1.0

        kinds = model.layer_kinds
        n_kinds = len(kinds)
        self.kind_names = [kind.name for kind in kinds]
        self.repeat = np.array([kind.repeat for kind in kinds], dtype=np.float64)
        self.dense_flops = np.zeros(n_kinds)  # per token, per rank
        self.weight_bytes = np.zeros(n_kinds)  # per rank
        self.activation_bytes = np.zeros(n_kinds)  # per token, per rank
        self.expert_flops = np.zeros(n_kinds)  # routed, per token (all top_k experts)
        self.expert_bytes = np.zeros(n_kinds)  # per distinct expert, per rank
        self.experts = np.ones(n_kinds)
        self.top_k = np.zeros(n_kinds)
        self.has_attention = np.zeros(n_kinds, dtype=bool)
        self.decode_floor = np.zeros(n_kinds)
        self.decode_rate = np.ones(n_kinds)
        self.kv_layer_bytes = np.zeros(n_kinds)
        self.prefill_floor = np.zeros(n_kinds)
        self.q_heads = np.zeros(n_kinds)
        self.head_dim = np.zeros(n_kinds)
        self.one_kernel_floor = np.zeros(n_kinds, dtype=bool)
        self.windows = np.full(n_kinds, np.nan)
        read_policies: list[tuple] = []
        pair_policies: list[int | None] = []
        self.read_policy = np.zeros(n_kinds, dtype=np.int64)
        self.pair_policy = np.zeros(n_kinds, dtype=np.int64)
        collectives: list[tuple[int, float, float, float, float, int]] = []
        kernels = HEAD_KERNELS
        blackwell = chip.blackwell

        for index, kind in enumerate(kinds):
            kernels += kind.repeat * self._kind_plan(
                index,
                kind,
                served,
                tp,
                physics,
                span,
                nodes,
                blackwell,
                read_policies,
                pair_policies,
                collectives,
            )
        self.read_policies = read_policies
        self.pair_policies = pair_policies
        # Identical launches (the same op, width and message size in several layers) are priced
        # once per step; (distinct, kinds) launch counts per fabric sum them into each kind.
        distinct = sorted({c[1:] for c in collectives})
        self.collective_t0 = np.array([c[0] for c in distinct])
        self.collective_r_t = np.array([c[1] for c in distinct])
        self.collective_r_peak = np.array([c[2] for c in distinct])
        self.collective_bytes_per_token = np.array([c[3] for c in distinct])
        self._collective_launches = {
            resource: np.zeros((len(distinct), n_kinds)) for resource in (NVLINK, NIC)
        }
        for kind_index, *launch in collectives:
            self._collective_launches[launch[4]][distinct.index(tuple(launch)), kind_index] += 1.0

        head_bytes_per_element = WEIGHT_BYTES[model.head.weight_dtype or served]
        self.head_flops = 2.0 * model.head.n * model.head.k / tp
        self.head_hbm_us = float(
            laws.memory_time_us(
                model.head.n * model.head.k * head_bytes_per_element / tp, bandwidth, derate
            )
        )
        self.kernels = kernels
        layers = model.layers
        host = chip.host
        self.dispatch_us = host.dispatch_per_kernel_us
        self.graph_cost = {
            mode: laws.graph_host_us(
                mode, layers, host.replay_graph_us, host.eager_launch_per_layer_us
            )
            for mode in ("full", "piecewise", "none")
        }
        decode_mode, other_mode = GRAPH_MODES[deployment.cudagraph_mode]
        self.graph_decode_us = self.graph_cost[decode_mode]
        self.graph_other_us = self.graph_cost[other_mode]
        max_num_seqs = deployment.max_num_seqs
        if max_num_seqs is None:
            # vLLM's default: 1024 sequences on parts with at least 70 GiB, except A100s.
            max_num_seqs = (
                1024 if chip.memory_gib >= 70 and not chip.name.startswith("a100") else 256
            )
        self.capture_ceiling = laws.capture_ceiling(
            max_num_seqs, deployment.num_spec_tokens, blackwell
        )
        self.uniform_decode_tokens = 1 + deployment.num_spec_tokens

        # Whole replica: every rank holds its shard (or, for latent caches, a full copy).
        # Windowed layers hold at most their window per request, so they are not a per-token rate.
        windowed = ~np.isnan(self.windows)
        self.kv_bytes_per_token = int(tp * (self.repeat * self.kv_layer_bytes)[~windowed].sum())
        self._kv_window_bytes = tp * self.repeat * self.kv_layer_bytes * windowed
        self._kv_windows = np.nan_to_num(self.windows)

    # ------------------------------------------------------------------ build helpers
    def _kind_plan(
        self,
        index: int,
        kind: LayerKind,
        served: str,
        tp: int,
        physics: bool,
        span: float,
        nodes: int,
        blackwell: bool,
        read_policies: list,
        pair_policies: list,
        collectives: list,
    ) -> int:
        """Fill layer kind `index`'s coefficients; returns the kernels one such layer launches."""
        chip = self.chip
        hidden = self.model.hidden_size
        kernels = 0
        for node in kind.nodes:
            if isinstance(node, GemmNode):
                shards = 1 if node.replicated else tp
                self.dense_flops[index] += 2.0 * node.n * node.k / shards
                self.weight_bytes[index] += (
                    node.n * node.k * WEIGHT_BYTES[node.weight_dtype or served] / shards
                )
            elif isinstance(node, GroupedGemmNode):
                bytes_per_element = WEIGHT_BYTES[node.weight_dtype or served]
                # Shared experts run for every token, sharded like a dense MLP.
                self.dense_flops[index] += 6.0 * node.n * node.k * node.shared_experts / tp
                self.weight_bytes[index] += (
                    3.0 * node.n * node.k * node.shared_experts * bytes_per_element / tp
                )
                routed_shards = tp if physics else 1
                self.expert_flops[index] = (
                    node.top_k
                    * 6.0
                    * node.n
                    * node.k
                    * chip.gemm.moe_routing_imbalance
                    / routed_shards
                )
                self.expert_bytes[index] = 3.0 * node.n * node.k * bytes_per_element / tp
                self.experts[index] = node.experts
                self.top_k[index] = node.top_k
            elif isinstance(node, AttentionNode):
                self._attention_plan(
                    index, node, tp, physics, blackwell, read_policies, pair_policies
                )
            elif isinstance(node, ElementwiseNode):
                self.activation_bytes[index] += (
                    node.bytes_per_token or 2 * hidden * ACTIVATION_BYTES
                ) / tp
            else:
                if not _emits(node, tp):
                    continue
                t0, r_t, r_peak = _snap_width(chip, node.op, tp)
                resource = NIC if nodes > 1 else NVLINK
                collectives.append(
                    (index, t0, r_t, r_peak, hidden * ACTIVATION_BYTES * span, resource)
                )
            kernels += KERNELS_PER_NODE[node.op]
        return kernels

    def _attention_plan(
        self,
        index: int,
        node: AttentionNode,
        tp: int,
        physics: bool,
        blackwell: bool,
        read_policies: list,
        pair_policies: list,
    ) -> None:
        chip = self.chip
        measured = chip.attention.decode
        kind_key = {"gqa": "full", "swa": "swa", "mla": "mla", "sparse_mla": "sparse_mla"}[
            node.kind
        ]
        # A kind without its own measurement uses the part's full-attention pair; a part with
        # none reads the KV bytes at the derated HBM bandwidth with no floor.
        decode = measured.get(kind_key) or measured.get("full")
        self.has_attention[index] = True
        self.kv_layer_bytes[index] = kv_bytes_per_token_layer(node, tp, self.cache_dtype)
        if decode is None:
            self.decode_floor[index] = 0.0
            self.decode_rate[index] = self._bandwidth * self._derate
        else:
            self.decode_floor[index] = decode.floor_us
            self.decode_rate[index] = decode.rate_bytes_per_us
        prefill = chip.attention.prefill
        self.prefill_floor[index] = prefill.floor_us
        self.q_heads[index] = node.q_heads
        self.head_dim[index] = node.head_dim
        # FlashAttention serves decode and prefill rows in one kernel on non-latent attention,
        # so a mixed step pays one floor. vLLM picks the attention backend from the device: on
        # data-center Blackwell it is FlashInfer/TRT-LLM for every dtype, which runs the decode
        # and prefill rows as separate kernels, each with its floor.
        self.one_kernel_floor[index] = not node.latent and not blackwell
        # The Go kernel reads the whole context on a windowed primary layer; the spec bounds it.
        window_bounded = physics or node.kind != "swa"
        read_policy = (
            node.kind if node.kind == "sparse_mla" else "dense",
            node.window if window_bounded else None,
            node.top_k,
            node.compress_ratio,
        )
        if read_policy not in read_policies:
            read_policies.append(read_policy)
        self.read_policy[index] = read_policies.index(read_policy)
        # Prefill queries see at most the window, or on a sparse layer the top-k its indexer selects.
        keys_cap = node.top_k if node.kind == "sparse_mla" else node.window
        if keys_cap not in pair_policies:
            pair_policies.append(keys_cap)
        self.pair_policy[index] = pair_policies.index(keys_cap)
        if node.window is not None:
            self.windows[index] = node.window

    @classmethod
    def build(cls, deployment: Deployment) -> Kernel:
        return cls(deployment, load_chip(deployment.chip), load_model(deployment.model))

    @property
    def measured_engine(self) -> MeasuredEngine:
        """The engine release the chip's coefficients were measured on (the calibration check
        compares the versions in a pool's log against it)."""
        return self.chip.measured_engine

    # ------------------------------------------------------------------ KV memory
    def kv_bytes(self, context_tokens: ArrayLike) -> np.ndarray:
        """Whole-replica KV bytes held by requests with these contexts: every token on full and
        latent layers, at most the window on windowed layers (their blocks are freed behind it)."""
        ctx = _as_counts("context_tokens", context_tokens).astype(np.float64)
        windowed = np.minimum(ctx[:, None], self._kv_windows[None, :]) @ self._kv_window_bytes
        return ctx * self.kv_bytes_per_token + windowed

    # ------------------------------------------------------------------ per-slot terms
    def _validate(
        self,
        step_index: ArrayLike,
        scheduled: ArrayLike,
        computed: ArrayLike,
        prompt_len: ArrayLike,
        n_steps: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        steps = _as_counts("step_index", step_index)
        s = _as_counts("scheduled", scheduled)
        c = _as_counts("computed", computed)
        prompt = _as_counts("prompt_len", prompt_len)
        if not (len(steps) == len(s) == len(c) == len(prompt)):
            raise PricingError(
                f"per-slot arrays differ in length: step_index {len(steps)}, scheduled {len(s)}, "
                f"computed {len(c)}, prompt_len {len(prompt)}"
            )
        if n_steps < 0:
            raise PricingError(f"n_steps is negative ({n_steps})")
        if len(steps) and steps.max() >= n_steps:
            raise PricingError(f"step_index {int(steps.max())} is outside 0..{n_steps - 1}")
        return steps, s, c

    def _slot_terms(self, steps: np.ndarray, s: np.ndarray, c: np.ndarray, n_steps: int) -> dict:
        """Per-slot attention work and the per-step aggregates every price needs."""
        tokens = s.astype(np.float64)
        prefill = s > self.deployment.decode_threshold
        decode = (s > 0) & ~prefill
        context = (c + s).astype(np.float64)

        def per_step(weights: np.ndarray, where: np.ndarray | slice = slice(None)) -> np.ndarray:
            return np.bincount(steps[where], weights=weights, minlength=n_steps)

        def any_per_step(flags: np.ndarray) -> np.ndarray:
            marked = np.zeros(n_steps, dtype=bool)
            marked[steps[flags]] = True
            return marked

        reads = np.empty((len(s), len(self.read_policies)))
        step_reads = np.empty((n_steps, len(self.read_policies)))
        for j, (kind, window, top_k, ratio) in enumerate(self.read_policies):
            reads[:, j] = np.where(
                decode,
                laws.decode_read_tokens(
                    context, kind, window=window, top_k=top_k, compress_ratio=ratio
                ),
                0.0,
            )
            step_reads[:, j] = per_step(reads[:, j])
        # Prefill attention work in query-key pairs at eps_max: per request at its own ramp
        # (physics), or raw pairs the step's single ramp is applied to later (go). Only the
        # few prefill rows are computed.
        rows = np.flatnonzero(prefill)
        prefill_tokens = tokens[rows]
        if self.per_request_attention_ramp:
            stretch = (prefill_tokens + self._attention_ramp.m_half) / prefill_tokens
        else:
            stretch = 1.0
        pairs = np.zeros((len(s), len(self.pair_policies)))
        step_pairs = np.empty((n_steps, len(self.pair_policies)))
        for j, window in enumerate(self.pair_policies):
            pairs[rows, j] = laws.prefill_pairs(prefill_tokens, c[rows], window) * stretch
            step_pairs[:, j] = per_step(pairs[rows, j], rows)
        return {
            "tokens": tokens,
            "reads": reads,
            "pairs": pairs,
            "step_tokens": per_step(tokens),
            "has_prefill": any_per_step(prefill),
            "has_decode": any_per_step(decode),
            "uniform": ~any_per_step(s != self.uniform_decode_tokens),
            "step_reads": step_reads,
            "step_pairs": step_pairs,
        }

    def _floors(
        self, has_prefill: np.ndarray, has_decode: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per-layer decode and prefill floors paid by each step, (steps, kinds)."""
        decode_floor = has_decode[:, None] * self.decode_floor[None, :]
        prefill_floor = has_prefill[:, None] * self.prefill_floor[None, :]
        mixed = (has_prefill & has_decode)[:, None] & self.one_kernel_floor[None, :]
        prefill_wins = self.prefill_floor > self.decode_floor
        decode_floor = np.where(mixed & prefill_wins, 0.0, decode_floor)
        prefill_floor = np.where(mixed & ~prefill_wins, 0.0, prefill_floor)
        return decode_floor * self.has_attention, prefill_floor * self.has_attention

    def _collective_times(self, step_tokens: np.ndarray) -> np.ndarray:
        message = step_tokens[:, None] * self.collective_bytes_per_token[None, :]
        times = laws.collective_us(
            message, self.collective_t0, self.collective_r_t, self.collective_r_peak
        )
        return np.where(step_tokens[:, None] > 0, times, 0.0)

    def _graph_us(self, uniform: np.ndarray) -> np.ndarray:
        return np.where(uniform, self.graph_decode_us, self.graph_other_us)

    # ------------------------------------------------------------------ pricing
    def _compose(self, terms: dict) -> dict[str, np.ndarray]:
        T = terms["step_tokens"]
        active = (T > 0)[:, None]
        decode_floor, prefill_floor = self._floors(terms["has_prefill"], terms["has_decode"])
        sm_dense = laws.ramped_arithmetic_us(
            T[:, None], self.dense_flops[None, :], self.peak, self.eps_max, self.m_half
        )
        expert_sm = laws.ramped_arithmetic_us(
            T[:, None], self.expert_flops[None, :], self.peak, self.eps_max, self.m_half
        )
        ramp = self._attention_ramp
        if self.per_request_attention_ramp:
            efficiency = np.full((len(T), 1), ramp.eps_max)
        else:
            efficiency = laws.ramp_efficiency(T, ramp.eps_max, ramp.m_half)[:, None]
        prefill_attention = self.has_attention * laws.prefill_attention_us(
            terms["step_pairs"][:, self.pair_policy],
            self.q_heads,
            self.head_dim,
            self.deployment.tp,
            prefill_floor,
            self._attention_peak,
            np.where(efficiency > 0, efficiency, 1.0),
            self.chip.attention.prefill.work_scale,
        )
        weights_and_activations = laws.memory_time_us(
            self.weight_bytes[None, :] + T[:, None] * self.activation_bytes[None, :],
            self._bandwidth,
            self._derate,
        )
        decode_attention = laws.decode_attention_us(
            terms["step_reads"][:, self.read_policy],
            decode_floor,
            self.kv_layer_bytes,
            self.decode_rate,
        )
        hbm_dense = np.where(
            active, weights_and_activations + decode_attention * self.has_attention, 0.0
        )
        expert_hbm = laws.memory_time_us(
            self.expert_bytes[None, :]
            * laws.distinct_experts(T[:, None], self.experts, self.top_k),
            self._bandwidth,
            self._derate,
        )
        collectives = self._collective_times(T)
        head_sm = laws.ramped_arithmetic_us(
            T, self.head_flops, self.peak, self.eps_max, self.m_half
        )
        head_hbm = np.where(T > 0, self.head_hbm_us, 0.0)
        host = laws.host_us(
            self._graph_us(terms["uniform"]),
            self.graph_cost["none"],
            T,
            self.capture_ceiling,
            self.kernels,
            self.dispatch_us,
        )
        composed = laws.compose_step(
            sm_dense,
            prefill_attention,
            hbm_dense,
            collectives @ self._collective_launches[NVLINK],
            collectives @ self._collective_launches[NIC],
            expert_sm,
            expert_hbm,
            self.repeat,
            head_sm,
            head_hbm,
            host,
        )
        composed.update(
            sm_dense=sm_dense,
            prefill_attention=prefill_attention,
            hbm_dense=hbm_dense,
            expert_sm=expert_sm,
            expert_hbm=expert_hbm,
            head_sm=head_sm,
            head_hbm=head_hbm,
            nvlink=collectives @ self._collective_launches[NVLINK],
            nic=collectives @ self._collective_launches[NIC],
        )
        return composed

    def price(self, scheduled: ArrayLike, computed: ArrayLike, prompt_len: ArrayLike) -> StepPrice:
        """Price one step; one entry per request in each array. A request is a prefill when it
        schedules more than the decode threshold, as the engine classes it; prompt_len is
        validated but does not change the price."""
        n = len(np.asarray(scheduled))
        steps, s, c = self._validate(
            np.zeros(n, dtype=np.int64), scheduled, computed, prompt_len, 1
        )
        composed = self._compose(self._slot_terms(steps, s, c, 1))
        totals = composed["totals"][0]
        per_kind = {
            name: {
                "repeat": int(self.repeat[k]),
                "sm_us": float(composed["sm_dense"][0, k] + composed["prefill_attention"][0, k]),
                "hbm_us": float(composed["hbm_dense"][0, k]),
                "nvlink_us": float(composed["nvlink"][0, k]),
                "nic_us": float(composed["nic"][0, k]),
                "expert_sm_us": float(composed["expert_sm"][0, k]),
                "expert_hbm_us": float(composed["expert_hbm"][0, k]),
                "stage_us": float(composed["stage"][0, k]),
            }
            for k, name in enumerate(self.kind_names)
        }
        per_kind["head"] = {
            "repeat": 1,
            "sm_us": float(composed["head_sm"][0]),
            "hbm_us": float(composed["head_hbm"][0]),
        }
        return StepPrice(
            sm_us=float(totals[SM]),
            hbm_us=float(totals[HBM]),
            nvlink_us=float(totals[NVLINK]),
            nic_us=float(totals[NIC]),
            host_us=float(totals[HOST]),
            overlap_us=float(composed["overlap"][0]),
            nooverlap_us=float(composed["nooverlap"][0]),
            bottleneck=RESOURCES[int(composed["bottleneck"][0])],
            per_kind=per_kind,
        )

    def price_many(
        self,
        step_index: ArrayLike,
        scheduled: ArrayLike,
        computed: ArrayLike,
        prompt_len: ArrayLike,
        n_steps: int,
    ) -> StepPrices:
        """Price many steps at once; per-slot arrays with `step_index` in 0..n_steps-1.
        A step with no slot costs its host time only."""
        steps, s, c = self._validate(step_index, scheduled, computed, prompt_len, n_steps)
        composed = self._compose(self._slot_terms(steps, s, c, n_steps))
        totals = composed["totals"]
        return StepPrices(
            sm_us=totals[:, SM],
            hbm_us=totals[:, HBM],
            nvlink_us=totals[:, NVLINK],
            nic_us=totals[:, NIC],
            host_us=totals[:, HOST],
            overlap_us=composed["overlap"],
            nooverlap_us=composed["nooverlap"],
            bottleneck=composed["bottleneck"].astype(np.int8),
        )

    # ------------------------------------------------------------------ work per slot
    def slot_work_many(
        self,
        step_index: ArrayLike,
        scheduled: ArrayLike,
        computed: ArrayLike,
        prompt_len: ArrayLike,
        n_steps: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Split each step's NoOverlap into fixed_us (n_steps, 5) and slot_us (n_slots, 5).

        Fixed: weights and the head read once, attention floors, host, each collective launch's
        t0 and the m_half ramp overhead of every GEMM (T / eps(T) = (T + m_half) / eps_max, so
        GEMM time is exactly m_half's share plus a per-token share). A slot's own part: its
        tokens' arithmetic, activations and collective bytes, its attention pairs (at its own
        ramp, or the step's under compat "go"), its context read, and the distinct experts' reads in proportion to its
        tokens. Per step, fixed + slots == NoOverlap.
        """
        steps, s, c = self._validate(step_index, scheduled, computed, prompt_len, n_steps)
        terms = self._slot_terms(steps, s, c, n_steps)
        T = terms["step_tokens"]
        active = T > 0
        decode_floor, prefill_floor = self._floors(terms["has_prefill"], terms["has_decode"])
        repeat = self.repeat
        gemm_us_per_token = float(
            (self.dense_flops + self.expert_flops) @ repeat + self.head_flops
        ) / (self.peak * self.eps_max)

        fixed = np.zeros((n_steps, 5))
        fixed[:, SM] = active * gemm_us_per_token * self.m_half + (prefill_floor @ repeat)
        fixed[:, HBM] = (
            active
            * (
                float(
                    laws.memory_time_us(self.weight_bytes @ repeat, self._bandwidth, self._derate)
                )
                + self.head_hbm_us
            )
            + decode_floor @ repeat
        )
        message = T[:, None] * self.collective_bytes_per_token
        # Below the crossover the fixed launch cost plus the step-range rate sets the time.
        linear = (
            self.collective_t0 + message / self.collective_r_t >= message / self.collective_r_peak
        ) & active[:, None]
        rate = np.where(linear, self.collective_r_t, self.collective_r_peak)
        per_token_rate = np.zeros((n_steps, 5))
        for resource in (NVLINK, NIC):
            on = self._collective_launches[resource] @ repeat
            fixed[:, resource] = (linear * self.collective_t0) @ on
            per_token_rate[:, resource] = (self.collective_bytes_per_token / rate) @ on
        fixed[:, HOST] = laws.host_us(
            self._graph_us(terms["uniform"]),
            self.graph_cost["none"],
            T,
            self.capture_ceiling,
            self.kernels,
            self.dispatch_us,
        )

        # Prefill attention per pair: at eps_max when each request carries its own ramp in its
        # pairs, otherwise at the step's ramp, which stretches every pair by (T + m_half) / T.
        ramp = self._attention_ramp
        attention_flops_per_pair = 4.0 * self.q_heads * self.head_dim / self.deployment.tp
        pair_us = attention_flops_per_pair / (
            self._attention_peak * ramp.eps_max * self.chip.attention.prefill.work_scale
        )
        pair_us_by_policy = np.array(
            [
                (pair_us * repeat)[self.pair_policy == j].sum()
                for j in range(len(self.pair_policies))
            ]
        )
        read_us = self.kv_layer_bytes / self.decode_rate * repeat * self.has_attention
        read_us_by_policy = np.array(
            [read_us[self.read_policy == j].sum() for j in range(len(self.read_policies))]
        )
        expert_hbm_per_token = laws.memory_time_us(
            (
                self.expert_bytes[None, :]
                * laws.distinct_experts(T[:, None], self.experts, self.top_k)
            )
            @ repeat,
            self._bandwidth,
            self._derate,
        ) / np.maximum(T, 1.0)
        per_token_rate[:, SM] = gemm_us_per_token
        per_token_rate[:, HBM] = (
            float(
                laws.memory_time_us(self.activation_bytes @ repeat, self._bandwidth, self._derate)
            )
            + expert_hbm_per_token
        )
        step_stretch = (
            np.ones(n_steps)
            if self.per_request_attention_ramp
            else (T + ramp.m_half) / np.maximum(T, 1.0)
        )

        tokens = terms["tokens"]
        slot = tokens[:, None] * per_token_rate[steps]
        slot[:, SM] += (terms["pairs"] @ pair_us_by_policy) * step_stretch[steps]
        slot[:, HBM] += terms["reads"] @ read_us_by_policy
        return fixed, slot

    def slot_work(
        self, scheduled: ArrayLike, computed: ArrayLike, prompt_len: ArrayLike
    ) -> SlotWork:
        """One step's NoOverlap split into its fixed part and each slot's own part."""
        n = len(np.asarray(scheduled))
        fixed, slot = self.slot_work_many(
            np.zeros(n, dtype=np.int64), scheduled, computed, prompt_len, 1
        )
        return SlotWork(fixed_us=fixed[0], slot_us=slot)


def deployment_for_pool(pool) -> Deployment:
    """The deployment a pools-file pool serves: chip = gpu_type, TP = gpus_per_replica."""
    chip = load_chip(pool.gpu_type)
    nodes = -(-pool.gpus_per_replica // chip.gpus_per_node)
    engine = pool.engine
    return Deployment(
        model=pool.model,
        chip=pool.gpu_type,
        dtype=pool.dtype,
        cache_dtype=pool.kv_cache_dtype,
        tp=pool.gpus_per_replica,
        nodes=nodes,
        cudagraph_mode=engine.cudagraph_mode,
        max_num_seqs=engine.max_num_seqs,
        decode_threshold=engine.decode_threshold,
        num_spec_tokens=engine.num_spec_tokens,
    )
