"""The references the kernel is checked against: the Go kernel's golden deployment, and the
shared data (Go grid, measured TPOT sweeps).

The shared data is read from `<repo>/../shared/reference/pricing/` when it is laid out beside
the repository (STEPLEDGER_SHARED names another copy), else from the copy kept in
`tests/pricing/reference/` (the Go grid gzipped), so a clone alone runs every check.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import Any

from pricing import Deployment


def fp8_piecewise(
    model: str, chip: str, *, tp: int, max_num_seqs: int, **settings: Any
) -> Deployment:
    """A deployment served as vLLM serves the references: fp8 weights and KV cache, piecewise
    CUDA graphs; `settings` are the rest of its fields."""
    return Deployment(
        model=model,
        chip=chip,
        dtype="fp8",
        cache_dtype="fp8",
        tp=tp,
        cudagraph_mode="PIECEWISE",
        max_num_seqs=max_num_seqs,
        **settings,
    )


# The Go kernel's published step anatomy (golden_steps.yaml): DeepSeek-V3 fp8 on 8x H200, TP8,
# piecewise graphs, decode threshold 8.
GOLDEN = fp8_piecewise(
    "deepseek-v3", "h200", tp=8, max_num_seqs=256, decode_threshold=8, compat="go"
)
REPO = Path(__file__).resolve().parents[2]


VENDORED = Path(__file__).resolve().parent / "reference"


def reference_file(relative: str) -> Path:
    """The shared reference file `relative` (e.g. `go_grid/cases.jsonl`), or its kept copy."""
    shared = Path(os.environ.get("STEPLEDGER_SHARED", REPO.parent / "shared"))
    for path in (
        shared / "reference" / "pricing" / relative,
        VENDORED / relative,
        VENDORED / f"{relative}.gz",
    ):
        if path.is_file():
            return path
    raise FileNotFoundError(f"{relative}: neither under {shared} nor in {VENDORED}")


def read_reference_text(path: Path) -> str:
    return gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
