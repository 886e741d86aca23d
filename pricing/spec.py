"""Chip and model data: the YAML files under `pricing/chips/` and `pricing/models/`.

Adding a chip or a model is adding a file; these pydantic models validate it and every
error names the file and the field. Numbers stay in the files, with their sources.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path
from typing import Annotated, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)

CHIPS_DIR = Path(__file__).resolve().parent / "chips"
MODELS_DIR = Path(__file__).resolve().parent / "models"


class PricingError(ValueError):
    """Pricing cannot proceed; the message names the missing chip, model, coefficient or width."""


# Weight bytes per element. Four-bit formats count their packed nibbles only: the block scales
# (1 byte per 16 or 32 weights) are under 7% of the traffic and the registry's fits exclude them.
WEIGHT_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
    "mxfp4": 0.5,
    "nvfp4": 0.5,
}
# KV cache bytes per element; "auto" is vLLM's default (the activation dtype, bf16 here).
# nvfp4 stores four-bit values with one fp8 (e4m3) scale per 16-element block, NVFP4's block
# size: 0.5 + 1/16 bytes per element, a whole number per token for head widths of 16k.
CACHE_BYTES: dict[str, float] = {
    "auto": 2,
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_ds_mla": 1,
    "nvfp4": 0.5625,
    "nvfp4_ds_mla": 0.5625,
}
# Cache formats only a Blackwell part's attention kernels read.
FOUR_BIT_CACHES = frozenset({"nvfp4", "nvfp4_ds_mla"})
# The packed DeepSeek latent caches, per token per layer (the Go kernel's constants): fp8 latent
# plus bf16 rope part and scales, 656 bytes instead of 576; the nvfp4 one 352.
PACKED_LATENT_BYTES: dict[str, int] = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _DataFile(_Strict):
    """A spec read from one YAML file; `digest` is the SHA-256 of the file's bytes."""

    _digest: str = PrivateAttr(default="")

    @property
    def digest(self) -> str:
        return self._digest


# Where a coefficient's value comes from: a sweep it was fitted on ("measured"), an end-to-end
# run it was backed out of ("fitted"), or a stated choice nobody measured ("assumed").
Basis = Literal["measured", "fitted", "assumed"]


class _Coefficients(_Strict):
    """A block of coefficients whose `basis` states, for each of them, where its value came from."""

    basis: dict[str, Basis]

    @model_validator(mode="after")
    def _every_coefficient_has_a_basis(self) -> _Coefficients:
        stated = set(self.basis)
        coefficients = set(type(self).model_fields) - {"basis", "source"}
        if stated != coefficients:
            raise ValueError(
                f"basis must name exactly {sorted(coefficients)}; "
                f"missing {sorted(coefficients - stated)}, unknown {sorted(stated - coefficients)}"
            )
        return self


# ----------------------------------------------------------------------------------- chips
class Ramp(_Strict):
    """A GEMM efficiency ramp: eps(m) = eps_max * m / (m + m_half)."""

    eps_max: float = Field(gt=0, le=1)
    m_half: float = Field(ge=0)


class GemmBlock(_Coefficients):
    """A chip's GEMM and memory coefficients: a ramp per compute lane, the HBM derate and memory-op
    latency, MoE imbalance."""

    source: str = Field(min_length=1)
    ramps: dict[str, Ramp] = Field(min_length=1)
    hbm_derate: float = Field(gt=0, le=1)
    hbm_constant_latency_us: float = Field(ge=0)  # each memory op's fixed cost
    moe_routing_imbalance: float = Field(gt=0)


class DecodeAttention(_Coefficients):
    """A decode attention kind's measured floor per layer and its KV read rate."""

    floor_us: float = Field(ge=0)
    rate_bytes_per_us: float = Field(gt=0)


class PrefillAttention(_Coefficients):
    """Prefill attention's measured floor per layer and its fraction of the GEMM rate."""

    floor_us: float = Field(ge=0)
    work_scale: float = Field(gt=0)


DecodeKind = Literal["full", "swa", "mla", "sparse_mla"]


class AttentionBlock(_Strict):
    """A chip's attention coefficients: decode per kind, prefill."""

    source: str = Field(min_length=1)
    decode: dict[DecodeKind, DecodeAttention] = {}
    prefill: PrefillAttention | None = None


CollectiveTriple = Annotated[list[Annotated[float, Field(gt=0)]], Field(min_length=3, max_length=3)]
CollectiveOp = Literal["all_reduce", "all_gather", "reduce_scatter", "all2all"]


