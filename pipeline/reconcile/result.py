"""A check's result for one pool-hour and replica (or the pool): a row of the `reconciliation`
table, and an alert when it failed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from pipeline.reconcile.findings import Finding, FindingKind, Severity, Weights, kinds_of
from schemas.units import hour_bounds_ns


@dataclass(frozen=True)
class CheckResult:
    """One row of the `reconciliation` table; a failed one is also an alert.

    `finding` is a short stable code of what failed ("gap", "host_stall", ...; "" when
    passed). With the check name, hour, pool and replica it identifies the alert, so a re-run
    whose numbers moved slightly does not page again.
    """

    hour: datetime
    pool: str
    replica: str | None
    check_name: str
    passed: bool
    expected: str
    observed: str
    detail: str
    severity: Severity
    blocking: bool
    finding: str = ""

    def __post_init__(self) -> None:
        hour_bounds_ns(
            self.hour
        )  # refuses naive or non-:00 hours, which would land in the wrong row


def worst(kinds: Sequence[FindingKind]) -> tuple[Severity, bool]:
    """The severity and blocking of the worst of `kinds`: ERROR if any is, blocking if any does."""
    severity: Severity = "ERROR" if any(kind.severity == "ERROR" for kind in kinds) else "WARN"
    return severity, any(kind.blocks for kind in kinds)


def failed(
    where: tuple[datetime, str, str | None],
    expected: str,
    observed: str,
    findings: Sequence[Finding],
) -> CheckResult:
    """The failed result at `where` (hour, pool, replica) of the check that raised `findings`
    (at least one, all of one check): the worst severity, all texts in the detail, the codes
    joined by "+"."""
    (check_name,) = {finding.kind.check for finding in findings}
    severity, blocking = worst([finding.kind for finding in findings])
    return CheckResult(
        *where,
        check_name,
        False,
        expected,
        observed,
        "; ".join(finding.text for finding in findings),
        severity,
        blocking,
        "+".join(finding.kind.code for finding in findings),
    )


def fold(
    where: tuple[datetime, str, str | None],
    check_name: str,
    expected: str,
    observed: str,
    findings: Sequence[Finding],
    *,
    passed_detail: str,
    weights: Weights,
) -> CheckResult:
    """A check's result at `where` (hour, pool, replica): `failed` with its findings, or
    passed. A passed result carries the severity and blocking of the worst finding the check
    could have raised for a pool charging with `weights`."""
    if findings:
        return failed(where, expected, observed, findings)
    severity, blocking = worst(kinds_of(check_name, weights))
    return CheckResult(
        *where, check_name, True, expected, observed, passed_detail, severity, blocking
    )
