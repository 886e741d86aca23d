"""The registry of findings: every kind is raised by some pool-hour, and the docs show the registry."""

from __future__ import annotations

from collections.abc import Callable
from datetime import date, timedelta
from pathlib import Path
from typing import TypedDict

import duckdb
import polars as pl
import pytest

from pipeline.finance.adjustments import rebilled_closed_month
from pipeline.reconcile import (
    CHECKS,
    CheckResult,
    check_calibration,
    check_clock,
    check_conservation,
    check_money,
    check_plausibility,
    check_silence,
    check_time,
    check_unattributed,
)
from pipeline.reconcile.alerts import alert_for, deadman, enqueue, undelivered
from pipeline.reconcile.findings import (
    CHECK_SPECS,
    DRIFT,
    FINDINGS,
    GAP,
    KERNEL_DRIFT,
    SHORTFALL,
    FindingKind,
    kinds_found,
)
from pipeline.reconcile.findings_doc import findings_table, with_findings_table
from pipeline.storage.data_files import DataFiles
from pipeline.storage.integrity import IntegrityError, require_lake_files, verify_published_hour
from pipeline.storage.warehouse import SCHEMA_SQL, STATE_SQL
from schemas.config import Settings
from schemas.units import hour_key, to_warehouse
from tests.helpers.hours import HOUR
from tests.helpers.reconcile_builders import (
    HOUR_START_NS,
    S,
    clean_steps,
    make_damage,
    make_dcgm,
    make_drops,
    make_invoice,
    make_ledger,
    make_pool,
    make_segments,
    sequence,
    shift_utc,
    without_seq,
)

DOC = Path(__file__).resolve().parents[3] / "docs" / "production.md"
POOL = make_pool()
FITTED = make_pool(weights="fitted")
SETTINGS = Settings()
R0, R1 = "chat-r0", "chat-r1"
UUID0, UUID1 = "GPU-0000-0000", "GPU-0001-0000"
# Two H100s for an hour at 3.60 USD, all of it one tenant's usage.
INVOICE_NANO = 7_200_000_000
KEY = ("llama-3.1-8b-instruct", "h100", "0.25.0", "570.86")


class Fits(TypedDict):
    """The stored and the fresh calibration fit, as check_calibration's keyword arguments."""

    stored_fit: dict[str, float]
    fresh_fit: dict[str, float]


FITS: Fits = {"stored_fit": {"c0_ms": 4.0}, "fresh_fit": {"c0_ms": 8.0}}


def with_repeats(steps: pl.DataFrame, replica: str, first: int, last: int) -> pl.DataFrame:
    """The steps with one replica's seq range logged twice."""
    again = steps.filter((pl.col("replica") == replica) & pl.col("seq").is_between(first, last))
    return pl.concat([steps, again])


def money(
    lines: list[tuple[str | None, str, int | None, int]], invoice_nano: int = INVOICE_NANO
) -> list[CheckResult]:
    return check_money(HOUR, POOL, make_invoice(POOL, invoice_nano), make_ledger(POOL, lines))


def plausibility(dcgm: dict[str, list[float]]) -> list[CheckResult]:
    return check_plausibility(HOUR, POOL, clean_steps(POOL), make_dcgm(POOL, dcgm), SETTINGS)


def undelivered_alert() -> list[CheckResult]:
    """An alert enqueued in a real pipeline state and owed past the dead-man delay."""
    (stall,) = [r for r in plausibility({UUID0: [0.6], UUID1: [0.25]}) if not r.passed]
    raised = HOUR + timedelta(hours=1, minutes=20)
    with duckdb.connect() as con:
        con.execute(STATE_SQL.read_text())
        enqueue(con, [alert_for(stall, raised)])
        late = raised + timedelta(minutes=SETTINGS.deadman_minutes, seconds=1)
        return undelivered(con, late, SETTINGS)


def integrity_refusal(refuse: Callable[[], None]) -> list[CheckResult]:
    """The failed result of an integrity refusal."""
    with pytest.raises(IntegrityError) as refused:
        refuse()
    return [refused.value.result]