class CollectivesBlock(_Strict):
    """A chip's measured collectives: per op and group width, [t0_us, r_t, r_peak]."""

    source: str = Field(min_length=1)
    basis: Basis  # one sweep per chip measured every width of every op
    # width -> [t0_us, r_t_bytes_per_us, r_peak_bytes_per_us]
    all_reduce: dict[int, CollectiveTriple] = {}
    all_gather: dict[int, CollectiveTriple] = {}
    reduce_scatter: dict[int, CollectiveTriple] = {}
    all2all: dict[int, CollectiveTriple] = {}


class HostBlock(_Coefficients):
    """A chip's host costs: graph replay, eager launches per layer, dispatch per kernel."""

    source: str = Field(min_length=1)
    replay_graph_us: float = Field(ge=0)
    eager_launch_per_layer_us: float = Field(ge=0)
    dispatch_per_kernel_us: float = Field(ge=0)


class HyperConnectionBlock(_Coefficients):
    """A chip's measured mHC kernels (DeepSeek-V4.1's hyper-connections): a fixed cost per
    hyper-connection, and the rate each of its two halves (the pre-mix that collapses the
    residual streams, the post-mix that writes them back) moves the streams' bytes at. The
    measured kernels include the small mixing GEMM."""

    source: str = Field(min_length=1)
    floor_us: float = Field(ge=0)
    pre_rate_bytes_per_us: float = Field(gt=0)
    post_rate_bytes_per_us: float = Field(gt=0)


class MeasuredEngine(_Strict):
    """The engine release whose sweep the chip's GEMM coefficients were fitted on: logs from
    another version are priced with coefficients nobody measured on it."""

    name: str = Field(min_length=1)
    version: str = Field(min_length=1)


class ChipSpec(_DataFile):
    """One chip file: datasheet figures and the measured coefficient blocks."""

    name: str = Field(min_length=1)
    source: str = Field(min_length=1)
    measured_engine: MeasuredEngine
    peak_tflops: dict[str, float] = Field(min_length=1)
    hbm_tb_s: float = Field(gt=0)
    memory_gib: float = Field(gt=0)
    nvlink_gb_s: float = Field(gt=0)
    inter_node_gb_s: float | None = Field(default=None, gt=0)
    sm_count: int = Field(gt=0)
    gpus_per_node: int = Field(gt=0)
    # A rack whose NVLink switch fabric spans all its GPUs at the per-GPU rate (GB200/GB300
    # NVL72): a group inside it never reaches inter_node_gb_s, however many nodes it spans.
    gpus_per_rack: int | None = Field(default=None, gt=0)
    gemm: GemmBlock
    attention: AttentionBlock
    collectives: CollectivesBlock
    host: HostBlock
    # Absent where no sweep measured the mHC kernels: they are then priced from the graph's bytes
    # and mixing GEMM.
    hyper_connections: HyperConnectionBlock | None = None

    @property
    def blackwell(self) -> bool:
        """Data-center Blackwell: the only parts with a native four-bit peak. vLLM keys its
        attention backend and its CUDA-graph capture sizes on this generation."""
        return "nvfp4" in self.peak_tflops

    @property
    def nvlink_domain(self) -> int:
        """GPUs one NVLink domain holds: the rack on a rack-scale part, else the node."""
        return self.gpus_per_rack or self.gpus_per_node

    @model_validator(mode="after")
    def _racks_hold_whole_nodes(self) -> ChipSpec:
        if self.gpus_per_rack is not None and self.gpus_per_rack % self.gpus_per_node:
            raise ValueError(
                f"gpus_per_rack {self.gpus_per_rack} is not a whole number of "
                f"{self.gpus_per_node}-GPU nodes"
            )
        return self

    @model_validator(mode="after")
    def _every_peak_has_a_ramp(self) -> ChipSpec:
        missing = sorted(set(self.peak_tflops) - set(self.gemm.ramps))
        if missing:
            raise ValueError(
                f"peak_tflops lists {missing} but gemm.ramps has no efficiency ramp for them"
            )
        return self


# ----------------------------------------------------------------------------------- models
# Collective emit conditions. Sequence-parallel MoE is not a deployment option here, so
# `tensor_parallel_unless_sp_moe` emits exactly when TP > 1; `expert_parallel` collectives emit
# when the deployment places experts across a MoE group of more than one rank.
Emit = Literal["always", "tensor_parallel", "tensor_parallel_unless_sp_moe", "expert_parallel"]


