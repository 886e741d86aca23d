from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path

import duckdb
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import finance
from pipeline.reconcile.alerts import add_alerts, record_alerts
from pipeline.reconcile.result import CheckResult
from pipeline.storage import warehouse
from pipeline.storage.warehouse import (
    STATE_FILE,
    WarehouseError,
    connect,
    connect_read_only,
    record_checks,
    replace_hour,
)
from tests.helpers.hours import HOUR


@dataclass(frozen=True)
class Check:
    hour: datetime
    pool: str
    replica: str | None
    check_name: str
    passed: bool
    expected: str = "e"
    observed: str = "o"
    detail: str = "d"
    severity: str = "ERROR"
    blocking: bool = True
    finding: str = ""


def invoice(pool: str, amount: int, hour: datetime = HOUR) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "hour": [hour],
            "pool": [pool],
            "gpus": [4],
            "usd_per_gpu_hour": [3.6],
            "amount_nano": [amount],
        }
    )


def lines(
    pool: str, rows: list[tuple[str, str, str, int, int, int]], hour: datetime = HOUR
) -> pl.DataFrame:
    tenant, feature, kind, amount, requests, tokens = (list(c) for c in zip(*rows, strict=True))
    n = len(rows)
    return pl.DataFrame(
        {
            "hour": [hour] * n,
            "pool": [pool] * n,
            "tenant": tenant,
            "feature": feature,
            "line_kind": kind,
            "amount_nano": amount,
            "requests": requests,
            "new_tokens": tokens,
            "cached_tokens": [0] * n,
            "weights_version": ["kernel-1"] * n,
            "policy_version": ["pol-1"] * n,
        }
    )


def publish(
    con: duckdb.DuckDBPyConnection, pool: str, rows, amount: int, *, passed: bool = True, hour=HOUR
) -> None:
    replace_hour(
        con,
        hour,
        pool,
        {"invoices": invoice(pool, amount, hour), "ledger_lines": lines(pool, rows, hour)},
    )
    record_checks(con, hour, pool, ["money"], [Check(hour, pool, None, "money", passed)])


def test_replace_hour_is_exact_and_leaves_other_hours(tmp_path: Path) -> None:
    with connect(tmp_path / "w.duckdb") as con:
        publish(
            con,
            "chat",
            [("acme", "bot", "usage", 900, 3, 30), ("acme", "bot", "idle", 100, 0, 0)],
            1000,
        )
        publish(con, "other", [("globex", "q", "usage", 50, 1, 5)], 50)
        publish(
            con,
            "chat",
            [("acme", "bot", "usage", 700, 2, 20), ("initech", "qa", "usage", 300, 1, 9)],
            1000,
        )
        rows = con.execute(
            "SELECT pool, tenant, amount_nano FROM ledger_lines ORDER BY pool, tenant"
        ).fetchall()
        assert rows == [("chat", "acme", 700), ("chat", "initech", 300), ("other", "globex", 50)]
        assert con.execute("SELECT count(*) FROM invoices").fetchone() == (2,)


def test_failed_replace_keeps_the_previous_hour(tmp_path: Path) -> None:
    with connect(tmp_path / "w.duckdb") as con:
        publish(con, "chat", [("acme", "bot", "usage", 1000, 3, 30)], 1000)
        bad = lines("chat", [("acme", "bot", "usage", 1000, 3, 30)]).with_columns(
            tenant=pl.lit(None, dtype=pl.String)
        )
        with pytest.raises(duckdb.ConstraintException):
            replace_hour(
                con, HOUR, "chat", {"invoices": invoice("chat", 2000), "ledger_lines": bad}
            )
        assert con.execute("SELECT line_kind, amount_nano FROM ledger_lines").fetchall() == [
            ("usage", 1000)
        ]
        assert con.execute("SELECT amount_nano FROM invoices").fetchall() == [(1000,)]


def test_replace_hour_refuses_an_unknown_line_kind(tmp_path: Path) -> None:
    bad = lines("chat", [("acme", "bot", "not_a_kind", 1000, 3, 30)])
    with (
        connect(tmp_path / "w.duckdb") as con,
        pytest.raises(WarehouseError, match=r"line_kind \['not_a_kind'\]"),
    ):
        replace_hour(con, HOUR, "chat", {"invoices": invoice("chat", 1000), "ledger_lines": bad})


