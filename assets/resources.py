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

from pipeline.datadir import DATA_ENV, DataDir
from pipeline.storage.warehouse import WRITER_CONFIG, apply_schema

WAREHOUSE_ENV = "STEPLEDGER_WAREHOUSE"
DEFAULT_DATA_DIR = "demo-run"


class StepledgerData(dg.ConfigurableResource["StepledgerData"]):
    """Where one deployment's files live."""

    data_dir: str

    @property
    def layout(self) -> DataDir:
        return DataDir(Path(self.data_dir))


def data_dir_from_env() -> Path:
    return Path(os.environ.get(DATA_ENV, DEFAULT_DATA_DIR)).resolve()


def warehouse_path(data_dir: Path) -> Path:
    return Path(os.environ.get(WAREHOUSE_ENV, DataDir(data_dir).state_file)).resolve()


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
