"""What the benchmarks' QUICK runs build on: the pool-hour's extrapolation counts an hour's
fixed cost once, and a simulated input is simulated once and never written by a run."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import simulated as simulated_module
from benchmarks.bench_pool_hour import full_hour
from benchmarks.simulated import run_directory, simulated
from pipeline.datadir import DataDir
from tests.helpers.fleets import small_pools


def test_quick_pool_hour_counts_the_fixed_cost_once_and_scales_the_data() -> None:
    # Cold minute 5 s, warm minute 2 s, 21 replica-minutes 4 s: 0.1 s per replica-minute, so
    # the 480 replica-minutes of 8 replicas for an hour are 5 + 0.1 x 479.
    runs = [{"wall_s": 5.0}, {"wall_s": 2.0}, {"wall_s": 4.0}]
    assert full_hour({"runs": runs}, [1, 1, 21], "wall_s") == pytest.approx(52.9)
    # The full run is measured, not extrapolated.
    assert full_hour({"runs": [{"wall_s": 17.5}]}, [480], "wall_s") == 17.5


def test_an_input_is_simulated_once_and_runs_link_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(simulated_module, "CACHE", tmp_path / "cache")
    pools = small_pools()
    data = simulated("small", pools, hours=1 / 360, seed=7)
    segments = sorted(DataDir(data).outbox.rglob("*"))
    assert segments
    assert simulated("small", pools, hours=1 / 360, seed=7) == data
    assert simulated("small", pools, hours=1 / 360, seed=8) != data
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        [data.name, simulated("small", pools, hours=1 / 360, seed=8).name]
    )
    run = run_directory(data, tmp_path / "run")
    assert sorted(DataDir(run).outbox.rglob("*")) != []
    assert DataDir(run).outbox.resolve() == DataDir(data).outbox
    assert DataDir(run).pools_file.resolve() == DataDir(data).own_pools_file
