"""A deployment's model graph collapsed once into what pricing a step needs.

One `PlannedLayer` per distinct layer kind, with its repeat count and its per-rank work pre-summed
(as the Go kernel's `Plan`/`PlannedLayer`): collectives whose emit condition does not hold are
resolved out, coefficients are looked up in the chip file, and shape-independent work (weight
bytes, expert counts) is summed into scalars. The kernel evaluates the laws over these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pricing import laws
from pricing.deployment import GRAPH_MODES, Deployment
from pricing.spec import (
    CACHE_BYTES,
    FOUR_BIT_CACHES,
    WEIGHT_BYTES,
    AttentionNode,
    ChipSpec,
    CollectiveNode,
    DecodeKind,
    ElementwiseNode,
    GemmNode,
    GroupedGemmNode,
    HyperConnectionNode,
    LayerKind,
    ModelSpec,
    PricingError,
    Ramp,
    RecurrentNode,
    kv_bytes_per_token_layer,
    load_recurrent_registry,
)

# GPU kernels each graph node launches (blis-latency-kernel plan constants, counted from the
# graph's primitives); a collective whose emit condition does not hold launches none.
KERNELS_PER_NODE = {
    "gemm": 1,
    "grouped_gemm": 4,
    "attention": 2,
    "recurrent": 2,
    "elementwise": 1,
    # vLLM's mHC: the mixing GEMM and the fused pre-mix, then the post-mix
    "hyper_connection": 3,
    "all_reduce": 1,
    "all_gather": 1,
    "reduce_scatter": 1,
    "all2all": 2,
}
HEAD_KERNELS = 2  # final norm + lm_head
# A decode-context-parallel combine: query gather, log-sum-exp gather, output reduce-scatter.
DCP_COMBINE_OPS = ("all_gather", "all_gather", "reduce_scatter")
# Collectives, norms and hidden states move bf16 activations whatever the weight format: vLLM's
# quantized linears return out_dtype = x.dtype (ScaledMMLinearKernel at v0.31.0).
ACTIVATION_BYTES = 2
# Collective widths the registry searched; wider groups use the widest measured width.
WIDEST_SEARCHED_WIDTH = 16
# vLLM's default max_num_seqs: 1024 on parts with at least 70 GiB except A100s, else 256
# (vllm/engine/arg_utils.py default_max_num_seqs).
LARGE_PART_GIB = 70
LARGE_PART_MAX_NUM_SEQS = 1024
SMALL_PART_MAX_NUM_SEQS = 256

# vLLM's MLA chunked-prefill workspace: min(max(8 x max_model_len, 4 x max_num_seqs x block),
# 65,536) rows (determine_chunked_prefill_workspace_size); at the cap for every model served
# with the default max_model_len of 8,192 tokens or more, and a multiple of every block size.
MLA_CONTEXT_CHUNK = 65536

Resource = Literal["nvlink", "nic"]
# Which of a step's token counts a collective moves a row of: every token, or only the decode
# rows' (a decode-context combine under compat="go").
CollectiveRows = Literal["tokens", "decode_tokens", "prefill_tokens"]
ReadKind = Literal["dense", "sparse_mla"]
DECODE_KIND: dict[str, DecodeKind] = {
    "gqa": "full",
    "swa": "swa",
    "mla": "mla",
    "sparse_mla": "sparse_mla",
}


@dataclass(frozen=True)
class Compute:
    """A compute lane: peak FLOP per microsecond and the GEMM efficiency ramp reached on it."""

    peak_flops_per_us: float
    ramp: Ramp


@dataclass(frozen=True)
class ReadBound:
    """How many cached tokens one decode request reads in a layer (`laws.decode_read_tokens`)."""

    kind: ReadKind
    window: int | None
    top_k: int | None
    compress_ratio: float | None
    context_ranks: int = 1  # the read is dealt over this many ranks (`laws.context_shard`)


WHOLE_CONTEXT = ReadBound(kind="dense", window=None, top_k=None, compress_ratio=None)


@dataclass(frozen=True)
class PlannedIndexer:
    """A sparse layer's selector: it scans every cached position's index key at decode and scores
    every causal query-key pair at prefill, on every rank."""

    decode_floor_us: float
    decode_rate_bytes_per_us: float
    cache_bytes_per_token: float
    prefill_floor_us: float
    heads: int
    head_dim: int
    scores_prefill: bool  # the Go kernel prices no indexer work at prefill
    read: ReadBound  # the whole context; under compat="go", dealt over a DCP group


@dataclass(frozen=True)
class PlannedAttention:
    """A layer's attention on one rank: its decode read and floor, its prefill work, its indexer."""

    decode_floor_us: float
    decode_rate_bytes_per_us: float
    kv_bytes_per_token: float  # one token, this layer, one rank
    read: ReadBound
    prefill_floor_us: float
    q_heads: int
    qk_dim: int  # per head, the score product's depth
    v_dim: int  # per head, the value product's width
    keys_cap: int | None  # keys a prefill query sees at most (window, or a sparse layer's top-k)
    memory_window: int | None  # tokens per request the cache holds at most
    one_kernel_floor: bool  # a mixed step pays one floor, the larger
    indexer: PlannedIndexer | None


