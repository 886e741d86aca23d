"""Jobs. Both run in one process: every step touches the single DuckDB file anyway."""

from __future__ import annotations

from typing import TYPE_CHECKING

import dagster as dg

from assets.pool_hour import GROUP

if TYPE_CHECKING:
    from dagster._core.definitions.unresolved_asset_job_definition import (
        UnresolvedAssetJobDefinition,
    )

POOL_HOUR_JOB = "pool_hour_job"
INGEST_JOB = "ingest_job"


def build_jobs() -> tuple[UnresolvedAssetJobDefinition, UnresolvedAssetJobDefinition]:
    """The pool-hour job and the ingest-only job (for the new-segments sensor)."""
    pool_hour_job = dg.define_asset_job(
        POOL_HOUR_JOB,
        selection=dg.AssetSelection.groups(GROUP),
        executor_def=dg.in_process_executor,
        description="One pool-hour: ingest, request context, charges, ledger, reconciliation.",
    )
    ingest_job = dg.define_asset_job(
        INGEST_JOB,
        selection=dg.AssetSelection.assets("step_log"),
        executor_def=dg.in_process_executor,
        description="Ingest new step-log segments of one pool.",
    )
    return pool_hour_job, ingest_job