def published_rows_changed() -> None:
    """A pool-hour whose rows are not those it was published with."""
    with duckdb.connect() as con:
        con.execute(SCHEMA_SQL.read_text())
        con.execute(
            "INSERT INTO published_digests VALUES (?, ?, ?)", [to_warehouse(HOUR), POOL.name, "0"]
        )
        verify_published_hour(
            con, DataFiles.local(Path("/nonexistent/warehouse/data")), HOUR, POOL.name
        )


CLOCK_JUMPS = pl.DataFrame(
    {
        "path": [f"outbox/{R0}/{R0}-001.seg"],
        "replica": [R0],
        "first_seq": [500],
        "previous_segment_id": [f"{R0}-000"],
        "jump_ns": [90 * S],
        "first_start_utc_ns": [HOUR_START_NS + 25 * S],
    }
)

# A pool-hour that raises each kind of finding, by (check, code, weights).
SCENARIOS: dict[tuple[str, str, str | None], Callable[[], list[CheckResult]]] = {
    ("sequence", "gap", None): lambda: sequence(without_seq(clean_steps(POOL), R0, 100, 199)),
    ("sequence", "dropped", None): lambda: sequence(
        without_seq(clean_steps(POOL), R0, 100, 199), drops=make_drops(POOL, R0, 100, 199)
    ),
    ("sequence", "damage", None): lambda: sequence(
        without_seq(clean_steps(POOL), R1, 100, 199),
        damage=make_damage(f"outbox/{R1}/{R1}-000.seg", "torn_frame", first=100, last=199),
    ),
    ("sequence", "missing_head", None): lambda: sequence(without_seq(clean_steps(POOL), R0, 0, 99)),
    ("sequence", "lost_tail", None): lambda: sequence(
        without_seq(clean_steps(POOL), R0, 71_990, 71_999),
        damage=make_damage(f"outbox/{R0}/{R0}-000.seg", "torn_tail", first=71_990),
    ),
    ("sequence", "harmless_damage", None): lambda: sequence(
        clean_steps(POOL),
        damage=make_damage(f"outbox/{R0}/{R0}-000.seg", "corrupt_frame", first=100, last=99),
    ),
    ("sequence", "divergent_copy", None): lambda: sequence(
        clean_steps(POOL),
        damage=make_damage(f"outbox/{R0}/{R0}-001.seg", "divergent_copy", first=0, last=99),
    ),
    ("sequence", "repeated", None): lambda: sequence(with_repeats(clean_steps(POOL), R0, 5, 6)),
    ("sequence", "duplicate_segment", None): lambda: sequence(
        clean_steps(POOL),
        damage=make_damage(f"outbox/{R0}/{R0}-001.seg", "duplicate_segment", first=0, last=99),
    ),
    ("sequence", "unplaced_damage", None): lambda: sequence(
        clean_steps(POOL), damage=make_damage("outbox/elsewhere/x.seg", "truncated")
    ),
    ("time", "shortfall", None): lambda: check_time(
        HOUR, POOL, without_seq(clean_steps(POOL), R0, 1_000, 20_000), SETTINGS
    ),
    ("time", "excess", None): lambda: check_time(
        HOUR, POOL, with_repeats(clean_steps(POOL), R0, 0, 999), SETTINGS
    ),
    ("time", "clock_skew", None): lambda: check_time(
        HOUR, POOL, shift_utc(clean_steps(POOL), R1, 36_000, 30 * S), SETTINGS
    ),
    ("money", "not_integer", None): lambda: check_money(
        HOUR,
        POOL,
        make_invoice(POOL, INVOICE_NANO),
        make_ledger(POOL, [("acme", "usage", INVOICE_NANO, 1)]).with_columns(
            pl.col("amount_nano").cast(pl.Float64)
        ),
    ),
    ("money", "null_amount", None): lambda: money(
        [("acme", "usage", INVOICE_NANO, 1), ("globex", "usage", None, 1)]
    ),
    ("money", "invoice_count", None): lambda: check_money(
        HOUR,
        POOL,
        make_invoice(POOL, INVOICE_NANO).with_columns(pl.col("hour").dt.offset_by("1h")),
        make_ledger(POOL, [("acme", "usage", INVOICE_NANO, 1)]),
    ),
    ("money", "invoice_price", None): lambda: money(
        [("acme", "usage", INVOICE_NANO + 5, 1)], INVOICE_NANO + 5
    ),
    ("money", "line_kind", None): lambda: money(
        [("acme", "usage", INVOICE_NANO, 1), ("acme", "rebate", 0, 0)]
    ),
    ("money", "mismatch", None): lambda: money([("acme", "usage", INVOICE_NANO - 1, 1)]),
    ("plausibility", "host_stall", None): lambda: plausibility({UUID0: [0.6], UUID1: [0.25]}),
    ("plausibility", "impossible_kv", None): lambda: check_plausibility(
        HOUR,
        POOL,
        clean_steps(POOL),
        make_dcgm(POOL, {UUID0: [0.6], UUID1: [0.6]}),
        SETTINGS,
        kv_held=pl.DataFrame({"replica": [R0], "seq": [7], "kv_blocks": [1e6]}),
    ),
    ("plausibility", "gpu_busier", None): lambda: plausibility({UUID0: [0.95], UUID1: [0.6]}),
    ("plausibility", "dcgm_missing", None): lambda: plausibility({UUID0: [0.6]}),
    ("unattributed", "over_threshold", None): lambda: check_unattributed(
        HOUR, POOL, make_ledger(POOL, [("acme", "usage", 900, 1), (None, "unattributed", 100, 1)])
    ),
    ("calibration", "stale", "fitted"): lambda: check_calibration(
        HOUR, FITTED, make_segments(FITTED, engine_version="0.26.1"), {KEY}, SETTINGS
    ),
    ("calibration", "missing", "fitted"): lambda: check_calibration(
        HOUR, FITTED, make_segments(FITTED), set(), SETTINGS
    ),
    ("calibration", "new_engine_version", "kernel"): lambda: check_calibration(
        HOUR,
        POOL,
        make_segments(POOL, engine_version="0.26.1"),
        set(),
        SETTINGS,
        kernel_engine_version="0.25.0",
    ),
    ("calibration_drift", "drift", "fitted"): lambda: check_calibration(
        HOUR, FITTED, make_segments(FITTED), {KEY}, SETTINGS, **FITS
    ),
    ("calibration_drift", "drift", "kernel"): lambda: check_calibration(
        HOUR, POOL, make_segments(POOL), {KEY}, SETTINGS, kernel_engine_version="0.25.0", **FITS
    ),
    ("clock", "clock_jump", None): lambda: check_clock(HOUR, POOL, CLOCK_JUMPS),
    ("silence", "silent_replica", None): lambda: check_silence(
        HOUR,
        POOL,
        clean_steps(POOL).filter(pl.col("replica") == R1),
        make_dcgm(POOL, {UUID0: [0.6], UUID1: [0.6]}),
        SETTINGS,
    ),
    ("silence", "silent_unverified", None): lambda: check_silence(
        HOUR,
        POOL,
        clean_steps(POOL).filter(pl.col("replica") == R1),
        make_dcgm(POOL, {UUID1: [0.6]}),
        SETTINGS,
    ),
    ("silence", "silent_tail", None): lambda: check_silence(
        HOUR,
        POOL,
        without_seq(clean_steps(POOL), R0, 36_000, 71_999),
        make_dcgm(POOL, {UUID0: [0.6], UUID1: [0.6]}),
        SETTINGS,
    ),
    ("conservation", "unbilled_steps", None): lambda: check_conservation(
        HOUR,
        POOL,
        clean_steps(POOL),
        pl.DataFrame({"replica": [R0], "seq": [5], "hour": [hour_key(HOUR - timedelta(hours=1))]}),
    ),
    ("deadman", "not_reconciled", None): lambda: deadman(
        {POOL.name: HOUR}, HOUR + timedelta(hours=12), SETTINGS
    ),
    ("alert_delivery", "undelivered", None): undelivered_alert,
    ("closed_month", "rebilled", None): lambda: [
        rebilled_closed_month(
            HOUR,
            POOL.name,
            pl.DataFrame({"tenant": ["acme"], "amount_nano": [-5]}),
            date(2026, 12, 1),
        )
    ],
    ("integrity", "lake_files_missing", None): lambda: integrity_refusal(
        lambda: require_lake_files(
            Path("/nonexistent/lake"),
            POOL.name,
            HOUR,
            {f"slots/pool={POOL.name}/hour={hour_key(HOUR)}/{R0}.0.b.parquet": "0" * 64},
        )
    ),
    ("integrity", "published_changed", None): lambda: integrity_refusal(published_rows_changed),
}