def test_replace_hour_refuses_rows_of_another_hour(tmp_path: Path) -> None:
    other = datetime(2026, 11, 30, 6, tzinfo=UTC)
    with (
        connect(tmp_path / "w.duckdb") as con,
        pytest.raises(WarehouseError, match="outside hour 2026-11-30T05"),
    ):
        replace_hour(con, HOUR, "chat", {"invoices": invoice("chat", 1, other)})


def test_views_show_only_hours_whose_blocking_checks_passed(tmp_path: Path) -> None:
    with connect(tmp_path / "w.duckdb") as con:
        publish(con, "chat", [("acme", "bot", "usage", 3_000_000_000, 4, 2000)], 3_000_000_000)
        publish(con, "other", [("acme", "bot", "usage", 5_000, 1, 10)], 5_000, passed=False)
        replace_hour(
            con,
            HOUR,
            "unchecked",
            {
                "invoices": invoice("unchecked", 7),
                "ledger_lines": lines("unchecked", [("acme", "x", "usage", 7, 1, 1)]),
            },
        )
        hourly = con.execute(
            "SELECT pool, tenant, amount_nano, amount_usd, requests, tokens, usd_per_request, usd_per_1k_tokens "
            "FROM tenant_costs_hourly"
        ).fetchall()
        assert [r[:6] for r in hourly] == [
            ("chat", "acme", 3_000_000_000, pytest.approx(3), 4, 2000)
        ]
        assert str(hourly[0][3]) == "3.000000000"
        assert hourly[0][6] == pytest.approx(0.75)
        assert hourly[0][7] == pytest.approx(1.5)
        held = con.execute("SELECT pool, reason FROM held_back_hours ORDER BY pool").fetchall()
        assert held == [
            ("other", "failed blocking checks: money"),
            ("unchecked", "not reconciled yet"),
        ]
        billed = con.execute("SELECT sum(BilledCost) FROM focus_costs").fetchone()
        assert billed is not None
        assert billed[0] == 3


def test_non_blocking_failure_still_publishes(tmp_path: Path) -> None:
    with connect(tmp_path / "w.duckdb") as con:
        publish(con, "chat", [("acme", "bot", "usage", 10, 1, 1)], 10)
        record_checks(
            con,
            HOUR,
            "chat",
            ["plausibility"],
            [Check(HOUR, "chat", "r0", "plausibility", False, blocking=False)],
        )
        assert con.execute("SELECT count(*) FROM published_hours").fetchone() == (1,)


def test_failed_check_alerts_once_per_finding(tmp_path: Path) -> None:
    # A real CheckResult: record_alerts takes those, where record_checks takes any row-like object.
    failing = [
        CheckResult(
            HOUR,
            "chat",
            "r1",
            "sequence",
            False,
            expected="e",
            observed="o",
            detail="missing 10-19",
            severity="ERROR",
            blocking=True,
            finding="gap",
        )
    ]
    with connect(tmp_path / "w.duckdb") as con:
        for _ in range(3):
            record_checks(con, HOUR, "chat", ["sequence"], failing)
            record_alerts(con, failing)
        assert con.execute("SELECT kind, replica, detail FROM alerts").fetchall() == [
            ("sequence", "r1", "missing 10-19")
        ]
        assert con.execute("SELECT count(*) FROM reconciliation").fetchone() == (1,)


def test_an_hours_alerts_add_each_new_finding_once_in_one_statement(tmp_path: Path) -> None:
    def result(replica: str | None, finding: str, detail: str, passed: bool = False) -> CheckResult:
        return CheckResult(
            HOUR, "chat", replica, "sequence", passed, "e", "o", detail, "ERROR", True, finding
        )

    with connect(tmp_path / "w.duckdb") as con:
        record_alerts(con, [result("r1", "gap", "first seen")])
        record_alerts(
            con,
            [
                result("r1", "gap", "seen again"),  # recorded before
                result("r2", "gap", "r2 first"),
                result("r2", "gap", "r2 repeated"),  # the same finding twice in one batch
                result(None, "torn", "pool-wide"),
                result("r3", "", "passed", passed=True),
            ],
        )
        assert con.execute(
            "SELECT kind, hour, pool, replica, detail FROM alerts ORDER BY detail"
        ).fetchall() == [
            ("sequence", HOUR.replace(tzinfo=None), "chat", "r1", "first seen"),
            ("sequence", HOUR.replace(tzinfo=None), "chat", None, "pool-wide"),
            ("sequence", HOUR.replace(tzinfo=None), "chat", "r2", "r2 first"),
        ]
        assert con.execute("SELECT count(DISTINCT dedup_key) FROM alerts").fetchone() == (3,)


