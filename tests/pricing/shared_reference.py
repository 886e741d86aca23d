"""The references the kernel is checked against: the Go kernel's golden deployment, and the
shared data (Go grid, measured TPOT sweeps).

The data lives beside the repository, in `<repo>/../shared/reference/pricing/`, as CI lays it
out; STEPLEDGER_SHARED names another copy. Tests that need it skip, saying where they looked,
when it is absent.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pricing import Deployment

# The Go kernel's published step anatomy (golden_steps.yaml): DeepSeek-V3 fp8 on 8x H200, TP8,
# piecewise graphs, decode threshold 8.
GOLDEN = Deployment(
    model="deepseek-v3",
    chip="h200",
    dtype="fp8",
    cache_dtype="fp8",
    tp=8,
    cudagraph_mode="PIECEWISE",
    max_num_seqs=256,
    decode_threshold=8,
    compat="go",
)
REPO = Path(__file__).resolve().parents[2]


def reference_file(relative: str) -> Path:
    shared = Path(os.environ.get("STEPLEDGER_SHARED", REPO.parent / "shared"))
    path = shared / "reference" / "pricing" / relative
    if not path.is_file():
        pytest.skip(
            f"shared reference {path} is absent (place shared/ beside the repository or set "
            "STEPLEDGER_SHARED)"
        )
    return path