def identity(kind: FindingKind) -> tuple[str, str, str | None]:
    return (kind.check, kind.code, kind.weights)


@pytest.mark.parametrize("kind", FINDINGS, ids=["-".join(map(str, identity(k))) for k in FINDINGS])
def test_every_kind_of_finding_is_raised_alone_by_some_pool_hour(kind: FindingKind) -> None:
    failed = [r for r in SCENARIOS[identity(kind)]() if not r.passed]
    assert {(r.check_name, r.finding, r.severity, r.blocking) for r in failed} == {
        (kind.check, kind.code, kind.severity, kind.blocks)
    }


def test_each_scenario_is_of_a_registered_kind_and_each_kind_is_registered_once() -> None:
    identities = [identity(kind) for kind in FINDINGS]
    assert sorted(identities, key=str) == sorted(SCENARIOS, key=str)
    assert len(set(identities)) == len(identities)


def test_every_check_run_on_a_pool_hour_has_findings_and_its_own_description() -> None:
    assert tuple(spec.name for spec in CHECK_SPECS) == CHECKS
    for spec in CHECK_SPECS:
        codes = {kind.code for kind in FINDINGS if kind.check == spec.name}
        assert codes
        assert all(f"{code} (" in spec.description() for code in codes)


def test_a_check_holds_the_hour_back_exactly_when_one_of_its_findings_does() -> None:
    assert {spec.name for spec in CHECK_SPECS if spec.blocks_publication} == {
        "sequence",
        "time",
        "money",
        "silence",
        "conservation",
    }


