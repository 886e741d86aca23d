"""The verification sweep: every published pool-hour checked against its recorded digest and
data-file hashes, finding a data file changed while no run and no reader touched its hour."""

from __future__ import annotations

import json
import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.datadir import DataDir
from pipeline.storage.integrity import sweep_warehouse
from pipeline.storage.read_only_files import PublishedFileChanged
from pipeline.storage.warehouse import connect, warehouse_dir
from tests.helpers.published import double_every_amount, ledger_lines_file, publish_by_hand

HOURS = [datetime(2026, 11, 30, h, tzinfo=UTC) for h in (3, 4)]
POOLS = ("chat-8b", "chat-70b")


@pytest.fixture
def published(tmp_path: Path) -> Path:
    """Two hours of two pools published; the data directory."""
    with connect(DataDir(tmp_path).state_file) as con:
        for hour in HOURS:
            for pool in POOLS:
                publish_by_hand(con, hour, pool)
    return tmp_path


def changed_file(data: Path) -> Path:
    """The ledger-lines file of chat-70b 2026-11-30T04, changed in place."""
    with connect(DataDir(data).state_file) as con:
        file = ledger_lines_file(con, HOURS[1], "chat-70b")
    double_every_amount(file)
    return file


def test_an_untouched_warehouse_verifies(published: Path) -> None:
    sweep = sweep_warehouse(warehouse_dir(published))
    assert (sweep.hours, sweep.files, sweep.changed) == (4, 4, [])
    result = CliRunner().invoke(main, ["verify", "--data", str(published)])
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    assert result.stderr.startswith(
        "4 published pool-hour(s) of all hours verified, 4 data file(s) hashed in "
    )
    assert result.stderr.endswith(" s: 0 changed\n")


def test_a_changed_data_file_names_its_pool_hour_and_the_file(published: Path) -> None:
    file = changed_file(published)
    sweep = sweep_warehouse(warehouse_dir(published))
    (change,) = sweep.changed
    assert (change.hour, change.pool, change.check_name, change.finding) == (
        HOURS[1],
        "chat-70b",
        "integrity",
        "published_changed",
    )
    assert change.detail.startswith(
        f"{file} (ledger_lines of pool chat-70b hour 2026-11-30T04): sha256 "
    )
    assert change.detail.endswith(
        "the warehouse data file was changed after publishing, so it is not served (restore it "
        "from a backup)"
    )

    result = CliRunner().invoke(main, ["verify", "--data", str(published), "--json"])
    assert result.exit_code == PublishedFileChanged.exit_code == 5
    (line,) = result.stdout.splitlines()
    assert json.loads(line) == {
        "hour": "2026-11-30T04",
        "pool": "chat-70b",
        "finding": "published_changed",
        "detail": change.detail,
    }
    assert result.stderr.endswith(
        " s: 1 changed\nError: published pool-hour(s) changed since publishing: chat-70b "
        "2026-11-30T04; restore the named files under warehouse/data/ from a backup\n"
    )
    # The hours before are not what changed.
    before = CliRunner().invoke(main, ["verify", "--data", str(published), "--to", "2026-11-30T03"])
    assert before.exit_code == 0, before.output
    assert (
        "2 published pool-hour(s) of the first hour to 2026-11-30T03 UTC verified" in before.stderr
    )


def test_a_changed_invoice_in_the_catalog_is_found_by_the_rows_digest(published: Path) -> None:
    catalog = warehouse_dir(published) / "catalog.sqlite"
    with sqlite3.connect(catalog) as db:
        (table,) = db.execute(
            "SELECT name FROM sqlite_master WHERE name LIKE 'ducklake_inlined_data_%' "
            "AND sql LIKE '%usd_per_gpu_hour%'"
        ).fetchone()
        db.execute(
            f"UPDATE {table} SET amount_nano = amount_nano + 1 "
            "WHERE pool = 'chat-8b' AND hour = '2026-11-30 03:00:00'"
        )
    (change,) = sweep_warehouse(warehouse_dir(published)).changed
    assert (change.hour, change.pool) == (HOURS[0], "chat-8b")
    assert change.detail.startswith(
        "pool chat-8b hour 2026-11-30T03: its published rows (invoices, ledger lines, request "
        "costs) digest to "
    )
