"""The pricing kernel: a deployment's step time on five resources, and each slot's share of it.

`Kernel.build` resolves a deployment's chip and model files once into a `Plan` (one entry per
layer kind); pricing a batch then touches only per-request arrays. Every entry point is
vectorised over many steps (a single step is the one-step case of the same code), so an hour of
step logs is priced in a few numpy passes.

These behaviours differ from the Go kernel by default ("physics"); `compat="go"` restores them:
routed-expert arithmetic is divided across the TP group (the Go kernel's own per-step
measurements favour this: per-step error 27.5% -> 23.0%), a sliding-window layer's decode
reads at most its window (the step-pricing spec says so; the swa rate was fitted on
window-bounded reads), four-bit weights without a four-bit peak compute at the bf16 rate
(`compute_lane`), a latent layer's prefill attention is priced at its expanded head widths, and
prefill attention runs at the bf16 ramp its work_scale was fitted against, at each request's own
query count (a varlen attention kernel's occupancy depends on the sequence, not on the step's
other tokens, which also keeps the price monotone in requests; under the Go kernel's single
eps(T), a decode row joining a long prefill chunk lowers it).

Both modes keep the Go kernel's one-kernel rule: a step holding decode and prefill rows of a
non-latent attention off Blackwell pays one floor, the larger. NoOverlap never drops when a
request joins, except by the host's graph saving when the step passes the capture ceiling, and
the floor moves from HBM to SM, so one resource (and Overlap) can.
Expert parallelism (with EPLB's redundant experts and the point-to-point dispatch backends) and
attention data parallelism feeding one MoE group are priced at the busiest rank, as the Go kernel
does; so are decode context parallelism on latent attention, sparse latent attention and its
indexer (DeepSeek-V3.2's DSA) and an nvfp4 KV cache. Not modelled: prefill context parallelism,
recurrent mixers, and speculative drafter passes
(speculation only sets the uniform-decode width and the capture ceiling).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from pricing import laws
from pricing.deployment import Deployment
from pricing.plan import WHOLE_CONTEXT, PlannedLayer, build_plan
from pricing.spec import (
    ChipSpec,
    MeasuredEngine,
    ModelSpec,
    PricingError,
    load_chip,
    load_model,
)

# Raised with every change to a law or to how the plan reads the data files, so a ledger priced
# before and after does not share a weights version (CHANGELOG.md records each).
LAWS_REVISION = 5
RESOURCES = ("sm", "hbm", "nvlink", "nic", "host")
SM, HBM, NVLINK, NIC, HOST = range(5)
FABRIC = {"nvlink": NVLINK, "nic": NIC}


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
    # "expert_sm_us", "expert_hbm_us", "stage_us"}; "head" -> {"repeat", "sm_us", "hbm_us"}
    per_kind: dict[str, dict[str, float]]


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
        names: np.ndarray = np.asarray(RESOURCES)[self.bottleneck]
        return names


@dataclass(frozen=True)
class SlotWork:
    """A step's NoOverlap split: `fixed_us` (5,) no single request caused, `slot_us` (n, 5) each
    slot's own work, per resource in RESOURCES order. fixed + slots == NoOverlap."""

    fixed_us: np.ndarray
    slot_us: np.ndarray


@dataclass(frozen=True)
class _SlotTerms:
    """Per-slot attention work and the per-step aggregates every price needs."""

    steps: np.ndarray  # (slots,) step of each slot
    tokens: np.ndarray  # (slots,) scheduled tokens
    reads: np.ndarray  # (slots, read bounds) cached tokens a decode row reads per layer
    pairs: np.ndarray  # (slots, key caps) prefill query-key pairs, stretched to eps_max (physics)
    step_tokens: np.ndarray  # (steps,)
    has_prefill: np.ndarray
    has_decode: np.ndarray
    uniform: np.ndarray  # a uniform decode (or empty) step: the decode graph mode
    step_reads: np.ndarray  # (steps, read bounds)
    step_pairs: np.ndarray  # (steps, key caps)


