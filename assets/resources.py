"""Resources, chosen by environment: STEPLEDGER_DATA (the data directory: outboxes, gateway
logs, DCGM scrapes, the Parquet lake) and STEPLEDGER_WAREHOUSE (the pipeline's DuckDB state file,
by default `pipeline.duckdb` in the data directory; the DuckLake warehouse is next to it)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg
import duckdb
from dagster_duckdb import DuckDBResource

from pipeline.datadir import CALIBRATION_FILE, pools_file
from pipeline.storage.warehouse import STATE_FILE, WRITER_CONFIG, apply_schema

DATA_ENV = "STEPLEDGER_DATA"
WAREHOUSE_ENV = "STEPLEDGER_WAREHOUSE"
DEFAULT_DATA_DIR = "demo-run"


class StepledgerData(dg.ConfigurableResource["StepledgerData"]):
    """Where one deployment's files live."""

    data_dir: str

    @property
    def root(self) -> Path:
        return Path(self.data_dir)

    @property
    def outbox(self) -> Path:
        return self.root / "outbox"

    @property
    def gateway(self) -> Path:
        return self.root / "gateway"

    @property
    def dcgm(self) -> Path:
        return self.root / "dcgm"

    @property
    def lake(self) -> Path:
        return self.root / "lake"

    @property
    def pools_file(self) -> Path:
        return pools_file(self.root)

    @property
    def calibration_file(self) -> Path:
        return self.root / CALIBRATION_FILE


def data_dir_from_env() -> Path:
    return Path(os.environ.get(DATA_ENV, DEFAULT_DATA_DIR)).resolve()


def warehouse_path(data_dir: Path) -> Path:
    return Path(os.environ.get(WAREHOUSE_ENV, data_dir / STATE_FILE)).resolve()


def build_resources(
    data_dir: Path, warehouse: Path | None = None
) -> dict[str, dg.ConfigurableResource[Any]]:
    return {
        "data": StepledgerData(data_dir=str(data_dir)),
        "warehouse": DuckDBResource(
            database=str(warehouse or warehouse_path(data_dir)), connection_config=WRITER_CONFIG
        ),
    }


@contextmanager
def open_warehouse(warehouse: DuckDBResource) -> Iterator[duckdb.DuckDBPyConnection]:
    """A read/write warehouse connection with the schema applied. The file's directory is
    created first: DuckDBResource retries a failing connect for about 100 s before giving up."""
    Path(warehouse.database).parent.mkdir(parents=True, exist_ok=True)
    with warehouse.get_connection() as con:
        # DuckDBResource closes the connection only when the block ends without an error; one
        # left open would refuse every later connection to the file in this process (another
        # configuration), hiding the error behind a connection error.
        try:
            apply_schema(con)
            yield con
        finally:
            con.close()
