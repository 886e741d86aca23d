"""Materialize one pool-hour of a data directory in this process, for the crash tests.

    python -m tests.hardening.materialize_hour DATA POOL YYYY-MM-DDTHH [--die-before-ingest-commit]

(from the repository root).

Prints "ready" once the definitions are built, "stage <name>" as each stage of the hour
begins (so a test can aim a kill at any of them), then "done" when the run has finished.
`--die-before-ingest-commit` SIGKILLs the process at the moment ingestion has written its
Parquet files and is about to record them in the warehouse.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from pathlib import Path
from unittest import mock


def announced(name: str, function):
    def stage(*args, **kwargs):
        print(f"stage {name}", flush=True)
        return function(*args, **kwargs)

    return stage


def main(argv: list[str]) -> None:
    import dagster as dg

    from assets import pool_hour, reconciliation
    from assets.definitions import build_definitions
    from assets.partitions import partition_key
    from assets.runner import QUIET_RUN_CONFIG as QUIET
    from pipeline.datadir import DataDir
    from pipeline.ingestion import gateway, ingest
    from pipeline.storage import lake
    from schemas.config import load_pools
    from schemas.units import parse_hour_key

    warnings.filterwarnings("ignore")
    data, pool, hour = Path(argv[0]), argv[1], parse_hour_key(argv[2])
    if "--die-before-ingest-commit" in argv:

        def die(con):
            os.kill(os.getpid(), signal.SIGKILL)

        # Ingestion commits through the `transaction` it imports from the warehouse module;
        # the process is killed before the patch would need undoing.
        mock.patch.object(ingest, "transaction", die).start()
    stages = [
        (pool_hour, "ingest_outbox"),
        (gateway, "load_gateway_files"),
        (lake, "save_inputs"),
        (pool_hour, "attribute_pool_hour"),
        (lake, "save_ledger"),
        (pool_hour, "publish_hour"),
        (reconciliation, "reconcile_hour"),
    ]
    for module, name in stages:
        setattr(module, name, announced(name, getattr(module, name)))
    job = build_definitions(
        load_pools(DataDir(data).pools_file), data, run_hours=[hour]
    ).resolve_job_def("pool_hour_job")
    print("ready", flush=True)
    job.execute_in_process(
        partition_key=partition_key(hour, pool),
        instance=dg.DagsterInstance.ephemeral(),
        run_config=QUIET,
        raise_on_error=False,
    )
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
