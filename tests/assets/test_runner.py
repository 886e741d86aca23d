"""What `stepledger run` reports of a pool-hour run (assets.runner.pool_hour_outcome)."""

from __future__ import annotations

import errno
import warnings
from collections.abc import Iterator

import dagster as dg

from assets.runner import pool_hour_outcome

LOCK_FILE = "/data/pipeline.duckdb.locks/chat-8b@2026-11-30T00.lock"


def test_a_run_whose_resource_cannot_be_set_up_is_failed_with_its_error() -> None:
    @dg.resource
    def lock(_: dg.InitResourceContext) -> Iterator[None]:
        raise OSError(errno.ENOSPC, "No space left on device", LOCK_FILE)
        yield None

    @dg.asset(required_resource_keys={"lock"})
    def step_log() -> int:
        return 1

    job = dg.define_asset_job("pool_hour_job", [step_log])
    defs = dg.Definitions(assets=[step_log], jobs=[job], resources={"lock": lock})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = defs.resolve_job_def("pool_hour_job").execute_in_process(raise_on_error=False)
    outcome = pool_hour_outcome(result)
    # No step ran, so no step failed: the run's own failure says why.
    assert result.get_step_failure_events() == []
    assert outcome["success"] is False
    assert outcome["error"] == (
        f"OSError: [Errno {errno.ENOSPC}] No space left on device: '{LOCK_FILE}'"
    )
    assert outcome["held_back"] is False
    assert outcome["failed_checks"] == []
