"""The pricing kernel: a deployment's step time on five resources, and each slot's share of it.

`Kernel.build` resolves a deployment's chip and model files once into a `Plan` (one entry per
layer kind); pricing a batch then touches only per-request arrays. `price_many` and
`slot_work_many` are vectorised over many steps, so an hour of step logs is priced in a few numpy
passes; `price`, the live path's one step at a time, runs the same laws in one compiled pass
(`pricing.single_step`), a few microseconds a step.

The default mode ("physics") departs from the Go kernel where the Go law is not what the
hardware does; `compat="go"` reproduces the Go kernel term for term on both shared reference
grids. `docs/pricing-kernel.md` lists every departure, with its physical reason and its size on
a named step, in one table.

Expert parallelism (with EPLB's redundant experts and the point-to-point dispatch backends) and
attention data parallelism feeding one MoE group are priced at the busiest rank; so are decode
context parallelism on latent attention, sparse latent attention and its indexer (DeepSeek-V3.2's
DSA), an nvfp4 KV cache, prefill context parallelism, rack-scale NVLink domains and reduced SM
budgets. Recurrent mixers are priced from their shapes (`PlannedRecurrent`
says what is assumed), or under compat "go" from the Go kernel's registry
(`pricing/registry/recurrent.yaml`). Two laws of the step-pricing spec the Go kernel lacks apply
in both modes where the model or deployment uses them: DeepSeek-V4.1's mHC hyper-connections at
the chip's measured form, and a parallel-block drafter's (DSpark's) own CUDA graphs and capture
ceiling. NoOverlap never drops when a request joins, except by the
host's graph saving when the step passes the capture ceiling, and the one-kernel rule moving a
floor from HBM to SM, so one resource (and Overlap) can.

Every per-layer term but the routed experts' reads, the collectives and (by default) the dense
GEMMs, each the larger of its arithmetic and its weight read, is linear in a few per-step features (tokens, rows, the flags that decide which floors a step pays, cached tokens
read per read bound, prefill pairs per key cap), so `Kernel.build` evaluates the laws once into
one coefficient matrix and a batch is priced by one matrix product; a slot's own work is the
same product over its own features with the fixed ones (flags, the ramp overheads) at zero.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from pricing import laws, single_step
from pricing.deployment import Deployment
from pricing.plan import (
    MeasuredRecurrent,
    PlannedAttention,
    PlannedCollective,
    PlannedHyperConnections,
    PlannedLayer,
    build_plan,
)
from pricing.spec import (
    ChipSpec,
    MeasuredEngine,
    ModelSpec,
    PricingError,
    load_chip,
    load_model,
    load_recurrent_registry,
)

# Raised with every change to a law or to how the plan reads the data files, so a ledger priced
# before and after does not share a weights version (CHANGELOG.md records each).
LAWS_REVISION = 9
RESOURCES = ("sm", "hbm", "nvlink", "nic", "host")
# Deployment fields added since LAWS_REVISION 6 whose default (None) changes no price.
ADDED_DEPLOYMENT_FIELDS = ("drafter",)
SM, HBM, NVLINK, NIC, HOST = range(5)
# A collective's fabric: its row in a kind's (NVLink, NIC) launch counts.
FABRIC = {"nvlink": 0, "nic": 1}
# The features the linear terms are priced on, per step and per slot: whether the step runs
# tokens, its tokens, whether it holds decode rows, prefill rows, both; its rows, its prefill
# tokens; then cached tokens read per read bound and prefill pairs per key cap. A slot's own
# features leave the flags at zero: what they buy (weights, floors, ramp overheads) is fixed.
ACTIVE, TOKENS, DECODING, PREFILLING, MIXED, ROWS, PREFILL_TOKENS, DECODE_TOKENS = range(8)
FLAG_FEATURES = 8
# The step feature a collective's message grows with (`PlannedCollective.rows`).
COLLECTIVE_ROWS = {
    "tokens": TOKENS,
    "decode_tokens": DECODE_TOKENS,
    "prefill_tokens": PREFILL_TOKENS,
}
# One layer's linear terms per kind: dense GEMMs (SM), prefill attention and scans (SM), reads
# (HBM), routed experts' arithmetic (SM).
GEMM, ATTENTION, READ, EXPERT = range(4)


@dataclass(frozen=True)
class StepPrice:
    """One step's price: per-resource totals, both step-time estimates and each layer kind's share."""

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
        """Each step's bottleneck as its resource name."""
        names: np.ndarray = np.asarray(RESOURCES)[self.bottleneck]
        return names


class Slots(NamedTuple):
    """A batch of slots, one entry per slot in each array: the step it is in (0..n_steps-1),
    the tokens it schedules, the tokens computed before them (its context) and its prompt's
    length."""

    step_index: ArrayLike
    scheduled: ArrayLike
    computed: ArrayLike
    prompt_len: ArrayLike


@dataclass(frozen=True)
class SlotWork:
    """A step's NoOverlap split: `fixed_us` (5,) no single request caused, `slot_us` (n, 5) each
    slot's own work, per resource in RESOURCES order. fixed + slots == NoOverlap."""

    fixed_us: np.ndarray
    slot_us: np.ndarray


