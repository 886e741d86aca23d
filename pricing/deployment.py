"""What the kernel prices: one serving replica's model, chip, parallelism and engine settings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from pricing.spec import load_chip

if TYPE_CHECKING:
    from schemas.config import Pool


def _upper(value: object) -> object:
    return value.upper() if isinstance(value, str) else value


# vLLM's CompilationConfig.cudagraph_mode names; any case is accepted, as vLLM's own parser does.
CudagraphMode = Annotated[
    Literal["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"],
    BeforeValidator(_upper),
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


def deployment_for_pool(pool: Pool) -> Deployment:
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