def test_record_checks_refuses_unnamed_checks(tmp_path: Path) -> None:
    with connect(tmp_path / "w.duckdb") as con, pytest.raises(WarehouseError, match="time"):
        record_checks(con, HOUR, "chat", ["money"], [Check(HOUR, "chat", None, "time", True)])


def test_read_only_connection_cannot_write(tmp_path: Path) -> None:
    with connect(tmp_path / "w.duckdb"):
        pass
    with connect_read_only(tmp_path / "w.duckdb") as con, pytest.raises(duckdb.Error):
        con.execute("DELETE FROM invoices")
    with (
        pytest.raises(WarehouseError, match="no warehouse"),
        connect_read_only(tmp_path / "elsewhere" / "pipeline.duckdb"),
    ):
        pass


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(0, 10**12), min_size=1, max_size=5), min_size=1, max_size=4))
def test_replaying_any_sequence_of_runs_leaves_the_last(
    tmp_path_factory, runs: list[list[int]]
) -> None:
    path = tmp_path_factory.mktemp("w") / "w.duckdb"
    with connect(path) as con:
        for amounts in runs:
            rows = [("t", f"f{i}", "usage", a, 1, 1) for i, a in enumerate(amounts)]
            publish(con, "chat", rows, sum(amounts))
        stored = con.execute("SELECT amount_nano FROM ledger_lines ORDER BY feature").fetchall()
        invoiced_row = con.execute("SELECT sum(amount_nano) FROM tenant_costs_hourly").fetchone()
        assert invoiced_row is not None
        (invoiced,) = invoiced_row
    assert [r[0] for r in stored] == runs[-1]
    assert invoiced == sum(runs[-1])


def test_a_month_with_held_back_hours_is_not_closed(tmp_path: Path) -> None:
    with connect(tmp_path / STATE_FILE) as con:
        publish(con, "chat", [("acme", "bot", "usage", 1000, 3, 30)], 1000, passed=False)
    with pytest.raises(WarehouseError, match="2026-11-30T05 chat: failed blocking checks: money"):
        finance.close_month(tmp_path, date(2026, 11, 1))


