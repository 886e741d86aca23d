"""Pool-hours materialized through the Dagster definitions on the data directory's persistent
instance (DAGSTER_HOME when set, else DATA/dagster), so that the UI shows them afterwards (partitions, runs, check results):

    python -m assets.runner --data DIR --hour YYYY-MM-DDTHH [--hour ...] [--warehouse FILE]

One JSON object per line on standard output, per finished pool-hour: hour, pool, success (of
the run), held_back (a blocking check failed: the finance views leave the hour out),
failed_checks ("ERROR name: detail" or "WARN name: detail"), error (the first step failure
that is not a failed check), run_id.
The command line (`stepledger demo`) starts this as a process of its own: pipeline/ names the
code location but never imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import dagster as dg
import sqlalchemy.exc

from assets.definitions import build_definitions
from assets.partitions import partition_key
from pipeline.cli.dagster_instance import instance_dir, instance_unwritable, prepare_instance
from pipeline.datadir import DataDir
from schemas.config import load_pools
from schemas.units import hour_key, parse_hour_key

# Dagster's console logger prints every step event; the caller reports per pool-hour instead.
QUIET_RUN_CONFIG = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
CHECK_FAILURES = ("DagsterAssetCheckFailedError", "Failure")


def root_cause(error: dg.SerializableErrorInfo) -> str:
    """What a step failure says failed: Dagster wraps it as "Error occurred while executing
    op ...", and the file, record or field that failed is named by the first error it wraps
    (not by that error's own causes: a parser's error beneath "gateway/05.jsonl:12: field
    tenant" knows the field but not the file)."""
    while error.cause is not None and error.cls_name.startswith("Dagster"):
        error = error.cause
    return str(error.message).strip()


def pool_hour_outcome(result: dg.ExecuteInProcessResult) -> dict[str, Any]:
    """What became of one pool-hour run: see the module's docstring."""
    errors = []
    step_failures = result.get_step_failure_events()
    for event in step_failures:
        error = event.step_failure_data.error
        # A failed check also fails the check step (a blocking one, or an ERROR of the
        # others): that is a finding, listed with the checks, not an error.
        if event.step_key == "reconciliation" and error and error.cls_name in CHECK_FAILURES:
            continue
        errors.append(root_cause(error) if error else f"step {event.step_key} failed")
    if not result.success and not step_failures:
        # The run failed before any step ran (a resource that could not be set up, such as the
        # pool-hour's lock): its failure event carries the error.
        failures = [
            getattr(event.event_specific_data, "error", None)
            for event in result.all_events
            if event.event_type == dg.DagsterEventType.RUN_FAILURE
        ]
        errors = [root_cause(error) for error in failures if error is not None] or [
            "the run failed before any step ran"
        ]
    evaluations = result.get_asset_check_evaluations()
    return {
        "success": result.success,
        "held_back": any(
            e.blocking and not e.passed and e.severity == dg.AssetCheckSeverity.ERROR
            for e in evaluations
        ),
        "failed_checks": [
            f"{e.severity.value} {e.check_name}: {e.metadata['detail'].value}"
            for e in evaluations
            if not e.passed
        ],
        "error": errors[0] if errors else None,
        "run_id": result.run_id,
    }


def execute_pool_hours(
    data_dir: Path, hours: list[datetime], warehouse: Path | None, instance: dg.DagsterInstance
) -> Iterator[tuple[datetime, str, dg.ExecuteInProcessResult]]:
    """Run the pool-hour job of every pool for each of `hours` in turn, in-process on
    `instance` and quietly; yields each run's hour, pool and result."""
    warnings.filterwarnings("ignore", module="dagster")
    pools = load_pools(DataDir(data_dir).pools_file)
    defs = build_definitions(
        pools,
        data_dir.resolve(),
        warehouse.resolve() if warehouse else None,
        run_hours=hours,
    )
    job = defs.resolve_job_def("pool_hour_job")
    for hour in hours:
        for pool in pools.pools:
            result = job.execute_in_process(
                partition_key=partition_key(hour, pool.name),
                instance=instance,
                run_config=QUIET_RUN_CONFIG,
                raise_on_error=False,
            )
            yield hour, pool.name, result


def data_dir_instance(data_dir: Path) -> dg.DagsterInstance:
    """The persistent instance of `data_dir` (DAGSTER_HOME when set, else DATA/dagster: see
    pipeline.cli.dagster_instance), the one `stepledger dev` shows: runs made here appear in
    the UI with their partitions and checks."""
    home = instance_dir(data_dir, dict(os.environ))
    prepare_instance(home)
    try:
        return dg.DagsterInstance.from_config(str(home))
    except sqlalchemy.exc.OperationalError as err:
        # SQLite's own words ("database or disk is full"), not the statement it failed in.
        raise instance_unwritable(home, err.orig) from err


def materialize(
    data_dir: Path, hour_keys: list[str], warehouse: Path | None
) -> Iterator[dict[str, Any]]:
    hours = sorted({parse_hour_key(k) for k in hour_keys})
    with data_dir_instance(data_dir) as instance:
        for hour, pool, result in execute_pool_hours(data_dir, hours, warehouse, instance):
            yield {"hour": hour_key(hour), "pool": pool, **pool_hour_outcome(result)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m assets.runner", description=__doc__)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--hour", action="append", required=True, metavar="YYYY-MM-DDTHH")
    parser.add_argument("--warehouse", type=Path)
    args = parser.parse_args(argv)
    for outcome in materialize(args.data, args.hour, args.warehouse):
        print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main()