class _Node(_Strict):
    name: str = Field(min_length=1)


class GemmNode(_Node):
    """A dense GEMM: n outputs over a k-deep reduction per token."""

    op: Literal["gemm"]
    n: int = Field(gt=0)
    k: int = Field(gt=0)
    weight_dtype: str | None = None
    replicated: bool = False


class GroupedGemmNode(_Node):
    """A mixture-of-experts layer's routed experts (and its shared ones): n-wide, k-deep experts."""

    op: Literal["grouped_gemm"]
    n: int = Field(gt=0)  # expert intermediate width
    k: int = Field(gt=0)  # hidden
    experts: int = Field(gt=0)
    top_k: int = Field(gt=0)
    shared_experts: int = Field(default=0, ge=0)
    weight_dtype: str | None = None

    @model_validator(mode="after")
    def _top_k_fits(self) -> GroupedGemmNode:
        if self.top_k > self.experts:
            raise ValueError(f"top_k {self.top_k} exceeds experts {self.experts}")
        return self


class Indexer(_Strict):
    """A sparse layer's top-k selector: it scores every cached position with its own small
    single-head cache (keys and scales), replicated on every rank."""

    heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    cache_bytes_per_token: int = Field(gt=0)


class AttentionNode(_Node):
    """An attention op: its kind, heads and cached width, and a sparse layer's selection."""

    op: Literal["attention"]
    kind: Literal["gqa", "swa", "mla", "sparse_mla"]
    q_heads: int = Field(gt=0)
    kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    window: int | None = Field(default=None, gt=0)
    top_k: int | None = Field(default=None, gt=0)  # sparse_mla: positions the indexer selects
    compress_ratio: float | None = Field(default=None, ge=1)  # sparse_mla: compressed stream ratio
    indexer: Indexer | None = None  # sparse_mla: the scorer that selects top_k
    # Latent kinds: the expanded per-head widths prefill runs at (qk_nope + qk_rope, v_head_dim);
    # head_dim is the cached latent width decode reads.
    qk_head_dim: int | None = Field(default=None, gt=0)
    v_head_dim: int | None = Field(default=None, gt=0)
    # Latent kinds: the compressed width of head_dim (without the rope part), the width of the
    # per-head output a decode-context-parallel group combines.
    kv_lora_rank: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _kind_fields(self) -> AttentionNode:
        if self.kind == "swa" and self.window is None:
            raise ValueError("a swa attention needs a window")
        if self.kind == "sparse_mla" and self.top_k is None:
            raise ValueError("a sparse_mla attention needs top_k")
        if self.indexer is not None and self.kind != "sparse_mla":
            raise ValueError("an indexer selects for a sparse_mla attention only")
        if (self.qk_head_dim is None) != (self.v_head_dim is None):
            raise ValueError("qk_head_dim and v_head_dim are stated together")
        if (self.qk_head_dim is not None or self.kv_lora_rank is not None) and not self.latent:
            raise ValueError(
                "qk_head_dim/v_head_dim/kv_lora_rank describe a latent (mla) attention only"
            )
        return self

    @property
    def latent(self) -> bool:
        """A latent (MLA) cache: one compressed head per token, never sharded by TP."""
        return self.kind in ("mla", "sparse_mla")


RecurrentKind = Literal["mamba2", "gated_delta_net", "kda"]


class RecurrentNode(_Node):
    """A recurrent mixer: a Mamba2 (SSD) layer or a gated delta-net linear attention. Both are a
    chunked linear attention carrying, per request, one key_dim x value_dim state per value head
    (Mamba2: B and C are the keys and queries, x the values) plus a short causal convolution's
    last conv_kernel - 1 inputs, instead of a KV cache."""

    op: Literal["recurrent"]
    # The mixer family, which selects its measured coefficients where a registry has them
    # (`RecurrentRegistry`): Mamba2's SSD, Qwen3-Next's gated delta-net, Kimi's delta attention.
    kind: RecurrentKind
    key_heads: int = Field(gt=0)  # Mamba2 n_groups; delta-net linear_num_key_heads
    value_heads: int = Field(gt=0)  # Mamba2 num_heads; delta-net linear_num_value_heads
    key_dim: int = Field(gt=0)  # Mamba2 ssm_state_size; delta-net linear_key_head_dim
    value_dim: int = Field(gt=0)  # Mamba2 head_dim; delta-net linear_value_head_dim
    conv_kernel: int = Field(gt=1)
    chunk: int = Field(gt=0)  # tokens per chunk of the prefill scan
    state_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"

    @model_validator(mode="after")
    def _heads_group(self) -> RecurrentNode:
        if self.value_heads % self.key_heads:
            raise ValueError(
                f"key_heads {self.key_heads} must divide value_heads {self.value_heads}"
            )
        return self