def test_the_docs_table_of_findings_is_the_registry() -> None:
    document = DOC.read_text()
    assert findings_table() in document
    assert with_findings_table(document) == document


def test_the_table_has_a_row_per_finding_with_its_severity_and_blocking() -> None:
    rows = findings_table().splitlines()[2:]
    assert rows[0] == (
        "| sequence | `gap` | replica | ERROR | yes | sequence numbers missing with no counted drop "
        "or damage to explain them (a segment lost in shipping) | `stepledger inspect "
        "<outbox>/<replica>` shows which; ship the lost or late segment to the outbox and re-run "
        "the hour | a re-run of the hour that finds every sequence number in the outbox |"
    )
    (host_stall,) = [row for row in rows if "`host_stall`" in row]
    assert host_stall.endswith(" | not held: the hour is published |")
    assert [row.split(" | ")[1:5] for row in rows if "`drift`" in row] == [
        ["`drift`", "pool (`weights: fitted`)", "ERROR", "no"],
        ["`drift`", "pool (`weights: kernel`)", "WARN", "no"],
    ]
    assert len(rows) == len(FINDINGS)


@pytest.mark.parametrize("kind", FINDINGS, ids=["-".join(map(str, identity(k))) for k in FINDINGS])
def test_every_kind_says_what_it_means_what_to_do_and_what_releases_a_held_hour(
    kind: FindingKind,
) -> None:
    # Pages, `stepledger status` and the docs read these texts: a kind without them would page
    # on-call with nothing to act on.
    assert kind.description.strip()
    assert kind.runbook.strip()
    # Only a kind that holds the hour back has something that releases it.
    assert bool(kind.releases.strip()) == kind.blocks


def test_a_results_codes_name_their_kinds_and_severity_tells_the_two_drifts_apart() -> None:
    assert kinds_found("sequence", "gap", "ERROR") == (GAP,)
    assert kinds_found("time", "shortfall+excess", "ERROR")[0] == SHORTFALL
    assert kinds_found("calibration_drift", "drift", "ERROR") == (DRIFT,)
    assert kinds_found("calibration_drift", "drift", "WARN") == (KERNEL_DRIFT,)
    assert kinds_found("sequence", "no_such_code", "ERROR") == ()
