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

from assets.partitions import pool_hours_of_run
from pipeline.datadir import DATA_ENV, DataDir
from pipeline.storage.hour_lock import pool_hour_locks
from pipeline.storage.warehouse import WRITER_CONFIG, open_state, postgres_from_env

WAREHOUSE_ENV = "STEPLEDGER_WAREHOUSE"
DUCKDB_POOL = "duckdb"
POOL_HOUR_LOCK = "pool_hour_lock"
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


def pool_hour_lock(
    partitions: dg.MultiPartitionsDefinition, data_dir: Path, warehouse: Path | None = None
) -> dg.ResourceDefinition:
    """The lock of the run's pool-hours (pipeline.storage.hour_lock), taken when the run
    starts and held until it ends: every step of the pool-hour job requires it, and its
    in-process executor sets resources up once per run. A second run of a pool-hour, from any
    path (schedule, sensor, backfill, `stepledger run`), waits for the first's whole billing."""
    state_file = warehouse or warehouse_path(data_dir)

    @dg.resource(description="Held for the whole run: one billing of a pool-hour at a time.")
    def held_for_the_run(context: dg.InitResourceContext) -> Iterator[None]:
        run = context.dagster_run
        if run is None:
            # Set up outside a run (a sensor given every resource): nothing is billed there.
            yield None
            return
        held = [(p.pool, p.hour) for p in pool_hours_of_run(run.tags, partitions)]
        with pool_hour_locks(held, state_file, postgres_from_env()):
            yield None

    return held_for_the_run


# Another process holding the state file's lock is waited for, doubling from 0.1 s for about
# 100 s in all (as DuckDBResource's own retry); nothing else is retried.
_LOCK_RETRIES = 10
_FIRST_LOCK_WAIT_S = 0.1


@contextmanager
def open_warehouse(
    warehouse: DuckDBResource, *, ledger: bool = True
) -> Iterator[duckdb.DuckDBPyConnection]:
    """A read/write connection to the pipeline's state with the schema applied: the embedded
    file, or the PostgreSQL store STEPLEDGER_POSTGRES names; with `ledger`, the warehouse
    attached. The file's directory is created first. A file that cannot be opened (a
    directory, no permission, a full disk) fails at once; only another process's lock on it
    is waited for. The steps of a billing read tables only, never the finance views:
    defining those (0.05 s of binding) is left out. A step that works on the state alone
    leaves the warehouse out: its first query loads the catalog (0.05-0.1 s)."""
    con = open_state(
        Path(warehouse.database),
        postgres_from_env(),
        lambda path: _connect_waiting_for_lock(path, warehouse.connection_config),
        ledger=ledger,
        views=False,
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
