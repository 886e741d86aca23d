"""Simulated input kept between benchmark runs, so a second `make bench` times the pipeline
alone and benchmarks that bill the same input simulate it once.

The cache is STEPLEDGER_BENCH_CACHE (by default `stepledger-bench-cache` in the system temp
directory). An input is keyed by its pools, hours, seed and the simulator's options, and by the
source of everything that shapes what the simulator writes (the simulator, the hook's recorder,
the pricing kernel and its data, the schemas): a changed simulator simulates afresh. A cached
directory is shared and never written by a benchmark: `run_directory` links its inputs into a
directory of the run's own, which the pipeline writes its outputs into.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.datadir import DataDir

if TYPE_CHECKING:
    from schemas.config import PoolsFile

CACHE = Path(
    os.environ.get("STEPLEDGER_BENCH_CACHE", Path(tempfile.gettempdir()) / "stepledger-bench-cache")
)
REPO = Path(__file__).resolve().parent.parent
# What the simulator's output depends on besides its arguments.
SOURCES = ("pipeline/simulator", "pipeline/hook", "pricing", "schemas")
# The simulated inputs of a data directory: the replicas' segments, the gateway's request
# logs, the GPUs' telemetry and the pools simulated.
INPUTS = ("outbox", "gateway", "dcgm", "own_pools_file")


def _sources_digest() -> str:
    digest = hashlib.sha256()
    for top in SOURCES:
        for path in sorted((REPO / top).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(REPO)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


def simulated(name: str, pools: PoolsFile, *, hours: float, seed: int, **options: Any) -> Path:
    """The data directory of `pools` simulated for `hours` hours with `seed` (and the
    simulator's keyword `options`), from the cache when a run simulated it already. Read only:
    see `run_directory`."""
    from pipeline.simulator import simulate

    key = hashlib.sha256()
    key.update(pools.model_dump_json().encode())
    key.update(json.dumps([hours, seed, sorted(options.items())]).encode())
    key.update(_sources_digest().encode())
    data = CACHE / f"{name}-{key.hexdigest()[:16]}"
    if (data / "complete").is_file():
        return data
    CACHE.mkdir(parents=True, exist_ok=True)
    # Simulated beside the cache entry and renamed into place: a run interrupted, or another
    # run simulating the same input at once, never leaves a partial entry.
    partial = Path(tempfile.mkdtemp(prefix=f"{data.name}-", dir=CACHE))
    try:
        simulate(partial / "data", pools, hours=hours, seed=seed, **options)
        (partial / "data" / "complete").write_text("simulated\n")
        try:
            (partial / "data").rename(data)
        except OSError:
            # Another run put the same input there first.
            if not (data / "complete").is_file():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return data


def run_directory(data: Path, run: Path) -> Path:
    """A new data directory `run` whose inputs are links to the simulated `data`'s."""
    run.mkdir(parents=True)
    source, copy = DataDir(data), DataDir(run)
    for name in INPUTS:
        getattr(copy, name).symlink_to(getattr(source, name))
    return run
