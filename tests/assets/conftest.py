from __future__ import annotations

import sys
from pathlib import Path

import pytest

# pytest runs in importlib mode, which does not put test folders on the import path.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from assets_fleet import HOURS, small_pools


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeline.simulator import simulate

    out = tmp_path_factory.mktemp("sim") / "run"
    simulate(out, small_pools(), hours=HOURS, seed=7)
    return out