class MixingGemm(_Strict):
    """The small GEMM that computes a hyper-connection's mixing weights from its streams."""

    n: int = Field(gt=0)  # (2 + streams) * streams: the pre, post and residual mixes
    k: int = Field(gt=0)  # streams * hidden


class HyperConnectionNode(_Node):
    """A manifold-constrained hyper-connection (mHC) around a sublayer: the residual is
    `streams` copies of the hidden state; a pre-mix collapses them into the sublayer's input and
    a post-mix writes the sublayer's output back into every stream. Every rank runs it whole on
    its own copy of the streams. `bytes_per_token` is the traffic the graph states (priced as
    memory traffic, with `mixing` as a GEMM) where the chip has no measured mHC form."""

    op: Literal["hyper_connection"]
    streams: int = Field(gt=1)
    bytes_per_token: int = Field(gt=0)
    mixing: MixingGemm


class ElementwiseNode(_Node):
    """A norm or activation: bytes read and written per token (default: the hidden state twice)."""

    op: Literal["elementwise"]
    bytes_per_token: int | None = Field(default=None, gt=0)


class CollectiveNode(_Node):
    """A collective a layer runs, with the condition under which it launches."""

    op: CollectiveOp
    emit: Emit


Node = Annotated[
    GemmNode
    | GroupedGemmNode
    | AttentionNode
    | RecurrentNode
    | HyperConnectionNode
    | ElementwiseNode
    | CollectiveNode,
    Field(discriminator="op"),
]


class LayerKind(_Strict):
    """One kind of layer: its nodes in order and how many times it repeats."""

    name: str = Field(min_length=1)
    repeat: int = Field(gt=0)
    nodes: list[Node] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_mixer_of_each_kind_one_expert_group(self) -> LayerKind:
        for cls in (AttentionNode, RecurrentNode, GroupedGemmNode):
            if sum(isinstance(n, cls) for n in self.nodes) > 1:
                raise ValueError(f"layer kind {self.name!r} has more than one {cls.__name__}")
        return self

    @property
    def attention(self) -> AttentionNode | None:
        """The layer's attention node, if any."""
        return next((n for n in self.nodes if isinstance(n, AttentionNode)), None)

    @property
    def recurrent(self) -> RecurrentNode | None:
        """The layer's recurrent mixer, if any."""
        return next((n for n in self.nodes if isinstance(n, RecurrentNode)), None)

    @property
    def experts(self) -> GroupedGemmNode | None:
        """The layer's routed experts, if any."""
        return next((n for n in self.nodes if isinstance(n, GroupedGemmNode)), None)


class HeadSpec(_Strict):
    """The output head: a vocabulary-wide GEMM over the hidden state."""

    n: int = Field(gt=0)  # vocabulary
    k: int = Field(gt=0)  # hidden
    weight_dtype: str | None = None


class DrafterSpec(_Strict):
    """A speculative drafter the model ships, named as a deployment selects it. A parallel-block
    drafter (DSpark) proposes all of a request's num_spec_tokens in one pass, so its rows are
    num_spec_tokens wide; its layers are stated to count the kernels it launches."""

    name: str = Field(min_length=1)
    kind: Literal["parallel_block"]
    source: str = Field(min_length=1)
    layer_kinds: list[LayerKind] = Field(min_length=1)


