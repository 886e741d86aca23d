"""Reconciliation of each pool-hour as asset checks on the ledger, one evaluation per check
and pool-hour partition.

Every result is a row of the `reconciliation` table. The checks whose failure holds the hour
back from the finance views (those with a blocking finding in `pipeline.reconcile.findings`)
are Dagster's blocking checks. Any ERROR
failure fails the run, so that the run-failure sensor pages on-call: for a blocking check
Dagster fails it, for the others the check step raises once every result is recorded (a failed
non-blocking check alone would leave the run green and page nobody). WARN failures never fail
a run.
"""

# No `from __future__ import annotations`: Dagster checks the `context` annotation as an
# object, and a postponed (string) annotation fails that check.

import warnings
from collections.abc import Iterator

import dagster as dg
from dagster_duckdb import DuckDBResource

from assets.partitions import pool_hours
from assets.resources import DUCKDB_POOL, StepledgerData, open_warehouse
from pipeline.reconcile import CHECKS, CheckResult, reconcile_hour
from pipeline.reconcile.findings import CHECK_SPECS
from schemas.config import PoolsFile
from schemas.units import hour_key

# The checks that hold the hour back from the finance views.
HOLDS_HOUR_BACK = frozenset(spec.name for spec in CHECK_SPECS if spec.blocks_publication)


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


def build_reconciliation_checks(
    pools: PoolsFile, partitions: dg.PartitionsDefinition, state_pool: str | None = DUCKDB_POOL
) -> list[dg.AssetChecksDefinition]:
    """The reconciliation asset checks on the ledger: one spec per check of the registry,
    evaluated for every pool-hour partition of `partitions`."""
    # Partitioned checks are a preview API in Dagster 1.13 (pinned); the tests assert one
    # evaluation per pool-hour, which is what it gives.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.PreviewWarning)
        specs = [
            dg.AssetCheckSpec(
                spec.name,
                asset="ledger",
                blocking=spec.blocks_publication,
                # What the check asserts and can find, shown with it in the Dagster UI.
                description=spec.description(),
                partitions_def=partitions,
            )
            for spec in CHECK_SPECS
        ]

    @dg.multi_asset_check(specs=specs, name="reconciliation", pool=state_pool)
    def reconciliation(
        context: dg.AssetCheckExecutionContext,
        data: StepledgerData,
        warehouse: DuckDBResource,
        pool_hour_lock: dg.ResourceParam[None],
    ) -> Iterator[dg.AssetCheckEvaluation | dg.Output[None]]:
        published_with_errors = []
        with open_warehouse(warehouse) as con:
            for hour, pool_name, key in pool_hours(context):
                results = reconcile_hour(
                    con,
                    data.layout.lake,
                    data.layout.dcgm,
                    pools.pool(pool_name),
                    hour,
                    pools.settings,
                    calibration_file=data.layout.calibration_file,
                )
                standing = (
                    "held back"
                    if any(r.blocking and not r.passed for r in results)
                    else "published"
                )
                for name in CHECKS:
                    evaluation = check_evaluation(
                        name, [r for r in results if r.check_name == name], key
                    )
                    if (
                        not evaluation.passed
                        and evaluation.severity == dg.AssetCheckSeverity.ERROR
                        and name not in HOLDS_HOUR_BACK
                    ):
                        published_with_errors.append(
                            f"{name} ({hour_key(hour)} {pool_name}: the hour is {standing})"
                        )
                    yield evaluation
        # A range's evaluations carry their hours (above); the check's outputs carry nothing.
        for spec in specs:
            yield dg.Output(None, output_name=spec.get_python_identifier())

        if published_with_errors:
            raise dg.Failure(
                description="ERROR findings of checks that hold no hour back: "
                + ", ".join(published_with_errors),
                allow_retries=False,
            )

    return [reconciliation]


def check_evaluation(
    name: str, results: list[CheckResult], partition: str
) -> dg.AssetCheckEvaluation:
    """One check's evaluation for one pool-hour partition from its results (a row each per
    replica or pool). A failure is WARN only when every failed result is; a passed check
    keeps ERROR. Built as an evaluation, not a result: a backfill's run evaluates a range of
    partitions, and only an evaluation names its partition."""
    failed = [r for r in results if not r.passed]
    warn_only = bool(failed) and all(r.severity == "WARN" for r in failed)
    return dg.AssetCheckEvaluation(
        asset_key=dg.AssetKey("ledger"),
        check_name=name,
        passed=not failed,
        severity=dg.AssetCheckSeverity.WARN if warn_only else dg.AssetCheckSeverity.ERROR,
        blocking=name in HOLDS_HOUR_BACK,
        partition=partition,
        metadata={
            "results": len(results),
            "failed": len(failed),
            "detail": "; ".join(
                f"{r.replica or r.pool}: {r.detail}" for r in (failed or results)[:10]
            ),
            "results_table": dg.MetadataValue.md(results_table(results)),
        },
    )