@dataclass(frozen=True)
class _Composed:
    totals: np.ndarray  # (steps, 5)
    overlap: np.ndarray
    nooverlap: np.ndarray
    bottleneck: np.ndarray
    stage: np.ndarray  # (steps, kinds)
    sm_dense: np.ndarray
    prefill_attention: np.ndarray
    hbm_dense: np.ndarray
    expert_sm: np.ndarray
    expert_hbm: np.ndarray
    nvlink: np.ndarray
    nic: np.ndarray
    head_sm: np.ndarray
    head_hbm: np.ndarray
    attention_efficiency: np.ndarray  # (steps, 1) the ramp prefill attention runs at


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


def _per_kind(layers: tuple[PlannedLayer, ...], value: Any, default: float = 0.0) -> np.ndarray:
    return np.array([default if v is None else v for v in map(value, layers)], dtype=np.float64)


class Kernel:
    """A deployment's pricing kernel; build with `Kernel.build(deployment)`."""

    def __init__(self, deployment: Deployment, chip: ChipSpec, model: ModelSpec) -> None:
        self.deployment = deployment
        self.chip = chip
        self.model = model
        self.plan = plan = build_plan(deployment, chip, model)
        layers = plan.layers
        self.kind_names = [layer.name for layer in layers]
        self.repeat = _per_kind(layers, lambda layer: layer.repeat)
        self.dense_flops = _per_kind(layers, lambda layer: layer.dense_flops_per_token)
        self.weight_bytes = _per_kind(layers, lambda layer: layer.weight_bytes)
        self.activation_bytes = _per_kind(layers, lambda layer: layer.activation_bytes_per_token)

        def expert(field: str, default: float) -> np.ndarray:
            return _per_kind(layers, lambda layer: getattr(layer.experts, field, None), default)

        self.expert_flops = expert("flops_per_token", 0.0)
        self.expert_bytes = expert("bytes_per_expert", 0.0)
        self.experts = expert("experts", 1.0)
        self.local_experts = expert("local_experts", 0.0)
        self.top_k = expert("top_k", 0.0)
        self.routed_tokens_per_token = expert("tokens_per_step_token", 1.0)

        def attention(field: str, default: float = 0.0) -> np.ndarray:
            return _per_kind(layers, lambda layer: getattr(layer.attention, field, None), default)

        self.has_attention = np.array([layer.attention is not None for layer in layers])
        self.decode_floor = attention("decode_floor_us")
        self.decode_rate = attention("decode_rate_bytes_per_us", 1.0)
        self.kv_layer_bytes = attention("kv_bytes_per_token")
        self.prefill_floor = attention("prefill_floor_us")
        self.q_heads = attention("q_heads")
        self.qk_dim = attention("qk_dim")
        self.v_dim = attention("v_dim")
        self.one_kernel_floor = np.array(
            [layer.attention is not None and layer.attention.one_kernel_floor for layer in layers]
        )
        # Layers sharing a read bound (or a prefill key cap) share one per-slot column.
        attentions = [layer.attention for layer in layers]
        indexers = [None if a is None else a.indexer for a in attentions]
        self.read_bounds = sorted(
            {a.read for a in attentions if a is not None}
            | ({WHOLE_CONTEXT} if any(indexers) else set()),
            key=lambda bound: repr(bound),
        )
        self.read_policy = np.array(
            [0 if a is None else self.read_bounds.index(a.read) for a in attentions]
        )
        self.keys_caps = sorted(
            {a.keys_cap for a in attentions if a is not None}
            | ({None} if any(indexers) else set()),
            key=lambda cap: cap or 0,
        )
        self.pair_policy = np.array(
            [0 if a is None else self.keys_caps.index(a.keys_cap) for a in attentions]
        )
        # the indexer scans every position, with every causal pair at prefill
        self.has_indexer = np.array([i is not None for i in indexers])
        self.indexed = bool(self.has_indexer.any())
        scan = self.read_bounds.index(WHOLE_CONTEXT) if any(indexers) else 0
        self.indexer_read_policy = np.full(len(layers), scan)
        self.indexer_pair_policy = np.full(
            len(layers), self.keys_caps.index(None) if any(indexers) else 0
        )

        def indexer(field: str, default: float = 0.0) -> np.ndarray:
            return np.array(
                [default if i is None else getattr(i, field) for i in indexers], dtype=np.float64
            )

        self.indexer_decode_floor = indexer("decode_floor_us")
        self.indexer_decode_rate = indexer("decode_rate_bytes_per_us", 1.0)
        self.indexer_bytes = indexer("cache_bytes_per_token")
        self.indexer_prefill_floor = indexer("prefill_floor_us")
        self.indexer_heads = indexer("heads")
        self.indexer_dim = indexer("head_dim")
        windows = [None if a is None else a.memory_window for a in attentions]
        windowed = np.array([w is not None for w in windows])
        self._kv_windows = np.array([w or 0 for w in windows], dtype=np.float64)
        # Whole replica: every rank holds its shard (or, for latent caches and an indexer's, a
        # full copy). Windowed layers hold at most their window per request, so they are not a
        # per-token rate.
        tp = deployment.tp
        # Under decode context parallelism each token is held by one rank of its group.
        held = (self.kv_layer_bytes + self.indexer_bytes) / deployment.decode_context_parallel
        self.kv_bytes_per_token = int(tp * (self.repeat * held)[~windowed].sum())
        self._kv_window_bytes = tp * self.repeat * self.kv_layer_bytes * windowed

        # Identical launches (the same op, width and message size in several layers) are priced
        # once per step; launch counts per fabric sum them into each kind.
        distinct = sorted({c for layer in layers for c in layer.collectives}, key=repr)
        self.collective_t0 = np.array([c.t0_us for c in distinct])
        self.collective_r_t = np.array([c.r_t_bytes_per_us for c in distinct])
        self.collective_r_peak = np.array([c.r_peak_bytes_per_us for c in distinct])
        self.collective_bytes_per_token = np.array([c.bytes_per_token for c in distinct])
        self._collective_launches = {
            resource: np.zeros((len(distinct), len(layers))) for resource in (NVLINK, NIC)
        }
        for kind, layer in enumerate(layers):
            for collective in layer.collectives:
                launches = self._collective_launches[FABRIC[collective.resource]]
                launches[distinct.index(collective), kind] += 1.0

        gemm = plan.gemm
        self.peak = gemm.peak_flops_per_us
        self.eps_max, self.m_half = gemm.ramp.eps_max, gemm.ramp.m_half
        self.head_flops = plan.head_flops_per_token
        self._bandwidth = chip.hbm_tb_s * 1e6  # TB/s = 1e6 bytes per microsecond
        self._derate = chip.gemm.hbm_derate
        self.head_hbm_us = float(
            laws.memory_time_us(plan.head_weight_bytes, self._bandwidth, self._derate)
        )
        # What the prices depend on: the laws' revision, the deployment and the exact bytes of
        # the chip and model files, so editing a coefficient or a shape changes the version.
        digest = hashlib.sha256(f"laws {LAWS_REVISION}\n".encode())
        digest.update(json.dumps(deployment.model_dump(mode="json"), sort_keys=True).encode())
        digest.update(f"{chip.digest} {model.digest}".encode())
        self.version = f"kernel-{deployment.model}-{deployment.chip}-tp{deployment.tp}-{digest.hexdigest()[:10]}"
        host = plan.host
        self.capture_ceiling = host.capture_ceiling
        self.kernels = host.kernels

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
        return np.asarray(ctx * self.kv_bytes_per_token + windowed)

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

    def _slot_terms(
        self, steps: np.ndarray, s: np.ndarray, c: np.ndarray, n_steps: int
    ) -> _SlotTerms:
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

        reads = np.empty((len(s), len(self.read_bounds)))
        step_reads = np.empty((n_steps, len(self.read_bounds)))
        for j, bound in enumerate(self.read_bounds):
            read = laws.decode_read_tokens(
                context,
                bound.kind,
                window=bound.window,
                top_k=bound.top_k,
                compress_ratio=bound.compress_ratio,
            )
            if bound.context_ranks > 1:
                read = laws.context_shard(read, bound.context_ranks)
            reads[:, j] = np.where(decode, read, 0.0)
            step_reads[:, j] = per_step(reads[:, j])
        # Prefill attention work in query-key pairs at eps_max: per request at its own ramp
        # (physics), or raw pairs the step's single ramp is applied to later (go). Only the
        # few prefill rows are computed.
        rows = np.flatnonzero(prefill)
        prefill_tokens = tokens[rows]
        ramp = self.plan.prefill_attention.ramp
        stretch = (
            (prefill_tokens + ramp.m_half) / prefill_tokens
            if self.plan.per_request_attention_ramp
            else 1.0
        )
        pairs = np.zeros((len(s), len(self.keys_caps)))
        step_pairs = np.empty((n_steps, len(self.keys_caps)))
        for j, cap in enumerate(self.keys_caps):
            pairs[rows, j] = laws.prefill_pairs(prefill_tokens, c[rows], cap) * stretch
            step_pairs[:, j] = per_step(pairs[rows, j], rows)
        return _SlotTerms(
            steps=steps,
            tokens=tokens,
            reads=reads,
            pairs=pairs,
            step_tokens=per_step(tokens),
            has_prefill=any_per_step(prefill),
            has_decode=any_per_step(decode),
            uniform=~any_per_step(s != self.plan.host.uniform_decode_tokens),
            step_reads=step_reads,
            step_pairs=step_pairs,
        )

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

    def _host_us(self, terms: _SlotTerms) -> np.ndarray:
        host = self.plan.host
        captured = np.where(
            terms.uniform, host.graph_us[host.decode_mode], host.graph_us[host.other_mode]
        )
        return laws.host_us(
            captured,
            host.graph_us["none"],
            terms.step_tokens,
            host.capture_ceiling,
            host.kernels,
            host.dispatch_per_kernel_us,
        )

    def _indexer_decode_us(self, reads: np.ndarray, floor_us: ArrayLike) -> np.ndarray:
        """A sparse layer's indexer scan at decode, (rows, kinds); zero on other layers."""
        scan: np.ndarray = self.has_indexer * laws.decode_attention_us(
            reads[:, self.indexer_read_policy],
            floor_us,
            self.indexer_bytes,
            self.indexer_decode_rate,
        )
        return scan

    def _indexer_prefill_us(
        self, pairs: np.ndarray, floor_us: ArrayLike, efficiency: np.ndarray
    ) -> np.ndarray:
        """A sparse layer's indexer scores at prefill: query-key logits only (no value
        product), its heads replicated on every rank; zero on other layers."""
        attention = self.plan.prefill_attention
        scores: np.ndarray = self.has_indexer * laws.prefill_attention_us(
            pairs[:, self.indexer_pair_policy],
            self.indexer_heads,
            self.indexer_dim,
            0.0,
            1,
            floor_us,
            attention.peak_flops_per_us,
            efficiency,
            self.plan.prefill_work_scale,
        )
        return scores

    # ------------------------------------------------------------------ pricing
    def _compose(self, terms: _SlotTerms) -> _Composed:
        T = terms.step_tokens
        active = (T > 0)[:, None]
        decode_floor, prefill_floor = self._floors(terms.has_prefill, terms.has_decode)
        sm_dense = laws.ramped_arithmetic_us(
            T[:, None], self.dense_flops[None, :], self.peak, self.eps_max, self.m_half
        )
        routed = T[:, None] * self.routed_tokens_per_token[None, :]
        expert_sm = laws.ramped_arithmetic_us(
            routed, self.expert_flops[None, :], self.peak, self.eps_max, self.m_half
        )
        attention = self.plan.prefill_attention
        if self.plan.per_request_attention_ramp:
            efficiency = np.full((len(T), 1), attention.ramp.eps_max)
        else:
            step_ramp = laws.ramp_efficiency(T, attention.ramp.eps_max, attention.ramp.m_half)
            efficiency = np.where(step_ramp > 0, step_ramp, 1.0)[:, None]
        prefill_attention = self.has_attention * laws.prefill_attention_us(
            terms.step_pairs[:, self.pair_policy],
            self.q_heads,
            self.qk_dim,
            self.v_dim,
            self.deployment.tp,
            prefill_floor,
            attention.peak_flops_per_us,
            efficiency,
            self.plan.prefill_work_scale,
        )
        if self.indexed:
            prefill_attention += self._indexer_prefill_us(
                terms.step_pairs,
                terms.has_prefill[:, None] * self.indexer_prefill_floor,
                efficiency,
            )
        weights_and_activations = laws.memory_time_us(
            self.weight_bytes[None, :] + T[:, None] * self.activation_bytes[None, :],
            self._bandwidth,
            self._derate,
        )
        decode_attention = laws.decode_attention_us(
            terms.step_reads[:, self.read_policy],
            decode_floor,
            self.kv_layer_bytes,
            self.decode_rate,
        )
        hbm_layer = weights_and_activations + decode_attention * self.has_attention
        if self.indexed:
            hbm_layer += self._indexer_decode_us(
                terms.step_reads, terms.has_decode[:, None] * self.indexer_decode_floor
            )
        hbm_dense = np.where(active, hbm_layer, 0.0)
        expert_hbm = laws.memory_time_us(
            self.expert_bytes[None, :]
            * laws.distinct_experts(routed, self.experts, self.top_k, self.local_experts),
            self._bandwidth,
            self._derate,
        )
        message = T[:, None] * self.collective_bytes_per_token[None, :]
        collectives = np.where(
            active,
            laws.collective_us(
                message, self.collective_t0, self.collective_r_t, self.collective_r_peak
            ),
            0.0,
        )
        nvlink = collectives @ self._collective_launches[NVLINK]
        nic = collectives @ self._collective_launches[NIC]
        head_sm = laws.ramped_arithmetic_us(
            T, self.head_flops, self.peak, self.eps_max, self.m_half
        )
        head_hbm = np.where(T > 0, self.head_hbm_us, 0.0)
        step = laws.compose_step(
            sm_dense,
            prefill_attention,
            hbm_dense,
            nvlink,
            nic,
            expert_sm,
            expert_hbm,
            self.repeat,
            head_sm,
            head_hbm,
            self._host_us(terms),
        )
        return _Composed(
            totals=step.totals,
            overlap=step.overlap,
            nooverlap=step.nooverlap,
            bottleneck=step.bottleneck,
            stage=step.stage,
            sm_dense=sm_dense,
            prefill_attention=prefill_attention,
            hbm_dense=hbm_dense,
            expert_sm=expert_sm,
            expert_hbm=expert_hbm,
            nvlink=nvlink,
            nic=nic,
            head_sm=head_sm,
            head_hbm=head_hbm,
            attention_efficiency=efficiency,
        )

    def price(self, scheduled: ArrayLike, computed: ArrayLike, prompt_len: ArrayLike) -> StepPrice:
        """Price one step; one entry per request in each array. A request is a prefill when it
        schedules more than the decode threshold, as the engine classes it; prompt_len is
        validated but does not change the price."""
        n = len(np.asarray(scheduled))
        steps, s, c = self._validate(
            np.zeros(n, dtype=np.int64), scheduled, computed, prompt_len, 1
        )
        composed = self._compose(self._slot_terms(steps, s, c, 1))
        totals = composed.totals[0]
        per_kind = {
            name: {
                "repeat": int(self.repeat[k]),
                "sm_us": float(composed.sm_dense[0, k] + composed.prefill_attention[0, k]),
                "hbm_us": float(composed.hbm_dense[0, k]),
                "nvlink_us": float(composed.nvlink[0, k]),
                "nic_us": float(composed.nic[0, k]),
                "expert_sm_us": float(composed.expert_sm[0, k]),
                "expert_hbm_us": float(composed.expert_hbm[0, k]),
                "stage_us": float(composed.stage[0, k]),
            }
            for k, name in enumerate(self.kind_names)
        }
        per_kind["head"] = {
            "repeat": 1,
            "sm_us": float(composed.head_sm[0]),
            "hbm_us": float(composed.head_hbm[0]),
        }
        return StepPrice(
            sm_us=float(totals[SM]),
            hbm_us=float(totals[HBM]),
            nvlink_us=float(totals[NVLINK]),
            nic_us=float(totals[NIC]),
            host_us=float(totals[HOST]),
            overlap_us=float(composed.overlap[0]),
            nooverlap_us=float(composed.nooverlap[0]),
            bottleneck=RESOURCES[int(composed.bottleneck[0])],
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
        totals = composed.totals
        return StepPrices(
            sm_us=totals[:, SM],
            hbm_us=totals[:, HBM],
            nvlink_us=totals[:, NVLINK],
            nic_us=totals[:, NIC],
            host_us=totals[:, HOST],
            overlap_us=composed.overlap,
            nooverlap_us=composed.nooverlap,
            bottleneck=composed.bottleneck.astype(np.int8),
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

        The step's resource totals are the composed price. A slot's own part is the same laws
        evaluated on that slot's quantities alone, without the terms no single request causes:
        its tokens' GEMM arithmetic at eps_max (T / eps(T) = (T + m_half) / eps_max, so the
        m_half overhead is the fixed part), its attention pairs (at its own ramp, or the step's
        under compat "go") without the floor, its activations, its context read without the
        floor, the distinct experts' reads in proportion to its tokens, and its collective bytes
        at the rate in force for the step's message (each launch's t0 is fixed). Fixed is what
        remains: weights and the head read once, attention floors, host, collective t0s and the
        ramp overheads. Per step, fixed + slots == NoOverlap.
        """
        steps, s, c = self._validate(step_index, scheduled, computed, prompt_len, n_steps)
        terms = self._slot_terms(steps, s, c, n_steps)
        composed = self._compose(terms)
        repeat, tokens = self.repeat, terms.tokens
        slot = np.zeros((len(tokens), 5))

        gemm_flops = float(
            (self.dense_flops + self.routed_tokens_per_token * self.expert_flops) @ repeat
            + self.head_flops
        )
        slot[:, SM] = laws.ramped_arithmetic_us(tokens, gemm_flops, self.peak, self.eps_max, 0.0)
        rows = np.flatnonzero(terms.pairs.any(axis=1))
        attention = self.plan.prefill_attention
        slot[rows, SM] += (
            self.has_attention
            * laws.prefill_attention_us(
                terms.pairs[rows][:, self.pair_policy],
                self.q_heads,
                self.qk_dim,
                self.v_dim,
                self.deployment.tp,
                0.0,
                attention.peak_flops_per_us,
                composed.attention_efficiency[steps[rows]],
                self.plan.prefill_work_scale,
            )
        ) @ repeat
        if self.indexed:
            slot[rows, SM] += (
                self._indexer_prefill_us(
                    terms.pairs[rows], 0.0, composed.attention_efficiency[steps[rows]]
                )
                @ repeat
            )

        step_expert_hbm = composed.expert_hbm @ repeat
        expert_share = step_expert_hbm / np.maximum(terms.step_tokens, 1.0)
        slot[:, HBM] = (
            laws.memory_time_us(
                tokens * float(self.activation_bytes @ repeat), self._bandwidth, self._derate
            )
            + tokens * expert_share[steps]
            + (
                self.has_attention
                * laws.decode_attention_us(
                    terms.reads[:, self.read_policy], 0.0, self.kv_layer_bytes, self.decode_rate
                )
            )
            @ repeat
        )
        if self.indexed:
            slot[:, HBM] += self._indexer_decode_us(terms.reads, 0.0) @ repeat
        rate = laws.collective_rate_in_force(
            terms.step_tokens[:, None] * self.collective_bytes_per_token[None, :],
            self.collective_t0,
            self.collective_r_t,
            self.collective_r_peak,
        )[steps]
        for resource in (NVLINK, NIC):
            launches = self._collective_launches[resource] @ repeat
            slot[:, resource] = (
                tokens[:, None] * self.collective_bytes_per_token[None, :] / rate
            ) @ launches

        caused = np.stack(
            [np.bincount(steps, weights=slot[:, r], minlength=n_steps) for r in range(5)], axis=1
        )
        # Where nothing is fixed (a collective at its peak rate) the difference is rounding.
        return np.maximum(composed.totals - caused, 0.0), slot

    def slot_work(
        self, scheduled: ArrayLike, computed: ArrayLike, prompt_len: ArrayLike
    ) -> SlotWork:
        """One step's NoOverlap split into its fixed part and each slot's own part."""
        n = len(np.asarray(scheduled))
        fixed, slot = self.slot_work_many(
            np.zeros(n, dtype=np.int64), scheduled, computed, prompt_len, 1
        )
        return SlotWork(fixed_us=fixed[0], slot_us=slot)
