"""Reconciliation of each pool-hour as asset checks on the ledger.

Every result is a row of the `reconciliation` table. Whether a failure holds the hour back
from the finance views is the result's own `blocking` (sequence, time and money); that is the
warehouse's business. To Dagster every check is blocking, so that any ERROR failure fails the
run and the run-failure sensor pages on-call (a failed non-blocking check would leave the run
green and page nobody); WARN failures never fail a run.
"""

# No `from __future__ import annotations`: Dagster checks the `context` annotation as an
# object, and a postponed (string) annotation fails that check.

from collections.abc import Iterator

import dagster as dg
from dagster_duckdb import DuckDBResource

from assets.partitions import hour_and_pool
from assets.pool_hour import DUCKDB_POOL
from assets.resources import StepledgerData, open_warehouse
from pipeline.alerts import record_alerts
from pipeline.reconcile import CHECKS, CheckResult, reconcile_hour
from schemas.config import PoolsFile


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def results_table(results: list[CheckResult]) -> str:
    """One markdown row per result (replica or pool): what was expected, observed, and why."""
    header = "| scope | status | expected | observed | detail |\n|---|---|---|---|---|\n"
    rows = [
        f"| {r.replica or r.pool} | {'passed' if r.passed else r.severity} | {_cell(r.expected)} | "
        f"{_cell(r.observed)} | {_cell(r.detail)} |"
        for r in results
    ]
    return (
        header + "\n".join(rows)
        if rows
        else "no results: the check does not apply to this pool-hour"
    )


def build_reconciliation_checks(pools: PoolsFile) -> list[dg.AssetChecksDefinition]:
    specs = [dg.AssetCheckSpec(name, asset="ledger", blocking=True) for name in CHECKS]

    @dg.multi_asset_check(specs=specs, name="reconciliation", pool=DUCKDB_POOL)
    def reconciliation(
        context: dg.AssetCheckExecutionContext, data: StepledgerData, warehouse: DuckDBResource
    ) -> Iterator[dg.AssetCheckResult]:
        hour, pool_name = hour_and_pool(context)
        with open_warehouse(warehouse) as con:
            results = reconcile_hour(
                con,
                data.lake,
                data.dcgm,
                pools.pool(pool_name),
                hour,
                pools.settings,
                calibration_file=data.calibration_file,
            )
            record_alerts(con, results)
        for name in CHECKS:
            mine = [r for r in results if r.check_name == name]
            failed = [r for r in mine if not r.passed]
            # A failure is WARN only when every failed result is; a passed check keeps ERROR.
            warn_only = bool(failed) and all(r.severity == "WARN" for r in failed)
            yield dg.AssetCheckResult(
                check_name=name,
                asset_key="ledger",
                passed=not failed,
                severity=dg.AssetCheckSeverity.WARN if warn_only else dg.AssetCheckSeverity.ERROR,
                metadata={
                    "results": len(mine),
                    "failed": len(failed),
                    "detail": "; ".join(
                        f"{r.replica or pool_name}: {r.detail}" for r in (failed or mine)[:10]
                    ),
                    "results_table": dg.MetadataValue.md(results_table(mine)),
                },
            )

    return [reconciliation]
