"""`stepledger status`: each pool-hour's standing (published, published with WARN or ERROR
findings, held back), and for each failed check what it means, what to do, what releases a
held hour (the findings registry's texts) and whether its page was delivered.

It reads: the warehouse through the finance reader's read-only connection, the alert outbox
through a read-only connection to the pipeline's state file (when a running pipeline holds
that file, the pages' delivery is reported unknown, saying why, rather than waited for)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal

import click
import duckdb

from pipeline.cli.options import TimeRange, data_dir_option, range_options
from pipeline.datadir import DataDir
from pipeline.reconcile.alerts import dedup_key
from pipeline.reconcile.findings import kinds_found
from pipeline.storage.warehouse import read_connection, warehouse_dir
from schemas.units import from_warehouse, hour_key, to_warehouse

Standing = Literal["published", "published with WARN", "published with ERROR", "held back"]


@dataclass(frozen=True)
class FailedCheck:
    """A failed check of a pool-hour, with the registry's texts and its page's delivery."""

    severity: str
    check: str
    finding: str
    scope: str
    detail: str
    means: str
    todo: str
    releases: str
    page: str


@dataclass(frozen=True)
class PoolHourStatus:
    hour: str
    pool: str
    standing: Standing
    reason: str  # why a held hour is held ("not reconciled yet", the failed blocking checks)
    failed: list[FailedCheck]


def pool_hour_statuses(
    state_file: Path, start: datetime | None, end: datetime | None
) -> list[PoolHourStatus]:
    """Every invoiced pool-hour in [start, end) of the warehouse next to `state_file`, oldest
    first, with its standing and failures."""
    window = [None if t is None else to_warehouse(t) for t in (start, end)]
    con = read_connection(warehouse_dir(state_file.resolve().parent))
    try:
        invoiced = con.execute(
            "SELECT i.hour, i.pool, h.reason FROM invoices i "
            "LEFT JOIN held_back_hours h ON h.hour = i.hour AND h.pool = i.pool "
            "WHERE i.hour >= coalesce(?, i.hour) AND i.hour < coalesce(?, i.hour + INTERVAL 1 HOUR) "
            "ORDER BY i.hour, i.pool",
            window,
        ).fetchall()
        failures = con.execute(
            "SELECT hour, pool, replica, check_name, severity, blocking, finding, detail "
            "FROM reconciliation WHERE NOT passed AND hour >= coalesce(?, hour) "
            "AND hour < coalesce(?, hour + INTERVAL 1 HOUR) ORDER BY severity, check_name, replica",
            window,
        ).fetchall()
    finally:
        con.close()
    pages = _pages(state_file)
    statuses = []
    for hour, pool, reason in invoiced:
        failed = [_failed_check(row, pages) for row in failures if row[:2] == (hour, pool)]
        statuses.append(
            PoolHourStatus(
                hour_key(from_warehouse(hour)),
                pool,
                _standing(reason, failed),
                reason or "",
                failed,
            )
        )
    return statuses


def _standing(held_reason: str | None, failed: list[FailedCheck]) -> Standing:
    if held_reason is not None:
        return "held back"
    if any(check.severity == "ERROR" for check in failed):
        return "published with ERROR"
    return "published with WARN" if failed else "published"


def _failed_check(
    row: tuple[datetime, str, str | None, str, str, bool, str, str],
    pages: dict[str, tuple[datetime | None, int, str | None]] | str,
) -> FailedCheck:
    hour, pool, replica, check, severity, blocking, finding, detail = row
    kinds = kinds_found(check, finding, "ERROR" if severity == "ERROR" else "WARN")
    page = "WARN: pages nobody"
    if severity == "ERROR":
        key = dedup_key(check, from_warehouse(hour), pool, replica, finding)
        page = _delivery(pages, key)
    return FailedCheck(
        severity=severity,
        check=check,
        finding=finding,
        scope=replica or pool,
        detail=detail,
        means="; ".join(dict.fromkeys(kind.description for kind in kinds)),
        todo="; ".join(dict.fromkeys(kind.runbook for kind in kinds)),
        releases="; ".join(dict.fromkeys(kind.releases for kind in kinds if kind.releases))
        if blocking
        else "",
        page=page,
    )


def _delivery(pages: dict[str, tuple[datetime | None, int, str | None]] | str, key: str) -> str:
    if isinstance(pages, str):
        return f"unknown: {pages}"
    if key not in pages:
        return "not recorded in the alert outbox"
    delivered_at, attempts, last_error = pages[key]
    if delivered_at is not None:
        return f"delivered {delivered_at.isoformat(timespec='seconds')} UTC"
    return f"owed after {attempts} attempt(s): {last_error or 'not tried yet'}"


def _pages(state_file: Path) -> dict[str, tuple[datetime | None, int, str | None]] | str:
    """The outbox's alerts by dedup key, or why they cannot be read (most often a running
    pipeline holds the state file: another process's lock, or this process's own writing
    connection)."""
    if not state_file.is_file():
        return {}
    try:
        con = duckdb.connect(str(state_file), read_only=True)
    except (duckdb.IOException, duckdb.ConnectionException) as err:
        return f"{state_file} cannot be read now ({str(err).splitlines()[0]})"
    try:
        rows = con.execute(
            "SELECT dedup_key, delivered_at, attempts, last_error FROM alert_outbox"
        ).fetchall()
    finally:
        con.close()
    return {key: (delivered, attempts, error) for key, delivered, attempts, error in rows}


def _print(statuses: list[PoolHourStatus]) -> None:
    for status in statuses:
        reason = f" ({status.reason})" if status.standing == "held back" else ""
        click.echo(f"{status.hour} {status.pool}: {status.standing}{reason}")
        for check in status.failed:
            click.echo(
                f"    {check.severity} {check.check} ({check.finding}) {check.scope}: {check.detail}"
            )
            click.echo(f"        means: {check.means}")
            click.echo(f"        to do: {check.todo}")
            if check.releases:
                click.echo(f"        released by: {check.releases}")
            click.echo(f"        page: {check.page}")


@click.command("status")
@data_dir_option(help="the data directory `stepledger run` or `demo` billed", existing=True)
@range_options("to show")
@click.option("--json", "as_json", is_flag=True, help="print the pool-hours as a JSON array")
def status_command(data_dir: Path, period: TimeRange, as_json: bool) -> None:
    """Each pool-hour's standing: published, published with WARN or ERROR findings, or held
    back from finance; for each failed check what it means, what to do, what releases a held
    hour, and whether on-call's page was delivered."""
    statuses = pool_hour_statuses(DataDir(data_dir).state_file, period.start, period.end)
    if as_json:
        click.echo(json.dumps([asdict(s) for s in statuses], indent=2))
        return
    if not statuses:
        click.echo("no invoiced pool-hours in the range")
        return
    _print(statuses)
