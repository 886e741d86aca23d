"""A data directory's layout: what one deployment keeps where, for the CLI, the Dagster
resources and the benchmarks alike.

    outbox/<replica>/*.seg     step-log segments, as the engine hook writes them
    gateway/<hour>.jsonl       the gateway's request context, one file per UTC hour
    dcgm/<host>/<hour>.prom    DCGM exporter scrapes
    lake/                      the Parquet lake (pipeline.storage.lake)
    pools.yaml                 the pools, when the directory has its own
    calibration.yaml           the calibrated work-model coefficients
    pipeline.duckdb            the pipeline's state (pipeline.storage.warehouse.STATE_FILE)
    warehouse/                 the DuckLake warehouse (its catalog and data files)
    warehouse.duckdb           the warehouse of the previous layout, one DuckDB file

`check_output` keeps a command's output file from replacing any of these.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

from pipeline.hours import parse_hour_key
from pipeline.storage.warehouse import PREVIOUS_LAYOUT_FILE, STATE_FILE, WAREHOUSE_DIR
from schemas.config import DEFAULT_POOLS_PATH

CALIBRATION_FILE = "calibration.yaml"
POOLS_FILE = "pools.yaml"


def pools_file(data_dir: Path) -> Path:
    """The data directory's own pools file, else the default pools."""
    own = data_dir / POOLS_FILE
    return own if own.is_file() else DEFAULT_POOLS_PATH


def hours_in_data(data_dir: Path) -> list[datetime]:
    """The hours the gateway logged requests for (one file per hour)."""
    return sorted(parse_hour_key(p.stem) for p in (data_dir / "gateway").glob("*.jsonl"))


# What a data directory holds that a command's output must never replace: its inputs, the
# lake, the pipeline's state and the warehouse (a directory with everything beneath it).
# The redelivery directory holds intact copies of damaged segments.
PROTECTED = (
    "outbox",
    "gateway",
    "dcgm",
    "lake",
    "redelivery",
    WAREHOUSE_DIR,
    POOLS_FILE,
    CALIBRATION_FILE,
    STATE_FILE,
    PREVIOUS_LAYOUT_FILE,
)
# Files a DuckDB or SQLite database keeps beside itself while it is open.
_SIDECARS = (".wal", "-wal", "-journal", "-shm")


class OutputPathError(ValueError):
    """An output path would replace an input, a data directory's file or the warehouse."""


def check_output(out: Path, data_dir: Path, inputs: Iterable[Path] = ()) -> Path:
    """`out` resolved, unless writing it would replace a file of `data_dir` (PROTECTED, or
    beneath a PROTECTED directory), one of `inputs` (files the command reads, e.g. a warehouse
    named elsewhere), or a database's sidecar of either. Symlinks are followed on both sides,
    as opening `out` would; an existing `out` that is a hard link of a protected file counts
    as that file."""
    target = out.resolve()
    root = data_dir.resolve()
    protected = [(root / name, f"the data directory's {name}") for name in PROTECTED]
    protected += [(path.resolve(), "an input of this command") for path in inputs]
    for path, what in protected:
        sidecars = [path.with_name(path.name + suffix) for suffix in _SIDECARS]
        if target in sidecars:
            what = f"a file its database keeps beside {what}"
        elif target != path and target.is_relative_to(path):
            what = f"inside {what}"
        elif target != path and not (
            target.is_file() and path.is_file() and os.path.samefile(target, path)
        ):
            continue
        raise OutputPathError(
            f"{out}: refusing to write there, it is {what} ({path}); choose an output path "
            "outside the data directory's inputs, lake and warehouse"
        )
    return target
