"""The shared reference data the kernel is checked against (Go grid, measured TPOT sweeps).

It lives beside the repository, in `<repo>/../shared/reference/pricing/`, as CI lays it out;
STEPLEDGER_SHARED names another copy. Tests that need it skip, saying where they looked, when
it is absent.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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