@dataclass(frozen=True)
class PlannedRecurrent:
    """A recurrent mixer on one rank. Each row of a step reads its request's state and writes it
    back once; a prefill row also runs the chunked scan over its tokens."""

    state_bytes: float  # one request, this layer, one rank
    scan_flops_per_token: float  # one rank
    decode_floor_us: float
    prefill_floor_us: float
    scan: Compute
    scan_work_scale: float


@dataclass(frozen=True)
class MeasuredRecurrent:
    """A recurrent mixer as the Go kernel prices it: its registry floor plus its token rate, on
    SM, per layer of a step with tokens; nothing where the registry has no entry."""

    floor_us: float
    us_per_token: float
    state_bytes: float  # one request, this layer, one rank (memory only)


@dataclass(frozen=True)
class PlannedExperts:
    """A layer's routed experts as the busiest rank of the MoE group runs them."""

    flops_per_token: float  # routed, all top_k experts of one token, on the busiest rank
    bytes_per_expert: float  # what the busiest rank reads of one touched expert
    local_experts: float  # experts (or expert shards) the busiest rank holds
    experts: int
    top_k: int
    # Tokens the MoE group routes per token of this rank's step: every attention DP replica
    # feeds the same experts, each with a step like this one.
    tokens_per_step_token: int
    # The grouped GEMM's ramp overhead (m_half tokens of work) in units of one token's routed
    # work: 1 with the ramp at the routed tokens, the DP width with it at the step's own.
    ramp_overhead_tokens: int
    # The experts routing chooses among when counting the distinct ones a step touches.
    coverage_experts: int
    # Ranks holding whole experts whose busiest one the layer waits for (the expected largest
    # distinct count, `laws.busiest_rank_distinct_experts`); 1 prices the mean rank's count.
    busiest_of: int = 1


@dataclass(frozen=True)
class PlannedCollective:
    """One collective launch a layer makes: its measured triple, bytes per row and fabric."""

    t0_us: float
    r_t_bytes_per_us: float
    r_peak_bytes_per_us: float
    bytes_per_token: float
    resource: Resource
    rows: CollectiveRows = "tokens"


@dataclass(frozen=True)
class PlannedHyperConnections:
    """A layer's mHC hyper-connections priced by the chip's measured form
    (`laws.hyper_connection_us`), each run whole on every rank."""

    count: int
    floor_us: float
    stream_bytes_per_token: float  # the residual streams, one token
    pre_rate_bytes_per_us: float
    post_rate_bytes_per_us: float


@dataclass(frozen=True)
class DenseGemms:
    """A layer's dense GEMMs of one weight width, per rank: their FLOPs per token and weight
    bytes. Every GEMM's bytes per FLOP is its weight width over 2, so within a group each GEMM
    reaches the same crossover from read-bound to compute-bound (`laws.gemm_kernel_us`)."""

    flops_per_token: float
    weight_bytes: float


class _DenseSums:
    """A layer's dense GEMMs summed as the plan walks its nodes: in all, and by weight width."""

    def __init__(self) -> None:
        self.flops_per_token = self.weight_bytes = 0.0
        self._widths: dict[float, DenseGemms] = {}

    def add(self, flops_per_token: float, weight_bytes: float, bytes_per_element: float) -> None:
        if not flops_per_token:
            return
        self.flops_per_token += flops_per_token
        self.weight_bytes += weight_bytes
        held = self._widths.get(bytes_per_element, DenseGemms(0.0, 0.0))
        self._widths[bytes_per_element] = DenseGemms(
            held.flops_per_token + flops_per_token, held.weight_bytes + weight_bytes
        )

    def by_width(self) -> tuple[DenseGemms, ...]:
        return tuple(self._widths.values())


@dataclass(frozen=True)
class PlannedLayer:
    """One layer kind with its repeat count and its per-rank work pre-summed."""

    name: str
    repeat: int
    dense_flops_per_token: float  # per rank
    weight_bytes: float  # per rank, read once per step
    activation_bytes_per_token: float  # per rank
    attention: PlannedAttention | None
    recurrent: PlannedRecurrent | MeasuredRecurrent | None
    experts: PlannedExperts | None
    collectives: tuple[PlannedCollective, ...]
    kernels: int
    # Memory-bound kernels (elementwise nodes) each paying the chip's memory-op latency; none
    # under compat="go", which prices their bytes alone.
    memory_ops: int = 0
    # Under compat="go" with decode context parallelism on a latent layer: the latent width a
    # prefill's cached context is all-gathered at, and that gather's collective.
    context_gather: PlannedCollective | None = None
    hyper_connections: PlannedHyperConnections | None = None
    # The dense GEMMs (dense_flops_per_token, weight_bytes) by weight width.
    gemms: tuple[DenseGemms, ...] = ()


