"""A data directory's layout: what one deployment keeps where, for the CLI, the Dagster
resources and the benchmarks alike.

    outbox/<replica>/*.seg     step-log segments, as the engine hook writes them
    gateway/<hour>.jsonl       the gateway's request context, one file per UTC hour
    dcgm/<host>/<hour>.prom    DCGM exporter scrapes
    lake/                      the Parquet lake (pipeline.lake)
    pools.yaml                 the pools, when the directory has its own
    calibration.yaml           the calibrated work-model coefficients
    warehouse.duckdb           the warehouse, unless one is named elsewhere
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from pipeline.hours import parse_hour_key
from schemas.config import DEFAULT_POOLS_PATH

CALIBRATION_FILE = "calibration.yaml"
POOLS_FILE = "pools.yaml"
WAREHOUSE_FILE = "warehouse.duckdb"


def pools_file(data_dir: Path) -> Path:
    """The data directory's own pools file, else the default pools."""
    own = data_dir / POOLS_FILE
    return own if own.is_file() else DEFAULT_POOLS_PATH


def hours_in_data(data_dir: Path) -> list[datetime]:
    """The hours the gateway logged requests for (one file per hour)."""
    return sorted(parse_hour_key(p.stem) for p in (data_dir / "gateway").glob("*.jsonl"))