class ModelSpec(_DataFile):
    """One model file: its shapes, checkpoint dtype and graph of layer kinds."""

    name: str = Field(min_length=1)
    source: str = Field(min_length=1)
    weight_dtype: str
    hidden_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    # Stated KV bytes per token at TP 1 per cache dtype; checked against the graph so a typo in
    # an attention node cannot silently misprice memory.
    kv_bytes_per_token_tp1: dict[str, float] = {}
    layer_kinds: list[LayerKind] = Field(min_length=1)
    head: HeadSpec
    drafter: DrafterSpec | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ModelSpec:
        dtypes = [self.weight_dtype, self.head.weight_dtype]
        dtypes += [
            n.weight_dtype
            for kind in self.layer_kinds
            for n in kind.nodes
            if hasattr(n, "weight_dtype")
        ]
        unknown = sorted({d for d in dtypes if d is not None and d not in WEIGHT_BYTES})
        if unknown:
            raise ValueError(f"unknown weight dtype {unknown}; known: {sorted(WEIGHT_BYTES)}")
        for cache_dtype, stated in self.kv_bytes_per_token_tp1.items():
            if cache_dtype not in CACHE_BYTES:
                raise ValueError(f"kv_bytes_per_token_tp1: unknown cache dtype {cache_dtype!r}")
            derived = sum(
                kind.repeat * kv_bytes_per_token_layer(kind.attention, 1, cache_dtype)
                for kind in self.layer_kinds
                if kind.attention is not None
            )
            if derived != stated:
                raise ValueError(
                    f"kv_bytes_per_token_tp1[{cache_dtype}] states {stated:g} but the attention nodes give {derived:g}"
                )
        return self

    @model_validator(mode="after")
    def _has_attention(self) -> ModelSpec:
        if all(kind.attention is None for kind in self.layer_kinds):
            raise ValueError("no layer kind has an attention node")
        return self

    @property
    def layers(self) -> int:
        """Layers in the model (every kind's repeats)."""
        return sum(kind.repeat for kind in self.layer_kinds)


def kv_bytes_per_token_layer(attention: AttentionNode, tp: int, cache_dtype: str) -> float:
    """KV bytes one token occupies in one layer on one rank.

    Keys and values are two tensors, a latent one; KV heads shard across TP down to one head
    per rank (replicated beyond), and a latent head is never sharded.
    """
    if attention.latent and cache_dtype in PACKED_LATENT_BYTES:
        return PACKED_LATENT_BYTES[cache_dtype]
    tensors = 1 if attention.latent else 2
    heads_per_rank = 1 if attention.latent else max(1, -(-attention.kv_heads // tp))
    return tensors * heads_per_rank * attention.head_dim * CACHE_BYTES[cache_dtype]


# ----------------------------------------------------------------------------------- registry
class MeasuredMixer(_Coefficients):
    """One recurrent family's decode cost on one part: a launch floor plus a token rate."""

    floor_us: float = Field(ge=0)
    tokens_per_us: float = Field(gt=0)


class RecurrentRegistry(_DataFile):
    """The Go kernel's recurrent registry entries, per chip and mixer family. Only the Go kernel
    prices from them (`compat="go"`): the one measured family, Mamba2, is its convolution alone."""

    name: str = Field(min_length=1)
    source: str = Field(min_length=1)
    chips: dict[str, dict[RecurrentKind, MeasuredMixer]]


# ----------------------------------------------------------------------------------- loading
Spec = TypeVar("Spec", ChipSpec, ModelSpec, RecurrentRegistry)
REGISTRY_DIR = Path(__file__).resolve().parent / "registry"


def _load(directory: Path, name: str, what: str, spec_type: type[Spec]) -> Spec:
    path = directory / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in directory.glob("*.yaml")))
        raise PricingError(f"unknown {what} {name!r}: no {path} (known {what}s: {known})")
    content = path.read_bytes()
    try:
        raw = yaml.safe_load(content)
    except yaml.YAMLError as err:
        raise PricingError(f"{path}: not valid YAML: {err}") from err
    try:
        spec = spec_type.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise PricingError(f"{path}: field {field}: {first['msg']}") from err
    if spec.name != name:
        raise PricingError(
            f"{path}: field name: {spec.name!r} does not match the file name {name!r}"
        )
    spec._digest = hashlib.sha256(content).hexdigest()
    return spec


@cache
def load_chip(name: str) -> ChipSpec:
    """The chip `pricing/chips/<name>.yaml` (case-insensitive name)."""
    return _load(CHIPS_DIR, name.lower(), "chip", ChipSpec)


@cache
def load_model(name: str) -> ModelSpec:
    """The model graph `pricing/models/<name>.yaml` (case-insensitive name)."""
    return _load(MODELS_DIR, name.lower(), "model", ModelSpec)


@cache
def load_recurrent_registry() -> RecurrentRegistry:
    """The Go kernel's recurrent mixer coefficients, `pricing/registry/recurrent.yaml`."""
    return _load(REGISTRY_DIR, "recurrent", "registry", RecurrentRegistry)


def chip_names() -> list[str]:
    """Every chip with a file under `pricing/chips/`."""
    return sorted(p.stem for p in CHIPS_DIR.glob("*.yaml"))


def model_names() -> list[str]:
    """Every model with a graph under `pricing/models/`."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.yaml"))