@dataclass(frozen=True)
class Drafter:
    """A parallel-block drafter's host costs (`laws.drafter_host_us`); all zero without one."""

    ceiling_rows: int = 0  # requests its own graph holds; 0 = never replayed
    replay_us: float = 0.0  # one replay plus its kernels' dispatch
    eager_us: float = 0.0  # its layers launched eagerly plus its kernels' dispatch
    store_us: float = 0.0  # the eager store of its extra context, on a step with a prefill row


@dataclass(frozen=True)
class Host:
    """The CPU side of a step: graph costs per capture mode, the capture ceiling, kernel launches."""

    graph_us: dict[str, float]  # "full" / "piecewise" / "none" -> CPU cost of one step's graph
    decode_mode: str  # graph mode of a uniform-decode (or empty) step
    other_mode: str  # graph mode of any other step
    capture_ceiling: int  # tokens; above it the step runs eager
    uniform_decode_tokens: int
    kernels: int
    dispatch_per_kernel_us: float
    drafter: Drafter = Drafter()


@dataclass(frozen=True)
class Plan:
    """A deployment's model graph collapsed for pricing: its layer kinds, head, lanes and host."""

    layers: tuple[PlannedLayer, ...]
    head_flops_per_token: float
    head_weight_bytes: float
    gemm: Compute
    prefill_attention: Compute
    prefill_work_scale: float
    per_request_attention_ramp: bool
    read_bytes_per_us: float  # derated HBM bandwidth
    host: Host
    # A dense GEMM costs the larger of its arithmetic and its weight read (physics), or both
    # (compat="go"): `laws.gemm_kernel_us`.
    gemm_time_once: bool = False
    # Context tokens one all-gather of a decode-context-parallel MLA prefill covers (vLLM's
    # chunked-prefill workspace, 65,536 rows at most, aligned to the cache blocks)
    context_gather_chunk: int = MLA_CONTEXT_CHUNK


