"""What the kernel prices: one serving replica's model, chip, parallelism and engine settings."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator


def _upper(value: object) -> object:
    return value.upper() if isinstance(value, str) else value


# vLLM's CompilationConfig.cudagraph_mode names; any case is accepted, as vLLM's own parser does.
CudagraphMode = Annotated[
    Literal["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"],
    BeforeValidator(_upper),
]
# vLLM's --all2all-backend choices the kernel prices: the default gathers every token to every
# rank of the MoE group; the others send each token to the ranks of its top_k experts.
All2AllBackend = Literal[
    "allgather_reducescatter", "deepep_low_latency", "deepep_high_throughput", "pplx"
]
# vLLM's per-batch choice: (uniform decode or empty batch, any other batch).
GRAPH_MODES: dict[str, tuple[str, str]] = {
    "PIECEWISE": ("piecewise", "piecewise"),
    "FULL": ("full", "full"),
    "FULL_AND_PIECEWISE": ("full", "piecewise"),
    "FULL_DECODE_ONLY": ("full", "none"),
    "NONE": ("none", "none"),
}


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
    # Attention data parallelism: `data_parallel` attention replicas of `tp` ranks each feed one
    # MoE group of tp * data_parallel ranks (vLLM --data-parallel-size with a MoE model).
    data_parallel: int = Field(default=1, gt=0)
    # Experts placed whole across the MoE group instead of sharded (vLLM --enable-expert-parallel),
    # with EPLB's redundant physical experts added to the placement.
    expert_parallel: bool = False
    eplb_redundant_experts: int = Field(default=0, ge=0)
    all2all_backend: All2AllBackend = "allgather_reducescatter"
    # Decode context parallelism: each token's KV lives on one of `decode_context_parallel`
    # ranks of the TP group, which all-gather their queries and combine partial outputs
    # (vLLM --decode-context-parallel-size).
    decode_context_parallel: int = Field(default=1, gt=0)
    # Prefill context parallelism: each prefill chunk is split zigzag over
    # `prefill_context_parallel` groups of `tp` ranks, which all-gather the KV they computed
    # (vLLM --prefill-context-parallel-size; latent-attention models only).
    prefill_context_parallel: int = Field(default=1, gt=0)
    # SMs the forward pass runs on when a concurrent kernel (a KV offload fetch, a
    # disaggregated transfer) withholds the rest; None = every SM of the chip.
    sm_budget: int | None = Field(default=None, gt=0)
    # The speculative drafter proposing the num_spec_tokens, by the name the model file gives it
    # (vLLM --speculative-config method); None = no drafter of its own is priced.
    drafter: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _expert_placement(self) -> Deployment:
        if self.tp % self.decode_context_parallel:
            raise ValueError(
                f"decode_context_parallel {self.decode_context_parallel} does not divide tp {self.tp}"
            )
        if self.eplb_redundant_experts and not self.expert_parallel:
            raise ValueError("eplb_redundant_experts needs expert_parallel")
        if self.all2all_backend != "allgather_reducescatter" and not self.expert_parallel:
            raise ValueError(f"all2all_backend {self.all2all_backend!r} needs expert_parallel")
        if self.drafter is not None and self.num_spec_tokens < 1:
            raise ValueError(f"drafter {self.drafter!r} needs num_spec_tokens >= 1")
        return self

    @property
    def moe_group(self) -> int:
        """Ranks the routed experts span: every TP rank of every attention DP replica."""
        return self.tp * self.data_parallel
