"""Resources, chosen by environment: STEPLEDGER_DATA (the data directory: outboxes, gateway
logs, DCGM scrapes, the Parquet lake) and STEPLEDGER_WAREHOUSE (the pipeline's DuckDB state file,
by default `pipeline.duckdb` in the data directory; the DuckLake warehouse is next to it)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg
import duckdb
from dagster_duckdb import DuckDBResource

from pipeline.datadir import DATA_ENV, DataDir
from pipeline.storage.warehouse import WRITER_CONFIG, open_state, postgres_from_env

WAREHOUSE_ENV = "STEPLEDGER_WAREHOUSE"
DUCKDB_POOL = "duckdb"
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


def state_pool() -> str | None:
    """The Dagster pool of the steps that write the pipeline's state: `duckdb` (limit 1) for
    the embedded file, which one process writes at a time; none with the state in PostgreSQL
    (STEPLEDGER_POSTGRES), whose transactions lock only the rows of their own pool-hour."""
    return None if postgres_from_env() else DUCKDB_POOL


def build_resources(
    data_dir: Path, warehouse: Path | None = None
) -> dict[str, dg.ConfigurableResource[Any]]:
    return {
        "data": StepledgerData(data_dir=str(data_dir)),
        "warehouse": DuckDBResource(
            database=str(warehouse or warehouse_path(data_dir)), connection_config=WRITER_CONFIG
        ),
    }


# Another process holding the state file's lock is waited for, doubling from 0.1 s for about
# 100 s in all (as DuckDBResource's own retry); nothing else is retried.
_LOCK_RETRIES = 10
_FIRST_LOCK_WAIT_S = 0.1


@contextmanager
def open_warehouse(warehouse: DuckDBResource) -> Iterator[duckdb.DuckDBPyConnection]:
    """A read/write connection to the pipeline's state with the schema applied: the embedded
    file, or the PostgreSQL store STEPLEDGER_POSTGRES names. The file's directory is created
    first. A file that cannot be opened (a directory, no permission, a full disk) fails at
    once; only another process's lock on it is waited for."""
    con = open_state(
        Path(warehouse.database),
        postgres_from_env(),
        lambda path: _connect_waiting_for_lock(path, warehouse.connection_config),
    )
    try:
        yield con
    finally:
        con.close()


def _connect_waiting_for_lock(path: Path, config: dict[str, Any]) -> duckdb.DuckDBPyConnection:
    wait_s = _FIRST_LOCK_WAIT_S
    for _ in range(_LOCK_RETRIES - 1):
        try:
            return duckdb.connect(str(path), read_only=False, config=config)
        except duckdb.IOException as err:
            if "lock" not in str(err).lower():
                raise
        time.sleep(wait_s)
        wait_s *= 2
    return duckdb.connect(str(path), read_only=False, config=config)