def compute_lane(dtype: str, chip: ChipSpec, compat: str) -> str:
    """The peak/ramp a served dtype computes at on this chip.

    bf16/fp16 and int4 (W4A16) compute in bf16; fp8 and int8 at fp8 where the chip has it.
    Four-bit floats use a native four-bit peak where there is one; otherwise vLLM runs them
    as weight-only kernels at the bf16 rate (the step-pricing spec), while the Go kernel tries
    fp8 first.
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


def _sequence_parallel_moe(deployment: Deployment) -> bool:
    """vLLM makes the MoE input sequence-parallel (each TP rank dispatches its slice of the
    tokens, so the layer's output all-reduce is not run) under expert parallelism with TP and
    DP both above one (the Go kernel's rule, on every dispatch backend)."""
    return deployment.expert_parallel and deployment.tp > 1 and deployment.data_parallel > 1


def _emits(node: CollectiveNode, deployment: Deployment, physics: bool) -> bool:
    """Whether a collective node launches under this deployment."""
    if node.emit == "always":
        return True
    if node.emit == "expert_parallel":
        # With DP > 1 and expert parallelism off vLLM still gathers every DP rank's tokens to
        # the experts it shards over the group (the all-gather/reduce-scatter fallback,
        # fused_moe/all2all_utils.py); a TP-only MoE dispatches nothing.
        dispatched = deployment.expert_parallel or deployment.data_parallel > 1
        return dispatched and deployment.moe_group > 1
    if node.emit == "tensor_parallel_unless_sp_moe" and not physics:
        return deployment.tp > 1 and not _sequence_parallel_moe(deployment)
    return deployment.tp > 1


class _Planner:
    """Resolves one deployment's graph against its chip; `plan()` returns the Plan."""

    def __init__(self, deployment: Deployment, chip: ChipSpec, model: ModelSpec) -> None:
        self.deployment, self.chip, self.model = deployment, chip, model
        self.physics = deployment.compat == "physics"
        self.served = deployment.dtype or model.weight_dtype
        if self.served not in WEIGHT_BYTES:
            raise PricingError(f"unknown dtype {self.served!r}; known: {sorted(WEIGHT_BYTES)}")
        self.cache_dtype = deployment.cache_dtype or "auto"
        if self.cache_dtype not in CACHE_BYTES:
            raise PricingError(
                f"unknown cache dtype {self.cache_dtype!r}; known: {sorted(CACHE_BYTES)}"
            )
        if (
            not self.physics
            and self.cache_dtype == "nvfp4_ds_mla"
            and any(
                kind.attention is not None and kind.attention.kind == "mla"
                for kind in model.layer_kinds
            )
        ):
            raise PricingError(
                "the Go kernel serves an nvfp4_ds_mla cache on sparse MLA only, and "
                f"{model.name!r} has plain MLA layers"
            )
        if self.cache_dtype in FOUR_BIT_CACHES and not chip.blackwell:
            raise PricingError(
                f"a {self.cache_dtype} KV cache needs a part with four-bit attention kernels; "
                f"{chip.name!r} has no nvfp4 peak"
            )
        tp, nodes = deployment.tp, deployment.nodes
        if tp % nodes or tp // nodes > chip.gpus_per_node:
            raise PricingError(
                f"tp {tp} over {nodes} node(s) does not fit {chip.name!r} nodes of "
                f"{chip.gpus_per_node} GPUs"
            )
        self._check_context_parallel()
        if chip.attention.prefill is None:
            raise PricingError(
                f"chip {chip.name!r} has no prefill attention coefficients (attention.prefill)"
            )
        if nodes > 1 and tp > chip.nvlink_domain and chip.inter_node_gb_s is None:
            raise PricingError(
                f"chip {chip.name!r} states no inter_node_gb_s, needed for a TP group over "
                f"{nodes} nodes"
            )

    def _check_context_parallel(self) -> None:
        """vLLM runs prefill context parallelism only where every layer's attention is latent
        (MLA's backends alone support it; recurrent and other attention backends refuse at
        start-up); its pairing with decode context parallelism is not priced."""
        pcp = self.deployment.prefill_context_parallel
        if pcp == 1:
            return
        for kind in self.model.layer_kinds:
            if kind.recurrent is not None or (
                kind.attention is not None and not kind.attention.latent
            ):
                raise PricingError(
                    f"prefill_context_parallel {pcp} needs latent attention in every layer; "
                    f"layer kind {kind.name!r} of {self.model.name!r} has another mixer"
                )
        if self.deployment.decode_context_parallel > 1:
            raise PricingError(
                "prefill and decode context parallelism together are not priced "
                f"(prefill_context_parallel {pcp}, "
                f"decode_context_parallel {self.deployment.decode_context_parallel})"
            )

    def _compute(self, lane: str, what: str) -> Compute:
        if lane not in self.chip.peak_tflops:
            raise PricingError(f"chip {self.chip.name!r} has no {lane} peak for {what}")
        # peak_tflops is 1e12 FLOP/s = 1e6 FLOP per microsecond
        return Compute(self.chip.peak_tflops[lane] * 1e6, self.chip.gemm.ramps[lane])

    def plan(self) -> Plan:
        deployment, chip, model = self.deployment, self.chip, self.model
        tp = deployment.tp
        prefill = chip.attention.prefill
        assert prefill is not None  # checked in __init__
        lane = compute_lane(self.served, chip, deployment.compat)
        layers = tuple(self._layer(kind) for kind in model.layer_kinds)
        head_bytes_per_element = WEIGHT_BYTES[model.head.weight_dtype or self.served]
        host = chip.host
        # vLLM splits a piecewise graph at each attention or recurrent mixer (both are in its
        # splitting ops) and at a sparse layer's indexer; the Go kernel splits at every layer.
        splits = sum(
            layer.repeat
            * (
                (
                    (layer.attention is not None) + (layer.recurrent is not None)
                    if self.physics
                    else 1
                )
                + (layer.attention is not None and layer.attention.indexer is not None)
            )
            for layer in layers
        )
        graph_us = {
            mode: laws.graph_host_us(
                mode,
                model.layers,
                splits,
                host.replay_graph_us,
                host.eager_launch_per_layer_us,
            )
            for mode in ("full", "piecewise", "none")
        }
        max_num_seqs = deployment.max_num_seqs or (
            LARGE_PART_MAX_NUM_SEQS
            if chip.memory_gib >= LARGE_PART_GIB and not chip.name.startswith("a100")
            else SMALL_PART_MAX_NUM_SEQS
        )
        decode_mode, other_mode = GRAPH_MODES[deployment.cudagraph_mode]
        ceiling = laws.capture_ceiling(max_num_seqs, deployment.num_spec_tokens, chip.blackwell)
        return Plan(
            layers=layers,
            head_flops_per_token=2.0 * model.head.n * model.head.k / tp,
            head_weight_bytes=model.head.n * model.head.k * head_bytes_per_element / tp,
            gemm=self._compute(lane, "GEMMs"),
            # work_scale was fitted as a fraction of the bf16 ramp; the Go kernel applies it to
            # the served dtype's.
            prefill_attention=self._compute("bf16" if self.physics else lane, "prefill attention"),
            prefill_work_scale=prefill.work_scale,
            per_request_attention_ramp=self.physics,
            read_bytes_per_us=chip.hbm_tb_s * 1e6 * chip.gemm.hbm_derate,
            gemm_time_once=self.physics,
            host=Host(
                graph_us=graph_us,
                decode_mode=decode_mode,
                other_mode=other_mode,
                capture_ceiling=ceiling,
                uniform_decode_tokens=1 + deployment.num_spec_tokens,
                kernels=HEAD_KERNELS + sum(layer.repeat * layer.kernels for layer in layers),
                dispatch_per_kernel_us=host.dispatch_per_kernel_us,
                drafter=self._drafter(ceiling, decode_mode),
            ),
        )

    def _drafter(self, capture_tokens: int, decode_mode: str) -> Drafter:
        """The deployment's parallel-block drafter, from the layers the model file states."""
        name, model, host = self.deployment.drafter, self.model, self.chip.host
        if name is None:
            return Drafter()
        if model.drafter is None or model.drafter.name != name:
            stated = "none" if model.drafter is None else repr(model.drafter.name)
            raise PricingError(
                f"drafter {name!r} is not the one {model.name!r} states (its drafter: {stated})"
            )
        kinds = [self._layer(kind) for kind in model.drafter.layer_kinds]
        layers = sum(kind.repeat for kind in kinds)
        dispatch = host.dispatch_per_kernel_us * sum(kind.repeat * kind.kernels for kind in kinds)
        eager = host.eager_launch_per_layer_us * layers
        return Drafter(
            ceiling_rows=laws.drafter_capture_rows(
                capture_tokens, self.deployment.num_spec_tokens, decode_mode
            ),
            replay_us=host.replay_graph_us + dispatch,
            eager_us=eager + dispatch,
            # One eager pass over its layers writes the context a prefill row adds to its cache.
            store_us=eager,
        )

    def _layer(self, kind: LayerKind) -> PlannedLayer:
        tp, served, hidden = self.deployment.tp, self.served, self.model.hidden_size
        activation_bytes = 0.0
        attention: PlannedAttention | None = None
        recurrent: PlannedRecurrent | MeasuredRecurrent | None = None
        experts: PlannedExperts | None = None
        collectives: list[PlannedCollective] = []
        context_gather: PlannedCollective | None = None
        measured_mixes = 0
        kernels = memory_ops = 0
        gemms = _DenseSums()
        for node in kind.nodes:
            if isinstance(node, GemmNode):
                shards = 1 if node.replicated else tp
                bytes_per_element = WEIGHT_BYTES[node.weight_dtype or served]
                gemms.add(
                    2.0 * node.n * node.k / shards,
                    node.n * node.k * bytes_per_element / shards,
                    bytes_per_element,
                )
            elif isinstance(node, GroupedGemmNode):
                bytes_per_element = WEIGHT_BYTES[node.weight_dtype or served]
                # gate, up and down: three n x k matrices per expert. Shared experts run for
                # every token, sharded like a dense MLP.
                shared = node.n * node.k * node.shared_experts
                gemms.add(
                    6.0 * shared / tp, 3.0 * shared * bytes_per_element / tp, bytes_per_element
                )
                experts = self._experts(node, bytes_per_element)
            elif isinstance(node, AttentionNode):
                attention = self._attention(node)
                if self.deployment.decode_context_parallel > 1:
                    combine = self._context_parallel_combine(node)
                    collectives += combine
                    context_gather = self._dcp_collective("all_gather", node.head_dim)
                    if self.physics:
                        # each combine collective is a kernel launch (the Go kernel counts
                        # only the graph's nodes)
                        kernels += sum(KERNELS_PER_NODE[op] for op in DCP_COMBINE_OPS)
                if attention.indexer is not None:
                    kernels += KERNELS_PER_NODE["attention"]  # the indexer is an attention op
                if self.deployment.prefill_context_parallel > 1:
                    collectives += self._prefill_context_gathers(node)
            elif isinstance(node, RecurrentNode):
                recurrent = self._recurrent(node) if self.physics else self._measured_mixer(node)
            elif isinstance(node, HyperConnectionNode):
                if self.chip.hyper_connections is None:
                    # Every rank runs it whole on its copy of the streams: not divided by TP.
                    activation_bytes += node.bytes_per_token
                    mixing = node.mixing.n * node.mixing.k
                    fp32 = WEIGHT_BYTES["fp32"]
                    gemms.add(2.0 * mixing, mixing * fp32, fp32)
                else:
                    measured_mixes += 1
            elif isinstance(node, ElementwiseNode):
                # unstated: a read and a write of the hidden state
                activation_bytes += (node.bytes_per_token or 2 * hidden * ACTIVATION_BYTES) / tp
                memory_ops += int(self.physics)
            else:
                if not _emits(node, self.deployment, self.physics):
                    continue
                collectives.append(self._collective(node, hidden))
            kernels += KERNELS_PER_NODE[node.op]
        return PlannedLayer(
            name=kind.name,
            repeat=kind.repeat,
            dense_flops_per_token=gemms.flops_per_token,
            weight_bytes=gemms.weight_bytes,
            activation_bytes_per_token=activation_bytes,
            attention=attention,
            recurrent=recurrent,
            experts=experts,
            collectives=tuple(collectives),
            kernels=kernels,
            memory_ops=memory_ops,
            context_gather=context_gather,
            hyper_connections=self._hyper_connections(kind, measured_mixes),
            gemms=gemms.by_width(),
        )

    def _hyper_connections(self, kind: LayerKind, count: int) -> PlannedHyperConnections | None:
        """A layer's hyper-connections under the chip's measured mHC form, if it has one."""
        measured = self.chip.hyper_connections
        if count == 0 or measured is None:
            return None
        streams = {n.streams for n in kind.nodes if isinstance(n, HyperConnectionNode)}
        if len(streams) > 1:
            raise PricingError(
                f"layer kind {kind.name!r} of {self.model.name!r} states hyper-connections of "
                f"{sorted(streams)} streams; one width per layer is priced"
            )
        return PlannedHyperConnections(
            count=count,
            floor_us=measured.floor_us,
            stream_bytes_per_token=float(streams.pop() * self.model.hidden_size * ACTIVATION_BYTES),
            pre_rate_bytes_per_us=measured.pre_rate_bytes_per_us,
            post_rate_bytes_per_us=measured.post_rate_bytes_per_us,
        )

    def _experts(self, node: GroupedGemmNode, bytes_per_element: float) -> PlannedExperts:
        deployment = self.deployment
        group, dp = deployment.moe_group, deployment.data_parallel
        expert_flops = 6.0 * node.n * node.k * self.chip.gemm.moe_routing_imbalance
        expert_bytes = 3.0 * node.n * node.k * bytes_per_element
        # The grouped GEMM sees every DP replica's tokens; the Go kernel evaluates its ramp at
        # the step's own tokens, charging the m_half overhead once per replica.
        ramp_overhead = 1 if self.physics else dp
        if deployment.expert_parallel:
            # Whole experts, spread evenly with EPLB's redundant copies: the busiest rank holds
            # ceil(physical / group) of them and, EPLB balancing load over the copies, that
            # share of the routed work.
            physical = node.experts + deployment.eplb_redundant_experts
            local = float(-(-physical // group))
            return PlannedExperts(
                flops_per_token=node.top_k * expert_flops * local / physical,
                bytes_per_expert=expert_bytes,
                local_experts=local,
                experts=node.experts,
                top_k=node.top_k,
                tokens_per_step_token=dp,
                ramp_overhead_tokens=ramp_overhead,
                # A logical expert's tokens are dealt over its copies, so a token reaches a
                # given physical expert with probability top_k / physical on average.
                coverage_experts=physical,
                # The Go kernel reads the mean rank's distinct experts.
                busiest_of=group if self.physics else 1,
            )
        # Every rank holds a 1/group shard of every expert. The Go kernel divides the routed
        # arithmetic by the DP width only (a documented over-charge); physics by the group.
        arithmetic_shards = group if self.physics else dp
        return PlannedExperts(
            flops_per_token=node.top_k * expert_flops / arithmetic_shards,
            bytes_per_expert=expert_bytes / group,
            local_experts=float(node.experts),
            experts=node.experts,
            top_k=node.top_k,
            tokens_per_step_token=dp,
            ramp_overhead_tokens=ramp_overhead,
            coverage_experts=node.experts,
        )

    def _collective(self, node: CollectiveNode, hidden: int) -> PlannedCollective:
        deployment, chip = self.deployment, self.chip
        routed = node.emit == "expert_parallel"
        width = deployment.moe_group if routed else deployment.tp
        t0, r_t, r_peak = _snap_width(chip, node.op, width)
        bytes_per_token = float(hidden * ACTIVATION_BYTES)
        point_to_point = routed and deployment.all2all_backend != "allgather_reducescatter"
        if point_to_point:
            # each token's hidden state goes to each of its top_k experts' ranks
            bytes_per_token *= self._top_k()
        domain = chip.nvlink_domain
        # NVLink domains a group spans: a TP group lies over the deployment's nodes, each a
        # domain unless the rack is one (NVL72); an expert group over consecutive ranks.
        if routed or chip.gpus_per_rack is not None:
            domains = -(-width // domain)
        else:
            domains = deployment.nodes
        if domains > 1:
            if chip.inter_node_gb_s is None:
                raise PricingError(
                    f"chip {chip.name!r} states no inter_node_gb_s, needed for a group of "
                    f"{width} GPUs over {domains} NVLink domains"
                )
            ratio = chip.nvlink_gb_s / chip.inter_node_gb_s
            if point_to_point:
                # a point-to-point exchange sends to every rank outside its domain directly
                cross = width - domain
                bytes_per_token *= 1.0 + (ratio - 1.0) * cross / (width - 1)
            else:
                bytes_per_token *= laws.cross_node_span(ratio, domains, width)
        return PlannedCollective(
            t0_us=t0,
            r_t_bytes_per_us=r_t,
            r_peak_bytes_per_us=r_peak,
            bytes_per_token=bytes_per_token,
            resource="nic" if domains > 1 else "nvlink",
        )

    def _context_parallel_combine(self, node: AttentionNode) -> list[PlannedCollective]:
        """vLLM's MLA decode-context-parallel combine (cp_lse_ag_out_rs), on a layer's decode
        rows (its prefill rows attend a gathered context instead, `context_gather`), on
        NVLink: the group all-gathers its ranks' query heads at the latent width
        (kv_lora_rank + rope, query_head_dim), all-gathers each row's fp32 log-sum-exp per head
        from every rank, and reduce-scatters the partial outputs at kv_lora_rank
        (output_head_dim)."""
        dcp, tp = self.deployment.decode_context_parallel, self.deployment.tp
        if not node.latent or node.kv_lora_rank is None:
            raise PricingError(
                f"decode_context_parallel {dcp} needs a latent attention stating kv_lora_rank "
                f"(attention {node.name!r} is {node.kind})"
            )
        if dcp > self.chip.gpus_per_node:
            raise PricingError(
                f"a decode-context-parallel group of {dcp} does not fit {self.chip.name!r} nodes "
                f"of {self.chip.gpus_per_node} GPUs"
            )
        heads = node.q_heads / tp * dcp
        lse_bytes = 4  # fp32, one per head and row, gathered from every rank of the group
        query, lse, output = DCP_COMBINE_OPS
        return [
            self._dcp_collective(query, heads * node.head_dim, "decode_tokens"),
            self._dcp_collective(lse, dcp * heads * lse_bytes / ACTIVATION_BYTES, "decode_tokens"),
            self._dcp_collective(output, heads * node.kv_lora_rank, "decode_tokens"),
        ]

    def _prefill_context_gathers(self, node: AttentionNode) -> list[PlannedCollective]:
        """A prefill-context-parallel group all-gathers the cache inputs its ranks computed, on
        prefill tokens only (decode rows are replicated): one launch per tensor, a latent
        layer's kv_lora_rank-wide latent and its rope part, and a sparse layer's index key
        (vLLM pcp.py), each row pcp x the rank's tokens, at bf16 before the cache quantizes."""
        pcp, chip, tp = self.deployment.prefill_context_parallel, self.chip, self.deployment.tp
        widths = [node.head_dim]
        if node.kv_lora_rank is not None and node.kv_lora_rank < node.head_dim:
            widths = [node.kv_lora_rank, node.head_dim - node.kv_lora_rank]
        if node.indexer is not None:
            widths.append(node.indexer.head_dim)
        # The group's ranks sit tp apart (vLLM numbers ranks with TP innermost): a node holds
        # gpus_per_node / tp of them, an NVL72 rack gpus_per_rack / tp.
        per_domain = max(chip.nvlink_domain // tp, 1)
        domains = -(-pcp // per_domain)
        t0, r_t, r_peak = _snap_width(chip, "all_gather", pcp)
        span = 1.0
        if domains > 1:
            if chip.inter_node_gb_s is None:
                raise PricingError(
                    f"chip {chip.name!r} states no inter_node_gb_s, needed for a prefill-context "
                    f"group of {pcp} spread over {domains} NVLink domains"
                )
            span = laws.cross_node_span(chip.nvlink_gb_s / chip.inter_node_gb_s, domains, pcp)
        return [
            PlannedCollective(
                t0_us=t0,
                r_t_bytes_per_us=r_t,
                r_peak_bytes_per_us=r_peak,
                bytes_per_token=float(pcp * width * ACTIVATION_BYTES) * span,
                resource="nic" if domains > 1 else "nvlink",
                rows="prefill_tokens",
            )
            for width in widths
        ]

    def _dcp_collective(
        self, op: str, elements_per_row: float, rows: CollectiveRows = "tokens"
    ) -> PlannedCollective:
        """One collective over the decode-context-parallel group, moving `elements_per_row`
        bf16 activations per row."""
        t0, r_t, r_peak = _snap_width(self.chip, op, self.deployment.decode_context_parallel)
        return PlannedCollective(
            t0_us=t0,
            r_t_bytes_per_us=r_t,
            r_peak_bytes_per_us=r_peak,
            bytes_per_token=float(elements_per_row * ACTIVATION_BYTES),
            resource="nvlink",
            rows=rows,
        )

    def _top_k(self) -> int:
        return max(
            (kind.experts.top_k for kind in self.model.layer_kinds if kind.experts is not None),
            default=1,
        )

    def _attention(self, node: AttentionNode) -> PlannedAttention:
        chip = self.chip
        measured = chip.attention.decode
        # A kind without its own measurement uses the part's full-attention pair; a part with
        # none reads the KV bytes at the derated HBM bandwidth with no floor.
        # The rates were measured on bf16 and fp8 caches; a four-bit cache is assumed to stream at
        # the same bytes per microsecond.
        decode = measured.get(DECODE_KIND[node.kind]) or measured.get("full")
        if decode is None:
            floor, rate = 0.0, chip.hbm_tb_s * 1e6 * chip.gemm.hbm_derate
        else:
            floor, rate = decode.floor_us, decode.rate_bytes_per_us
        prefill = chip.attention.prefill
        assert prefill is not None  # checked in __init__
        # The Go kernel reads the whole context on a windowed primary layer; the spec bounds it.
        window_bounded = self.physics or node.kind != "swa"
        # A latent layer's prefill runs the expanded (non-absorbed) form: scores over the
        # nope + rope query width, values at v_head_dim (vLLM's MLA prefill path), not the
        # 576-wide cached latent the Go kernel prices.
        expanded = self.physics and node.latent and node.qk_head_dim is not None
        qk_dim = node.qk_head_dim if expanded and node.qk_head_dim else node.head_dim
        v_dim = node.v_head_dim if expanded and node.v_head_dim else node.head_dim
        return PlannedAttention(
            decode_floor_us=floor,
            decode_rate_bytes_per_us=rate,
            kv_bytes_per_token=kv_bytes_per_token_layer(node, self.deployment.tp, self.cache_dtype),
            read=ReadBound(
                kind="sparse_mla" if node.kind == "sparse_mla" else "dense",
                window=node.window if window_bounded else None,
                top_k=node.top_k,
                compress_ratio=node.compress_ratio,
                context_ranks=self.deployment.decode_context_parallel,
            ),
            prefill_floor_us=prefill.floor_us,
            q_heads=node.q_heads,
            qk_dim=qk_dim,
            v_dim=v_dim,
            # The Go kernel prices a sparse layer's prefill as full causal attention.
            keys_cap=node.top_k if node.kind == "sparse_mla" and self.physics else node.window,
            memory_window=node.window,
            # FlashAttention serves decode and prefill rows in one kernel on non-latent
            # attention, so a mixed step pays one floor. vLLM picks the attention backend from
            # the device: on data-center Blackwell it is FlashInfer/TRT-LLM for every dtype,
            # which runs the decode and prefill rows as separate kernels, each with its floor.
            one_kernel_floor=not node.latent and not chip.blackwell,
            indexer=self._indexer(node),
        )

    def _recurrent(self, node: RecurrentNode) -> PlannedRecurrent:
        """The registry has no recurrent sweep (the Go kernel's f_rec and rate_rec have no values
        in it), so the mixer is priced from its shapes. Heads shard across TP like KV heads.
        Assumed, for want of a measurement: a decode row's update is a read and a write of its
        state at the derated HBM bandwidth (a few FLOP per state element against 4 bytes moved
        in bf16, two orders of magnitude below any part's ridge point, so memory-bound); the per-layer floors are the part's
        full-attention decode floor and its prefill-attention floor (a fused single-pass kernel
        per layer, as attention is); and the prefill scan reaches prefill attention's measured
        fraction of the bf16 GEMM rate (its chunks are attention-like masked tiles). The scan
        computes in bf16 whatever the weights' format."""
        chip, tp = self.chip, self.deployment.tp
        prefill = chip.attention.prefill
        assert prefill is not None  # checked in __init__
        decode = chip.attention.decode.get("full")
        key_heads = -(-node.key_heads // tp)
        value_heads = -(-node.value_heads // tp)
        return PlannedRecurrent(
            state_bytes=laws.recurrent_state_bytes(
                key_heads,
                value_heads,
                node.key_dim,
                node.value_dim,
                node.conv_kernel,
                WEIGHT_BYTES[node.state_dtype],
            ),
            scan_flops_per_token=laws.chunked_scan_flops(
                key_heads, value_heads, node.key_dim, node.value_dim, node.chunk, node.conv_kernel
            ),
            decode_floor_us=0.0 if decode is None else decode.floor_us,
            prefill_floor_us=prefill.floor_us,
            scan=self._compute("bf16", "a recurrent scan"),
            scan_work_scale=prefill.work_scale,
        )

    def _indexer(self, node: AttentionNode) -> PlannedIndexer | None:
        if node.indexer is None:
            return None
        chip = self.chip
        prefill = chip.attention.prefill
        assert prefill is not None  # checked in __init__
        # A dense scan of a cache: the part's full-attention decode pair (the Go kernel prices a
        # secondary attention at its kind's pair). The cache is fp8 keys plus their scales.
        scan = chip.attention.decode.get("full")
        cache_bytes = float(node.indexer.cache_bytes_per_token)
        if not self.physics:
            # The Go kernel sizes a secondary attention's read from the primary's KV figure,
            # scaled by the two caches' widths (one single-head key against the latent).
            cache_bytes = (
                kv_bytes_per_token_layer(node, self.deployment.tp, self.cache_dtype)
                * node.indexer.head_dim
                / (node.kv_heads * node.head_dim)
            )
        return PlannedIndexer(
            decode_floor_us=0.0 if scan is None else scan.floor_us,
            decode_rate_bytes_per_us=(
                chip.hbm_tb_s * 1e6 * chip.gemm.hbm_derate
                if scan is None
                else scan.rate_bytes_per_us
            ),
            cache_bytes_per_token=cache_bytes,
            prefill_floor_us=prefill.floor_us if self.physics else 0.0,
            heads=node.indexer.heads,
            head_dim=node.indexer.head_dim,
            scores_prefill=self.physics,
            read=(
                WHOLE_CONTEXT
                if self.physics
                else ReadBound(
                    kind="dense",
                    window=None,
                    top_k=None,
                    compress_ratio=None,
                    context_ranks=self.deployment.decode_context_parallel,
                )
            ),
        )

    def _measured_mixer(self, node: RecurrentNode) -> MeasuredRecurrent:
        """The Go kernel's recurrent term: the registry's floor and rate for this part and
        family, or nothing where the registry has no entry."""
        entry = load_recurrent_registry().chips.get(self.chip.name, {}).get(node.kind)
        state_bytes = self._recurrent(node).state_bytes
        if entry is None:
            return MeasuredRecurrent(floor_us=0.0, us_per_token=0.0, state_bytes=state_bytes)
        return MeasuredRecurrent(
            floor_us=entry.floor_us,
            us_per_token=1.0 / entry.tokens_per_us,
            state_bytes=state_bytes,
        )


def build_plan(deployment: Deployment, chip: ChipSpec, model: ModelSpec) -> Plan:
    """Collapse `model` served as `deployment` on `chip` into a Plan; refuses what it cannot price."""
    return _Planner(deployment, chip, model).plan()