@dataclass(frozen=True)
class _Features:
    """A batch's per-step features and the per-slot quantities they sum."""

    steps: np.ndarray  # (slots,) step of each slot
    tokens: np.ndarray  # (slots,) scheduled tokens
    live: np.ndarray  # (slots,) the slot schedules tokens (a row of the step)
    reads: np.ndarray  # (slots, read bounds) cached tokens a decode row reads per layer
    prefill_rows: np.ndarray  # slots that are prefill rows
    pairs: np.ndarray  # (prefill rows, key caps) query-key pairs over the ramp they run at
    step: np.ndarray  # (features, steps)
    uniform: np.ndarray  # (steps,) a uniform decode (or empty) step: the decode graph mode
    decode: np.ndarray  # (slots,) the slot is a decode row
    computed: np.ndarray  # (slots,) tokens computed before the slot's

    def context_gather_us(self, gather: PlannedCollective, chunk: int) -> np.ndarray:
        """Per step, one latent layer's all-gathers of its prefills' cached context under
        decode context parallelism (the Go kernel's law, vLLM's MLA chunked context): the
        engine runs prefills in ascending scheduled tokens; consecutive ones with a cached
        prefix share gathers of `chunk` context tokens each, a prefill without one ends the
        run; a run of S context tokens pays ceil(S / chunk) gathers of S / that many rows."""
        n_steps = self.step.shape[1]
        gathered = np.zeros(n_steps)
        rows = self.prefill_rows
        order = rows[np.lexsort((self.tokens[rows], self.steps[rows]))]
        runs: list[tuple[int, int]] = []  # (step, context tokens)
        current_step, run = -1, 0
        for row in order:
            step, prefix = int(self.steps[row]), int(self.computed[row])
            if step != current_step or prefix <= 0:
                runs.append((current_step, run))
                current_step, run = step, 0
            run += max(prefix, 0)
        runs.append((current_step, run))
        for step, context in runs:
            if context <= 0:
                continue
            launches = -(-context // chunk)
            gathered[step] += launches * float(
                laws.collective_us(
                    context * gather.bytes_per_token / launches,
                    gather.t0_us,
                    gather.r_t_bytes_per_us,
                    gather.r_peak_bytes_per_us,
                )
            )
        return gathered

    def own(self, coefficients: np.ndarray, reads_at: int, pairs_at: int) -> np.ndarray:
        """Each slot's own features times `coefficients` (features, m): the flags stay zero."""
        rows = self.prefill_rows
        own: np.ndarray = (
            self.tokens[:, None] * coefficients[TOKENS]
            + self.live[:, None] * coefficients[ROWS]
            + self.reads @ coefficients[reads_at:pairs_at]
        )
        own[rows] += (
            self.tokens[rows, None] * coefficients[PREFILL_TOKENS]
            + self.pairs @ coefficients[pairs_at:]
        )
        return own


@dataclass(frozen=True)
class _Composed:
    """Steps on the last axis (`laws.compose_step`)."""

    step: laws.ComposedStep
    layer: np.ndarray  # (4, kinds, steps) SM, HBM, NVLink, NIC of one layer, experts apart
    expert: np.ndarray  # (2, kinds, steps) the routed experts' SM and HBM
    head: np.ndarray  # (2, steps)
    gemm_on_sm: np.ndarray  # (GEMM parts, steps) the part's arithmetic binds (else its read)


def _plain_counts(array: np.ndarray) -> bool:
    """Already the int64 vector the kernel prices (its values are checked apart)."""
    return array.ndim == 1 and array.dtype == np.int64


def _as_counts(name: str, values: ArrayLike) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise PricingError(f"{name} must be one-dimensional, got shape {array.shape}")
    kind = array.dtype.kind  # integers "i"/"u", floats "f"
    if (
        array.size
        and kind not in "iu"
        and (
            kind != "f"
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
        """Plan `model` served as `deployment` on `chip` and evaluate the laws' coefficients."""
        self.deployment = deployment
        self.chip = chip
        self.model = model
        self.plan = plan = build_plan(deployment, chip, model)
        layers = plan.layers
        self.kind_names = [layer.name for layer in layers]
        self.repeat = np.array([layer.repeat for layer in layers], dtype=np.float64)
        self._repeat_counts = [layer.repeat for layer in layers]
        attentions = [layer.attention for layer in layers]
        scans = {a.indexer.read for a in attentions if a is not None and a.indexer is not None}
        # Layers sharing a read bound (or a prefill key cap) share one feature; an indexer scans
        # the whole context, with every causal pair at prefill.
        self.read_bounds = sorted(
            {a.read for a in attentions if a is not None} | scans,
            key=repr,
        )
        self.keys_caps = sorted(
            {a.keys_cap for a in attentions if a is not None} | ({None} if scans else set()),
            key=lambda cap: cap or 0,
        )
        self._reads_at = FLAG_FEATURES
        self._pairs_at = FLAG_FEATURES + len(self.read_bounds)
        self._features_count = self._pairs_at + len(self.keys_caps)
        self._bandwidth = chip.hbm_tb_s * 1e6  # TB/s = 1e6 bytes per microsecond
        self._derate = chip.gemm.hbm_derate

        self._linear_terms(layers)
        self._expert_terms(layers)
        self._collective_terms(layers)
        self._kv_memory(deployment, attentions)
        # Whole replica: one state per request on every layer with a recurrent mixer, each rank
        # holding its heads' share, whatever the context.
        self.state_bytes_per_request = int(
            deployment.tp
            * sum(
                layer.repeat * layer.recurrent.state_bytes
                for layer in layers
                if layer.recurrent is not None
            )
        )
        self.version = self._version()
        self.capture_ceiling = plan.host.capture_ceiling
        self.kernels = plan.host.kernels
        self._single = self._step_constants()

    def _gemm_us(self, flops_per_token: float) -> float:
        """One token's arithmetic at eps_max on the GEMM lane (the ramp's m_half apart)."""
        gemm = self.plan.gemm
        return float(
            laws.ramped_arithmetic_us(
                1.0, flops_per_token, gemm.peak_flops_per_us, gemm.ramp.eps_max, 0.0
            )
        )

    def _read_us(self, nbytes: float) -> float:
        return float(laws.memory_time_us(nbytes, self._bandwidth, self._derate))

    def _linear_terms(self, layers: tuple[PlannedLayer, ...]) -> None:
        """The terms linear in the step's features: per kind, then the head's."""
        kinds, m_half = len(layers), self.plan.gemm.ramp.m_half
        gemm_us, read_us = self._gemm_us, self._read_us
        # T / eps(T) = (T + m_half) / eps_max: a step with tokens pays m_half tokens' more work.
        coef = np.zeros((self._features_count, 4, kinds))
        # Under `plan.gemm_time_once` the dense GEMMs are not linear (`laws.gemm_kernel_us`): each
        # weight width's GEMMs of a kind are one part, (kind, per token, overhead, read) in
        # microseconds, the head's at kind = kinds.
        once = self.plan.gemm_time_once
        parts: list[tuple[float, float, float, float]] = []
        for k, layer in enumerate(layers):
            coef[ACTIVE, READ, k] = float(
                laws.memory_op_latency_us(layer.memory_ops, self.chip.gemm.hbm_constant_latency_us)
            )
            if once:
                parts += [
                    (
                        k,
                        gemm_us(g.flops_per_token),
                        gemm_us(g.flops_per_token) * m_half,
                        read_us(g.weight_bytes),
                    )
                    for g in layer.gemms
                ]
            else:
                coef[TOKENS, GEMM, k] = gemm_us(layer.dense_flops_per_token)
                coef[ACTIVE, GEMM, k] = gemm_us(layer.dense_flops_per_token) * m_half
                coef[ACTIVE, READ, k] += read_us(layer.weight_bytes)
            coef[TOKENS, READ, k] = read_us(layer.activation_bytes_per_token)
            if layer.experts is not None:
                routed = gemm_us(layer.experts.flops_per_token)
                coef[TOKENS, EXPERT, k] = routed * layer.experts.tokens_per_step_token
                coef[ACTIVE, EXPERT, k] = routed * m_half * layer.experts.ramp_overhead_tokens
            if layer.attention is not None:
                self._attention_terms(coef[:, :, k], layer.attention)
            if layer.recurrent is not None:
                self._recurrent_terms(coef[:, :, k], layer)
            if layer.hyper_connections is not None:
                self._hyper_connection_terms(coef[:, :, k], layer.hyper_connections)
        head = np.zeros((self._features_count, 2))
        head_us = gemm_us(self.plan.head_flops_per_token)
        head_read_us = read_us(self.plan.head_weight_bytes)
        if once:
            parts.append((kinds, head_us, head_us * m_half, head_read_us))
        else:
            head[TOKENS, 0] = head_us
            head[ACTIVE, 0] = head_us * m_half
            head[ACTIVE, 1] = head_read_us
        # On a reduced SM budget every arithmetic term slows (GEMMs, experts, the head, prefill
        # attention's pairs, a recurrent scan); floors, reads and measured mixers do not.
        derate = laws.sm_derate(self.chip.sm_count, self.deployment.sm_budget)
        coef[:, GEMM] *= derate
        coef[:, EXPERT] *= derate
        coef[self._pairs_at :, ATTENTION] *= derate
        coef[PREFILL_TOKENS, ATTENTION] *= derate
        head[:, 0] *= derate
        self._gemm_parts = np.array(parts, dtype=np.float64).reshape(len(parts), 4)
        self._gemm_parts[:, 1:3] *= derate
        gemm_kinds = self._gemm_parts[:, 0].astype(np.intp)
        # (kinds + 1, parts): which kind (or the head, last) each part's time adds to
        self._gemm_kinds = (np.arange(kinds + 1)[:, None] == gemm_kinds).astype(np.float64)
        self._gemm_repeat = np.append(self.repeat, 1.0)[gemm_kinds]
        # (outputs, features): the per-kind terms in (block, kind) order, then the head's two
        self._linear = np.concatenate([coef.reshape(len(coef), 4 * kinds), head], axis=1).T
        # A slot's own SM and HBM work over the whole model (its expert reads and collectives
        # are split apart).
        self._own = np.stack(
            [
                (coef[:, GEMM] + coef[:, ATTENTION] + coef[:, EXPERT]) @ self.repeat + head[:, 0],
                coef[:, READ] @ self.repeat + head[:, 1],
            ],
            axis=1,
        )

    def _expert_terms(self, layers: tuple[PlannedLayer, ...]) -> None:
        """Per kind, what the distinct experts' reads (`laws.distinct_experts`) are priced on."""
        experts = [layer.experts for layer in layers]
        self._routed = np.array([1.0 if e is None else e.tokens_per_step_token for e in experts])
        self._miss = laws.expert_miss_probability(
            [1 if e is None else e.coverage_experts for e in experts],
            [0 if e is None else e.top_k for e in experts],
        )
        self._local_experts = np.array([0.0 if e is None else e.local_experts for e in experts])
        self._busiest_of = np.array([1 if e is None else e.busiest_of for e in experts])
        self._expert_us = np.array(
            [0.0 if e is None else self._read_us(e.bytes_per_expert) for e in experts]
        )
        self._has_experts = any(e is not None for e in experts)

    def _collective_terms(self, layers: tuple[PlannedLayer, ...]) -> None:
        """The distinct collective launches and how many of each every kind makes per fabric."""
        kinds = len(layers)
        # Identical launches (the same op, width and message size in several layers) are priced
        # once per step; launch counts per fabric and kind sum them into each kind.
        distinct = sorted({c for layer in layers for c in layer.collectives}, key=repr)
        self._collective_t0 = np.array([c.t0_us for c in distinct])
        self._collective_r_t = np.array([c.r_t_bytes_per_us for c in distinct])
        self._collective_r_peak = np.array([c.r_peak_bytes_per_us for c in distinct])
        self._collective_bytes = np.array([c.bytes_per_token for c in distinct])
        self._collective_rows = np.array([COLLECTIVE_ROWS[c.rows] for c in distinct], dtype=np.intp)
        # Kinds whose prefills all-gather their cached context (decode context parallelism).
        self._context_gathers = [
            (k, layer.context_gather)
            for k, layer in enumerate(layers)
            if layer.context_gather is not None
        ]
        launches = np.zeros((len(distinct), 2, kinds))
        for k, layer in enumerate(layers):
            for collective in layer.collectives:
                launches[distinct.index(collective), FABRIC[collective.resource], k] += 1.0
        self._launches = launches
        self._fabric_launches = launches.transpose(1, 2, 0).reshape(2 * kinds, len(distinct))

    def _version(self) -> str:
        """What the prices depend on: the laws' revision, the deployment and the exact bytes of
        the chip and model files (and, under compat "go", the recurrent registry's), so editing
        a coefficient or a shape changes the version."""
        deployment = self.deployment
        digest = hashlib.sha256(f"laws {LAWS_REVISION}\n".encode())
        # A field added after ledgers were priced leaves their version as it was at its default.
        unset = {name for name in ADDED_DEPLOYMENT_FIELDS if getattr(deployment, name) is None}
        stated = deployment.model_dump(mode="json", exclude=unset)
        digest.update(json.dumps(stated, sort_keys=True).encode())
        digest.update(f"{self.chip.digest} {self.model.digest}".encode())
        if deployment.compat == "go":
            digest.update(load_recurrent_registry().digest.encode())
        return (
            f"kernel-{deployment.model}-{deployment.chip}-tp{deployment.tp}-"
            f"{digest.hexdigest()[:10]}"
        )

    def _step_constants(self) -> single_step.StepConstants:
        """This kernel's constants in the layout the one-step pass reads."""
        plan, none = self.plan, -1.0
        host = plan.host
        return single_step.StepConstants(
            decode_threshold=self.deployment.decode_threshold,
            bounds=np.array(
                [
                    [
                        1.0 if b.kind == "sparse_mla" else 0.0,
                        none if b.window is None else b.window,
                        none if b.top_k is None else b.top_k,
                        none if b.compress_ratio is None else b.compress_ratio,
                        b.context_ranks,
                    ]
                    for b in self.read_bounds
                ],
                dtype=np.float64,
            ).reshape(len(self.read_bounds), 5),
            caps=np.array([none if cap is None else cap for cap in self.keys_caps], dtype=float),
            prefill_ramp=np.array(
                [
                    plan.prefill_attention.ramp.eps_max,
                    plan.prefill_attention.ramp.m_half,
                    1.0 if plan.per_request_attention_ramp else 0.0,
                ]
            ),
            reads_at=self._reads_at,
            pairs_at=self._pairs_at,
            linear=np.ascontiguousarray(self._linear),
            repeat=self.repeat,
            collectives=np.column_stack(
                [
                    self._collective_bytes,
                    self._collective_t0,
                    self._collective_r_t,
                    self._collective_r_peak,
                    self._collective_rows.astype(np.float64),
                ]
            ).reshape(len(self._collective_bytes), 5),
            fabric_launches=np.ascontiguousarray(self._fabric_launches),
            gemm_parts=self._gemm_parts,
            experts=np.column_stack(
                [
                    self._routed,
                    self._miss,
                    self._local_experts,
                    self._expert_us,
                    self._busiest_of.astype(np.float64),
                ]
            ),
            host=np.array(
                [
                    host.graph_us[host.decode_mode],
                    host.graph_us[host.other_mode],
                    host.graph_us["none"],
                    host.capture_ceiling,
                    host.kernels,
                    host.dispatch_per_kernel_us,
                    host.uniform_decode_tokens,
                    host.drafter.ceiling_rows,
                    host.drafter.replay_us,
                    host.drafter.eager_us,
                    host.drafter.store_us,
                ]
            ),
        )

    def _recurrent_terms(self, coef: np.ndarray, layer: PlannedLayer) -> None:
        """One recurrent layer's linear terms, (features, 4) of its kind."""
        recurrent = layer.recurrent
        if isinstance(recurrent, MeasuredRecurrent):
            coef[ACTIVE, ATTENTION] += recurrent.floor_us
            coef[TOKENS, ATTENTION] += recurrent.us_per_token
            return
        assert recurrent is not None
        # each row reads its request's state and writes it back
        coef[ROWS, READ] = laws.memory_time_us(
            2.0 * recurrent.state_bytes, self._bandwidth, self._derate
        )
        coef[DECODING, READ] += recurrent.decode_floor_us
        coef[PREFILLING, ATTENTION] += recurrent.prefill_floor_us
        coef[PREFILL_TOKENS, ATTENTION] = laws.scan_us(
            1.0,
            recurrent.scan_flops_per_token,
            recurrent.scan.peak_flops_per_us,
            recurrent.scan.ramp.eps_max,
            recurrent.scan_work_scale,
        )

    @staticmethod
    def _hyper_connection_terms(coef: np.ndarray, mixes: PlannedHyperConnections) -> None:
        """One layer's measured mHC hyper-connections, (features, 4) of its kind: memory-bound
        kernels, on HBM; the fixed cost is paid once per step with tokens."""
        coef[ACTIVE, READ] += mixes.count * mixes.floor_us
        coef[TOKENS, READ] += mixes.count * float(
            laws.hyper_connection_us(
                1.0,
                0.0,
                mixes.stream_bytes_per_token,
                mixes.pre_rate_bytes_per_us,
                mixes.post_rate_bytes_per_us,
            )
        )

    def _attention_terms(self, coef: np.ndarray, attention: PlannedAttention) -> None:
        """One attention layer's linear terms, (features, 4) of its kind."""
        lane = self.plan.prefill_attention
        decode_floor, prefill_floor = attention.decode_floor_us, attention.prefill_floor_us
        coef[DECODING, READ] += decode_floor
        coef[PREFILLING, ATTENTION] += prefill_floor
        if attention.one_kernel_floor:
            # decode and prefill rows run in one kernel: a step holding both pays the larger floor
            if prefill_floor > decode_floor:
                coef[MIXED, READ] -= decode_floor
            else:
                coef[MIXED, ATTENTION] -= prefill_floor
        reads = self._reads_at + self.read_bounds.index(attention.read)
        coef[reads, READ] += laws.decode_attention_us(
            1.0, 0.0, attention.kv_bytes_per_token, attention.decode_rate_bytes_per_us
        )
        pairs = self._pairs_at + self.keys_caps.index(attention.keys_cap)
        coef[pairs, ATTENTION] += laws.prefill_attention_us(
            1.0,
            attention.q_heads,
            attention.qk_dim,
            attention.v_dim,
            self.deployment.tp,
            0.0,
            lane.peak_flops_per_us,
            1.0,
            self.plan.prefill_work_scale,
        )
        indexer = attention.indexer
        if indexer is None:
            return
        coef[DECODING, READ] += indexer.decode_floor_us
        coef[PREFILLING, ATTENTION] += indexer.prefill_floor_us
        scan = self._reads_at + self.read_bounds.index(indexer.read)
        coef[scan, READ] += laws.decode_attention_us(
            1.0, 0.0, indexer.cache_bytes_per_token, indexer.decode_rate_bytes_per_us
        )
        if not indexer.scores_prefill:
            return
        # query-key logits only (no value product), its heads replicated on every rank
        causal = self._pairs_at + self.keys_caps.index(None)
        coef[causal, ATTENTION] += laws.prefill_attention_us(
            1.0,
            indexer.heads,
            indexer.head_dim,
            0.0,
            1,
            0.0,
            lane.peak_flops_per_us,
            1.0,
            self.plan.prefill_work_scale,
        )

    def _kv_memory(self, deployment: Deployment, attentions: list[PlannedAttention | None]) -> None:
        """Whole replica: every rank holds its shard (or, for latent caches and an indexer's, a
        full copy); under decode context parallelism each token is held by one rank of its
        group. Windowed layers hold at most their window per request, so they are not a
        per-token rate; recurrent layers hold no KV at all."""
        tp, repeat = deployment.tp, self.repeat
        per_layer = np.array(
            [
                0.0
                if a is None
                else a.kv_bytes_per_token
                + (0.0 if a.indexer is None else a.indexer.cache_bytes_per_token)
                for a in attentions
            ]
        )
        windows = np.array(
            [0.0 if a is None or a.memory_window is None else a.memory_window for a in attentions]
        )
        windowed = windows > 0
        held = per_layer / deployment.decode_context_parallel
        self.kv_bytes_per_token = int(tp * (repeat * held)[~windowed].sum())
        self._kv_windows = windows
        kv_only = np.array([0.0 if a is None else a.kv_bytes_per_token for a in attentions])
        self._kv_window_bytes = tp * repeat * kv_only * windowed

    @classmethod
    def build(cls, deployment: Deployment) -> Kernel:
        """The kernel of `deployment`, its chip and model read from `pricing/chips/` and `pricing/models/`."""
        return cls(deployment, load_chip(deployment.chip), load_model(deployment.model))

    @property
    def measured_engine(self) -> MeasuredEngine:
        """The engine release the chip's coefficients were measured on (the calibration check
        compares the versions in a pool's log against it)."""
        return self.chip.measured_engine

    # ------------------------------------------------------------------ memory
    def kv_bytes(self, context_tokens: ArrayLike) -> np.ndarray:
        """Whole-replica KV bytes held by requests with these contexts: every token on full and
        latent layers, at most the window on windowed layers (their blocks are freed behind it).
        A recurrent layer's state is per request, `state_bytes_per_request`, not KV."""
        ctx = _as_counts("context_tokens", context_tokens).astype(np.float64)
        windowed = np.minimum(ctx[:, None], self._kv_windows[None, :]) @ self._kv_window_bytes
        return np.asarray(ctx * self.kv_bytes_per_token + windowed)

    # ------------------------------------------------------------------ features
    @staticmethod
    def _checked(slots: Slots, n_steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A batch's step index, scheduled and computed tokens, every array checked."""
        steps, s, c, prompt = (
            _as_counts(name, values) for name, values in zip(Slots._fields, slots, strict=True)
        )
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

    def _features(self, slots: Slots, n_steps: int) -> _Features:
        """Checks a batch's per-slot arrays and derives its features."""
        steps, s, c = self._checked(slots, n_steps)
        tokens = s.astype(np.float64)
        prefill = s > self.deployment.decode_threshold
        decode = (s > 0) & ~prefill
        rows = np.flatnonzero(prefill)
        split_pairs = self._split_prefills(tokens, s, c, rows)

        def per_step(values: np.ndarray, where: np.ndarray | slice = slice(None)) -> np.ndarray:
            if n_steps == 1:
                return np.asarray(values.sum(axis=0, keepdims=True))
            return np.bincount(steps[where], weights=values, minlength=n_steps)

        def any_per_step(flags: np.ndarray) -> np.ndarray:
            if n_steps == 1:
                return np.array([flags.any()])
            marked = np.zeros(n_steps, dtype=bool)
            marked[steps[flags]] = True
            return marked

        live = s > 0
        step = np.zeros((self._features_count, n_steps))
        step[TOKENS] = per_step(tokens)
        step[ROWS] = per_step(live.astype(np.float64))
        step[PREFILL_TOKENS] = per_step(tokens[rows], rows)
        step[DECODE_TOKENS] = per_step(np.where(decode, tokens, 0.0))
        context = (c + s).astype(np.float64)
        # column-major: each bound's reads are written and summed as one contiguous column
        reads = np.empty((len(s), len(self.read_bounds)), order="F")
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
            step[self._reads_at + j] = per_step(reads[:, j])
        # Prefill attention work in query-key pairs over the ramp it runs at: each request's own
        # (physics), or the step's single one (go). Only the few prefill rows are computed.
        pairs = np.empty((len(rows), len(self.keys_caps)))
        if len(rows):
            ramp = self.plan.prefill_attention.ramp
            if self.plan.per_request_attention_ramp:
                scale = 1.0 / laws.ramp_efficiency(tokens[rows], ramp.eps_max, ramp.m_half)
            else:
                step_ramp = laws.ramp_efficiency(step[TOKENS], ramp.eps_max, ramp.m_half)
                scale = 1.0 / step_ramp[steps[rows]]
            for j, cap in enumerate(self.keys_caps):
                raw = (
                    laws.prefill_pairs(tokens[rows], c[rows], cap)
                    if split_pairs is None
                    else split_pairs[:, j]
                )
                pairs[:, j] = raw * scale
                step[self._pairs_at + j] = per_step(pairs[:, j], rows)
        has_decode, has_prefill = any_per_step(decode), any_per_step(prefill)
        step[ACTIVE] = step[TOKENS] > 0
        step[DECODING] = has_decode
        step[PREFILLING] = has_prefill
        step[MIXED] = has_decode & has_prefill
        return _Features(
            steps=steps,
            tokens=tokens,
            live=live,
            reads=reads,
            prefill_rows=rows,
            pairs=pairs,
            step=step,
            uniform=~any_per_step(s != self.plan.host.uniform_decode_tokens),
            decode=decode,
            computed=c,
        )

    def _split_prefills(
        self, tokens: np.ndarray, s: np.ndarray, c: np.ndarray, rows: np.ndarray
    ) -> np.ndarray | None:
        """Under prefill context parallelism, each prefill row's tokens become those its
        busiest rank computes (in place in `tokens`); returns that rank's pairs per key cap
        (rows, caps), or None when prefills are not split."""
        ranks = self.deployment.prefill_context_parallel
        if ranks == 1:
            return None
        pairs = np.empty((len(rows), len(self.keys_caps)))
        for i, row in enumerate(rows):
            local, pairs[i] = laws.busiest_rank_prefill(
                int(s[row]), int(c[row]), ranks, self.keys_caps
            )
            tokens[row] = local
        return pairs

    # ------------------------------------------------------------------ pricing
    def _host_us(self, features: _Features) -> np.ndarray:
        host = self.plan.host
        captured = np.where(
            features.uniform, host.graph_us[host.decode_mode], host.graph_us[host.other_mode]
        )
        target = laws.host_us(
            captured,
            host.graph_us["none"],
            features.step[TOKENS],
            host.capture_ceiling,
            host.kernels,
            host.dispatch_per_kernel_us,
        )
        drafter = host.drafter
        drafting = laws.drafter_host_us(
            features.step[ROWS],
            features.step[PREFILLING] > 0,
            drafter.ceiling_rows,
            drafter.replay_us,
            drafter.eager_us,
            drafter.store_us,
        )
        total: np.ndarray = target + drafting
        return total

    def _compose(self, features: _Features) -> _Composed:
        step = features.step
        kinds, n = len(self.kind_names), step.shape[1]
        tokens = step[TOKENS]
        linear = self._linear @ step
        terms = linear[: 4 * kinds].reshape(4, kinds, n)
        layer = np.zeros((4, kinds, n))
        layer[SM] = terms[GEMM] + terms[ATTENTION]
        layer[HBM] = terms[READ]
        if len(self._collective_bytes):
            rows = step[self._collective_rows]
            launch_us = laws.collective_us(
                self._collective_bytes[:, None] * rows,
                self._collective_t0[:, None],
                self._collective_r_t[:, None],
                self._collective_r_peak[:, None],
            )
            fabric = self._fabric_launches @ (launch_us * (rows > 0))
            layer[NVLINK:] = fabric.reshape(2, kinds, n)
        for k, gather in self._context_gathers:
            layer[NVLINK, k] += features.context_gather_us(gather, self.plan.context_gather_chunk)
        expert = np.zeros((2, kinds, n))
        expert[0] = terms[EXPERT]
        if self._has_experts:
            touched = laws.distinct_experts(
                self._routed[:, None] * tokens, self._miss[:, None], self._local_experts[:, None]
            )
            for kind in np.flatnonzero(self._busiest_of > 1):
                touched[kind] = laws.busiest_rank_distinct_experts(
                    self._routed[kind] * tokens,
                    float(self._miss[kind]),
                    int(self._local_experts[kind]),
                    int(self._busiest_of[kind]),
                )
            expert[1] = touched * self._expert_us[:, None]
        head = linear[4 * kinds :].copy()
        parts = self._gemm_parts
        active = tokens > 0
        gemm_sm, gemm_hbm = laws.gemm_kernel_us(
            parts[:, 1:2] * tokens + parts[:, 2:3] * active, parts[:, 3:4] * active
        )
        sm_by_kind, hbm_by_kind = self._gemm_kinds @ gemm_sm, self._gemm_kinds @ gemm_hbm
        layer[SM] += sm_by_kind[:kinds]
        layer[HBM] += hbm_by_kind[:kinds]
        head[0] += sm_by_kind[kinds]
        head[1] += hbm_by_kind[kinds]
        composed = laws.compose_step(layer, expert, self.repeat, head, self._host_us(features))
        return _Composed(
            step=composed, layer=layer, expert=expert, head=head, gemm_on_sm=gemm_hbm <= 0.0
        )

    def price(self, scheduled: ArrayLike, computed: ArrayLike, prompt_len: ArrayLike) -> StepPrice:
        """Price one step; one entry per request in each array. A request is a prefill when it
        schedules more than the decode threshold, as the engine classes it; prompt_len is
        validated but does not change the price."""
        s, c, p = np.asarray(scheduled), np.asarray(computed), np.asarray(prompt_len)
        if not (_plain_counts(s) and _plain_counts(c) and _plain_counts(p)):
            s, c, p = (
                _as_counts(name, values)
                for name, values in zip(Slots._fields[1:], (s, c, p), strict=True)
            )
        split = self.deployment.prefill_context_parallel > 1
        if not len(s) == len(c) == len(p) or self._context_gathers or split:
            # the batch-wide checks, context gathers and prefill splits are the vectorised path's
            slots = Slots(np.zeros(len(s), dtype=np.int64), s, c, p)
            return self._step_price(self._flat(self._compose(self._features(slots, 1))))
        if not (
            single_step.non_negative(s)
            and single_step.non_negative(c)
            and single_step.non_negative(p)
        ):
            for name, values in zip(Slots._fields[1:], (s, c, p), strict=True):
                _as_counts(name, values)  # raises, naming the first negative count
        return self._step_price(single_step.price_step(s, c, self._single))

    def _flat(self, composed: _Composed) -> np.ndarray:
        """One composed step in `single_step.compose_one`'s layout."""
        step = composed.step
        return np.concatenate(
            [
                step.totals[:, 0],
                [step.overlap[0], step.nooverlap[0], step.bottleneck[0]],
                composed.layer[..., 0].ravel(),
                composed.expert[..., 0].ravel(),
                step.stage[:, 0],
                composed.head[:, 0],
            ]
        )

    def _step_price(self, flat: np.ndarray) -> StepPrice:
        """A StepPrice from one step in `single_step.compose_one`'s layout."""
        kinds = len(self.kind_names)
        values = flat.tolist()
        layer_at, expert_at, stage_at, head_at = 8, 8 + 4 * kinds, 8 + 6 * kinds, 8 + 7 * kinds
        per_kind = {
            name: {
                "repeat": self._repeat_counts[k],
                "sm_us": values[layer_at + k],
                "hbm_us": values[layer_at + kinds + k],
                "nvlink_us": values[layer_at + 2 * kinds + k],
                "nic_us": values[layer_at + 3 * kinds + k],
                "expert_sm_us": values[expert_at + k],
                "expert_hbm_us": values[expert_at + kinds + k],
                "stage_us": values[stage_at + k],
            }
            for k, name in enumerate(self.kind_names)
        }
        per_kind["head"] = {"repeat": 1, "sm_us": values[head_at], "hbm_us": values[head_at + 1]}
        sm, hbm, nvlink, nic, host, overlap, nooverlap = values[:7]
        return StepPrice(
            sm_us=sm,
            hbm_us=hbm,
            nvlink_us=nvlink,
            nic_us=nic,
            host_us=host,
            overlap_us=overlap,
            nooverlap_us=nooverlap,
            bottleneck=RESOURCES[int(values[7])],
            per_kind=per_kind,
        )

    def price_many(self, slots: Slots, n_steps: int) -> StepPrices:
        """Price many steps at once. A step with no slot costs its host time only."""
        composed = self._compose(self._features(slots, n_steps))
        sm, hbm, nvlink, nic, host = composed.step.totals
        return StepPrices(
            sm_us=sm,
            hbm_us=hbm,
            nvlink_us=nvlink,
            nic_us=nic,
            host_us=host,
            overlap_us=composed.step.overlap,
            nooverlap_us=composed.step.nooverlap,
            bottleneck=composed.step.bottleneck.astype(np.int8),
        )

    # ------------------------------------------------------------------ work per slot
    def slot_work_many(self, slots: Slots, n_steps: int) -> tuple[np.ndarray, np.ndarray]:
        """Split each step's NoOverlap into fixed_us (n_steps, 5) and slot_us (n_slots, 5).

        The step's resource totals are the composed price. A slot's own part is the same laws
        evaluated on that slot's quantities alone, without the terms no single request causes:
        its tokens' GEMM arithmetic at eps_max (T / eps(T) = (T + m_half) / eps_max, so the
        m_half overhead is the fixed part; by default on the resource each GEMM binds on, the
        rest of a read-bound GEMM's weight read fixed), its attention pairs (at its own ramp, or the step's
        under compat "go") without the floor, its activations, its context read without the
        floor, its recurrent state's read and write and its scan, the distinct experts' reads in
        proportion to its tokens, and its collective bytes at the rate in force for the step's
        message (each launch's t0 is fixed). Fixed is what remains: weights and the head read
        once, attention and recurrent floors, host, collective t0s and the ramp overheads. Per
        step, fixed + slots == NoOverlap.
        """
        features = self._features(slots, n_steps)
        steps = features.steps
        composed = self._compose(features)
        tokens, step_tokens = features.tokens, features.step[TOKENS]
        slot = np.zeros((len(tokens), 5))
        slot[:, :2] = features.own(self._own, self._reads_at, self._pairs_at)
        # A slot's tokens' GEMM arithmetic at eps_max, on the resource each part binds on
        own_gemm = self._gemm_repeat * self._gemm_parts[:, 1]
        on_sm = composed.gemm_on_sm.astype(np.float64)
        slot[:, SM] += tokens * (own_gemm @ on_sm)[steps]
        slot[:, HBM] += tokens * (own_gemm @ (1.0 - on_sm))[steps]
        expert_share = (self.repeat @ composed.expert[1]) / np.maximum(step_tokens, 1.0)
        slot[:, HBM] += tokens * expert_share[steps]
        if len(self._collective_bytes):
            rate = laws.collective_rate_in_force(
                features.step[self._collective_rows].T * self._collective_bytes,
                self._collective_t0,
                self._collective_r_t,
                self._collective_r_peak,
            )[steps]
            launches = self._launches @ self.repeat  # (collectives, fabrics)
            decode_tokens = np.where(features.decode, tokens, 0.0)
            own_rows = np.where(
                self._collective_rows == DECODE_TOKENS, decode_tokens[:, None], tokens[:, None]
            )
            slot[:, NVLINK:HOST] = (own_rows * self._collective_bytes / rate) @ launches
        caused = np.stack(
            [np.bincount(steps, weights=slot[:, r], minlength=n_steps) for r in range(5)], axis=1
        )
        # Where nothing is fixed (a collective at its peak rate) the difference is rounding.
        return np.maximum(composed.step.totals.T - caused, 0.0), slot

    def slot_work(
        self, scheduled: ArrayLike, computed: ArrayLike, prompt_len: ArrayLike
    ) -> SlotWork:
        """One step's NoOverlap split into its fixed part and each slot's own part."""
        n = len(np.asarray(scheduled))
        fixed, slot = self.slot_work_many(
            Slots(np.zeros(n, dtype=np.int64), scheduled, computed, prompt_len), 1
        )
        return SlotWork(fixed_us=fixed[0], slot_us=slot)