def test_a_writing_connection_refuses_an_extension_file_whose_signature_fails(
    tmp_path, monkeypatch
):
    # Writing connections skip DuckDB's check on LOAD; load_extensions checks each file once
    # per version instead, so a file replaced after a good load is checked again.
    installed = warehouse.extension_file
    copy = tmp_path / installed("ducklake").name
    copy.write_bytes(installed("ducklake").read_bytes())
    monkeypatch.setattr(
        warehouse, "extension_file", lambda name: copy if name == "ducklake" else installed(name)
    )
    with duckdb.connect(config=warehouse.WRITER_CONFIG) as con:
        warehouse.load_extensions(con)
    tampered = bytearray(copy.read_bytes())
    tampered[len(tampered) // 2] ^= 0xFF
    # Replaced as an upgrade replaces it (a new file renamed over the old): the library loaded
    # above stays mapped from the old file, which writing in place would corrupt under it.
    replacement = tmp_path / "replacement"
    replacement.write_bytes(bytes(tampered))
    os.utime(replacement, ns=(0, copy.stat().st_mtime_ns + 1))
    os.replace(replacement, copy)
    with (
        duckdb.connect(config=warehouse.WRITER_CONFIG) as con,
        pytest.raises(duckdb.Error, match="signature"),
    ):
        warehouse.load_extensions(con)


def test_a_version_2_warehouse_is_refused_to_readers_until_a_writer_upgrades_it(
    tmp_path: Path,
) -> None:
    state = tmp_path / STATE_FILE
    with connect(state) as con:
        replace_hour(con, HOUR, "p", {"invoices": invoice("p", 7_200_000_000)})
        # What a version-2 writer left: the same tables but those version 3 added.
        con.execute("UPDATE ledger.schema_version SET version = 2")
        con.execute("DROP TABLE ledger.published_files")
        con.execute("DROP TABLE ledger.invoice_adjustments")
    with pytest.raises(WarehouseError) as refused:
        finance.connect(tmp_path).close()
    assert str(refused.value) == (
        f"{tmp_path / 'warehouse'}: warehouse schema version [2], this stepledger reads "
        f"version 3; the next billing run, or `stepledger migrate --data {tmp_path}`, upgrades "
        "it in place (version 3 adds tables only)"
    )
    with connect(state):
        pass
    reader = finance.connect(tmp_path)
    try:
        assert reader.execute("SELECT version FROM ledger.schema_version").fetchall() == [(3,)]
        assert reader.execute("SELECT amount_nano FROM invoices").fetchall() == [(7_200_000_000,)]
        assert reader.execute("SELECT count(*) FROM invoice_adjustments").fetchall() == [(0,)]
    finally:
        reader.close()


def snapshots(con: duckdb.DuckDBPyConnection) -> int:
    (count,) = con.execute("SELECT count(*) FROM ducklake_snapshots('ledger')").fetchall()[0]
    return int(count)


def sha256_of(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


def test_a_new_warehouse_is_created_in_one_snapshot_and_reopening_it_changes_nothing(
    tmp_path: Path,
) -> None:
    state = tmp_path / STATE_FILE
    with connect(state) as con:
        # DuckLake's own first snapshot, then the whole schema.
        assert snapshots(con) == 2
        assert con.execute(
            "SELECT version, schema_sha256 FROM ledger.schema_version"
        ).fetchall() == [(warehouse.SCHEMA_VERSION, sha256_of(warehouse.SCHEMA_SQL))]
        assert con.execute("SELECT sha256 FROM state_schema").fetchall() == [
            (sha256_of(warehouse.STATE_SQL),)
        ]
    for views in (True, False):
        with connect(state) as con:
            assert snapshots(con) == 2
        reopened = warehouse.open_state(
            state, None, lambda file: duckdb.connect(str(file)), views=views
        )
        try:
            assert snapshots(reopened) == 2
            defined = reopened.execute(
                "SELECT count(*) FROM duckdb_views() WHERE view_name = 'published_hours'"
            ).fetchone()
            assert defined == (int(views),)
        finally:
            reopened.close()


def test_a_connection_to_the_state_alone_neither_creates_nor_reaches_the_warehouse(
    tmp_path: Path,
) -> None:
    state = tmp_path / STATE_FILE
    con = warehouse.open_state(
        state, None, lambda file: duckdb.connect(str(file)), ledger=False, views=False
    )
    try:
        assert con.execute("SELECT count(*) FROM segment_files").fetchone() == (0,)
        with pytest.raises(duckdb.CatalogException, match="invoices"):
            con.execute("SELECT count(*) FROM invoices")
    finally:
        con.close()
    assert not warehouse.has_catalog(tmp_path / "warehouse")


def test_a_warehouse_from_before_the_recorded_sha256_is_upgraded_in_place(tmp_path: Path) -> None:
    state = tmp_path / STATE_FILE
    costs = pl.DataFrame(
        {
            "hour": [HOUR],
            "pool": ["p"],
            "request_id": ["r1"],
            **{column: ["t"] for column in ("tenant", "feature", "api_key_id")},
            "compute_nano": [3],
            "kv_nano": [2],
            "amount_nano": [5],
            **{
                c: [1]
                for c in ("steps", "new_tokens", "cached_tokens", "prompt_tokens", "output_tokens")
            },
        }
    )
    with connect(state) as con:
        replace_hour(con, HOUR, "p", {"invoices": invoice("p", 7_200_000_000)})
        # What an earlier release left: no sha256 recorded on either side, and a request_costs
        # from before its line_kind column.
        con.execute("ALTER TABLE ledger.schema_version DROP COLUMN schema_sha256")
        con.execute("ALTER TABLE ledger.request_costs DROP COLUMN line_kind")
        con.execute("DROP TABLE state_schema")
        replace_hour(con, HOUR, "p", {"request_costs": costs})
    with connect(state) as con:
        assert con.execute(
            "SELECT version, schema_sha256 FROM ledger.schema_version"
        ).fetchall() == [(warehouse.SCHEMA_VERSION, sha256_of(warehouse.SCHEMA_SQL))]
        assert con.execute("SELECT sha256 FROM state_schema").fetchall() == [
            (sha256_of(warehouse.STATE_SQL),)
        ]
        assert con.execute(
            "SELECT request_id, amount_nano, line_kind FROM request_costs"
        ).fetchall() == [("r1", 5, None)]
        upgraded = snapshots(con)
    with connect(state) as con:
        assert snapshots(con) == upgraded
    reader = finance.connect(tmp_path)
    try:
        assert reader.execute("SELECT amount_nano FROM invoices").fetchall() == [(7_200_000_000,)]
    finally:
        reader.close()


def test_a_changed_schema_is_applied_on_the_next_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / STATE_FILE
    with connect(state):
        pass
    schema, state_sql = tmp_path / "schema.sql", tmp_path / "pipeline_state.sql"
    schema.write_text(
        warehouse.SCHEMA_SQL.read_text() + "CREATE TABLE IF NOT EXISTS extra (x INTEGER);\n"
    )
    state_sql.write_text(
        warehouse.STATE_SQL.read_text() + "CREATE TABLE IF NOT EXISTS extra_state (y INTEGER);\n"
    )
    monkeypatch.setattr(warehouse, "SCHEMA_SQL", schema)
    monkeypatch.setattr(warehouse, "STATE_SQL", state_sql)
    with connect(state) as con:
        assert con.execute("SELECT count(*) FROM ledger.extra").fetchone() == (0,)
        assert con.execute("SELECT count(*) FROM extra_state").fetchone() == (0,)
        assert con.execute("SELECT schema_sha256 FROM ledger.schema_version").fetchall() == [
            (sha256_of(schema),)
        ]
        assert con.execute("SELECT sha256 FROM state_schema").fetchall() == [
            (sha256_of(state_sql),)
        ]


def test_a_warehouse_of_a_later_version_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    state = tmp_path / STATE_FILE
    with connect(state) as con:
        con.execute("UPDATE ledger.schema_version SET version = 4")
        before = snapshots(con)
    with pytest.raises(WarehouseError, match=r"schema version \[4\], this stepledger reads"):
        connect(state).__enter__()
    with duckdb.connect(str(state), config=warehouse.WRITER_CONFIG) as con:
        warehouse.attach_warehouse(con, tmp_path / "warehouse", read_only=True)
        assert snapshots(con) == before
        assert con.execute("SELECT version FROM ledger.schema_version").fetchall() == [(4,)]


def test_a_finance_connection_reads_on_one_thread(tmp_path: Path) -> None:
    with connect(tmp_path / STATE_FILE) as con:
        replace_hour(con, HOUR, "p", {"invoices": invoice("p", 7_200_000_000)})
    reader = finance.connect(tmp_path)
    try:
        assert reader.execute("SELECT current_setting('threads')").fetchall() == [(1,)]
        with pytest.raises(duckdb.Error, match="lock"):
            reader.execute("SET threads = 4")
    finally:
        reader.close()


def test_an_hours_checks_and_their_alerts_commit_as_one_snapshot(tmp_path: Path) -> None:
    """Reconciling an hour is one warehouse commit, its alerts included (each commit is a turn
    on the catalog that concurrent pool-hours take one after the other)."""
    failing = [
        CheckResult(HOUR, "chat", "r0", "sequence", False, "e", "o", "d", "ERROR", True, "gap")
    ]
    with connect(tmp_path / "w.duckdb") as con:
        publish(con, "chat", [("acme", "bot", "usage", 900, 3, 30)], 900)
        before = warehouse.current_snapshot(con)
        record_checks(
            con, HOUR, "chat", ["sequence"], failing, then=lambda con: add_alerts(con, failing)
        )
        assert warehouse.current_snapshot(con) == before + 1
        assert con.execute("SELECT kind, replica FROM alerts").fetchall() == [("sequence", "r0")]
        record_checks(con, HOUR, "chat", [], [], then=lambda con: add_alerts(con, failing))
        assert con.execute("SELECT count(*) FROM alerts").fetchall() == [(1,)]
