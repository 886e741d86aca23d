"""Published money is tamper-evident, and an hour is never re-billed from less data than it had:
a small simulated fleet billed once through the pool-hour job, then its warehouse or lake
changed behind the pipeline's back. Every read refuses a changed data file, a re-run refuses to
replace the hour, a re-run with lake files missing holds the hour, and the money finance sees
stays exactly that of the clean run."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path
from typing import Any

import dagster as dg
import duckdb
import polars as pl
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from assets.cli import main
from pipeline import finance
from pipeline.storage.integrity import IntegrityError, rows_digest
from pipeline.storage.read_only_files import PublishedFileChanged, refusal_in
from pipeline.storage.warehouse import SCHEMA_SQL, STATE_FILE, connect
from schemas.config import PoolsFile
from schemas.units import hour_key, to_warehouse
from tests.helpers.api_server import serving
from tests.helpers.fleets import bill, costs, simulate_small, small_pools
from tests.helpers.hours import SIMULATED_HOUR

pytestmark = pytest.mark.timeout(600)

POOL = "chat-8b"
REPLICA = "chat-8b-r0"
ONE_DOLLAR_NANO = 1_000_000_000
# How a run's failure names the error that stopped it.
REFUSED = f"{IntegrityError.__module__}.{IntegrityError.__name__}: "


@pytest.fixture(scope="module")
def billed(tmp_path_factory: pytest.TempPathFactory) -> tuple[PoolsFile, Path, dict[str, Any]]:
    pools = small_pools()
    data = simulate_small(tmp_path_factory.mktemp("integrity") / "fleet", pools)
    with dg.DagsterInstance.ephemeral() as instance:
        (result,) = bill(data, pools, instance)
    assert result.success
    money = costs(data)
    assert money["published"]
    assert money["held_back"] == []
    return pools, data, money


@pytest.fixture
def fleet(billed, tmp_path: Path) -> tuple[PoolsFile, Path, dict[str, Any]]:
    """A copy of the billed fleet to change, with the clean run's money."""
    pools, data, money = billed
    copy = tmp_path / "fleet"
    shutil.copytree(data, copy, symlinks=True)
    return pools, copy, money


def rebill_error(data: Path, pools: PoolsFile) -> str | None:
    """Bill the hour again (a new Dagster instance: nothing remembered but the data directory);
    the error that failed the run, or None if it succeeded."""
    with dg.DagsterInstance.ephemeral() as instance:
        (result,) = bill(data, pools, instance)
    if result.success:
        return None
    (failure,) = result.get_step_failure_events()
    error = failure.step_failure_data.error
    while error is not None and error.cause is not None:
        error = error.cause
    assert error is not None
    return error.message.strip()


def ledger_lines_file(data: Path) -> Path:
    with finance.connect(data) as con:
        (path,) = con.execute(
            "SELECT path FROM published_files WHERE table_name = 'ledger_lines'"
        ).fetchall()[0]
    return data / "warehouse" / "data" / str(path)


def add_a_dollar_to_a_usage_line(file: Path) -> None:
    """Rewrite the data file in place: its first usage line a dollar dearer."""
    lines = pl.read_parquet(file)
    first_usage = lines.with_row_index().filter(pl.col("line_kind") == "usage")["index"][0]
    lines.with_columns(
        amount_nano=pl.when(pl.int_range(pl.len()) == first_usage)
        .then(pl.col("amount_nano") + ONE_DOLLAR_NANO)
        .otherwise(pl.col("amount_nano"))
    ).write_parquet(file)


def test_a_changed_warehouse_file_is_refused_by_every_read_and_every_run(fleet) -> None:
    pools, data, clean = fleet
    file = ledger_lines_file(data)
    original = file.read_bytes()
    add_a_dollar_to_a_usage_line(file)
    with duckdb.connect() as con:
        served = con.execute(f"SELECT sum(amount_nano) FROM read_parquet('{file}')").fetchall()
    clean_total = sum(row[3] for row in clean["published"])
    assert served == [(clean_total + ONE_DOLLAR_NANO,)]

    where = f"(ledger_lines of pool {POOL} hour {hour_key(SIMULATED_HOUR)})"
    with finance.connect(data) as con, pytest.raises(duckdb.Error) as refused:
        con.execute("SELECT sum(amount_nano) FROM published_ledger_lines").fetchall()
    error = refusal_in(refused.value)
    assert isinstance(error, PublishedFileChanged)
    assert str(error).startswith(f"{file} {where}: sha256 ")
    for command in (["costs"], ["sql", "-c", "SELECT * FROM ledger_lines"]):
        result = CliRunner().invoke(main, [*command, "--data", str(data)])
        assert result.exit_code == PublishedFileChanged.exit_code, result.output
        assert result.stderr == f"Error: {error}\n"

    # The run does not put the published hour back as if nothing happened: it refuses.
    message = rebill_error(data, pools)
    assert message is not None
    assert message.startswith(f"{REFUSED}published_changed: {file} {where}: sha256 ")
    assert file.read_bytes() != original

    file.write_bytes(original)
    assert costs(data) == clean
    assert rebill_error(data, pools) is None
    assert costs(data) == clean


def test_published_rows_changed_in_the_catalog_are_refused_by_a_run(fleet) -> None:
    """The invoice is small enough that DuckLake keeps it in the catalog, not a data file: the
    rows digest catches a change there."""
    pools, data, clean = fleet
    catalog = data / "warehouse" / "catalog.sqlite"
    with sqlite3.connect(catalog) as db:
        (table,) = db.execute(
            "SELECT name FROM sqlite_master WHERE name LIKE 'ducklake_inlined_data_%' "
            "AND sql LIKE '%usd_per_gpu_hour%'"
        ).fetchone()
        db.execute(f"UPDATE {table} SET amount_nano = amount_nano + {ONE_DOLLAR_NANO}")
    message = rebill_error(data, pools)
    assert message is not None
    assert message.startswith(
        f"{REFUSED}published_changed: pool {POOL} hour {hour_key(SIMULATED_HOUR)}: its "
        "published rows (invoices, ledger lines, request costs) digest to "
    )
    with finance.connect(data) as con:
        assert con.execute("SELECT sum(amount_nano) FROM invoices").fetchall() == [
            (sum(row[3] for row in clean["published"]) + ONE_DOLLAR_NANO,)
        ]


def test_a_published_hour_records_the_digest_of_its_rows(fleet) -> None:
    _, data, _ = fleet
    with connect(data / STATE_FILE) as con:
        recorded = con.execute("SELECT hour, pool, rows_sha256 FROM published_digests").fetchall()
        assert recorded == [
            (to_warehouse(SIMULATED_HOUR), POOL, rows_digest(con, SIMULATED_HOUR, POOL))
        ]


def warehouse_tables() -> duckdb.DuckDBPyConnection:
    """An in-memory database with the warehouse's tables."""
    con = duckdb.connect()
    con.execute(SCHEMA_SQL.read_text())
    return con


AMOUNTS = st.lists(st.integers(-(2**62), 2**62), min_size=1, max_size=30)


@given(amounts=AMOUNTS, order=st.randoms(use_true_random=False), changed=st.data())
@settings(max_examples=40, deadline=None)
def test_the_rows_digest_is_of_the_rows_not_of_their_order(amounts, order, changed) -> None:
    lines = [
        (
            to_warehouse(SIMULATED_HOUR),
            POOL,
            f"t{i % 3}",
            f"f{i}",
            "usage",
            amount,
            i,
            0,
            0,
            "w",
            "p",
        )
        for i, amount in enumerate(amounts)
    ]
    with warehouse_tables() as con:
        con.executemany(f"INSERT INTO ledger_lines VALUES ({', '.join('?' * 11)})", lines)
        published = rows_digest(con, SIMULATED_HOUR, POOL)
        shuffled = list(lines)
        order.shuffle(shuffled)
        con.execute("DELETE FROM ledger_lines")
        con.executemany(f"INSERT INTO ledger_lines VALUES ({', '.join('?' * 11)})", shuffled)
        assert rows_digest(con, SIMULATED_HOUR, POOL) == published
        index = changed.draw(st.integers(0, len(lines) - 1))
        delta = changed.draw(st.integers(1, 10**9))
        con.execute(
            "UPDATE ledger_lines SET amount_nano = amount_nano + ? WHERE requests = ?",
            [delta, index],
        )
        assert rows_digest(con, SIMULATED_HOUR, POOL) != published


@pytest.mark.parametrize("deleted", ["one replica's slots file", "the whole lake"])
def test_a_rerun_with_lake_files_missing_holds_the_hour(fleet, deleted: str) -> None:
    pools, data, clean = fleet
    lake = data / "lake"
    partition = lake / "slots" / f"pool={POOL}" / f"hour={hour_key(SIMULATED_HOUR)}"
    (replica_file,) = partition.glob(f"{REPLICA}.*.parquet")
    kept = replica_file.read_bytes()
    if deleted == "the whole lake":
        shutil.rmtree(lake)
        missing = f"of the {count_lake_files(data)} lake files ingest wrote for it are missing"
    else:
        replica_file.unlink()
        missing = f"1 of the {count_lake_files(data)} lake files ingest wrote for it are missing"

    message = rebill_error(data, pools)
    assert message is not None
    assert message.startswith(
        f"{REFUSED}lake_files_missing: pool {POOL} hour {hour_key(SIMULATED_HOUR)}: "
    )
    assert missing in message
    assert str(replica_file) in message or deleted == "the whole lake"
    assert "held and its published ledger kept" in message
    assert costs(data) == clean

    if deleted == "one replica's slots file":
        replica_file.write_bytes(kept)
        assert rebill_error(data, pools) is None
        assert costs(data) == clean


def count_lake_files(data: Path) -> int:
    with connect(data / STATE_FILE) as con:
        return int(
            con.execute(
                "SELECT count(*) FROM lake_files WHERE path LIKE ?",
                [f"%/pool={POOL}/hour={hour_key(SIMULATED_HOUR)}/%"],
            ).fetchall()[0][0]
        )


def test_a_reader_kept_open_verifies_the_files_of_hours_published_after_it_opened(fleet) -> None:
    """A server's connections stay open while hours are billed again: each read verifies the
    files of the snapshot it reads, not those published when the connection opened."""
    pools, data, clean = fleet
    total = "SELECT sum(amount_nano) FROM published_ledger_lines"
    clean_total = sum(row[3] for row in clean["published"])
    spend = f"/v1/spend?from={hour_key(SIMULATED_HOUR)}&to={hour_key(SIMULATED_HOUR)}"
    reader = finance.snapshot_reader(data)
    try:
        with serving(data, "acme-support") as api:
            assert reader.read(lambda con: con.execute(total).fetchall())[1] == [(clean_total,)]
            # The route's connection opens and reads now, before the hour is billed again.
            status, clean_spend = api.get(spend, api.finance)
            assert (status, clean_spend[0]["amount_nano"]) == (200, clean_total)
            published_then = ledger_lines_file(data)
            assert rebill_error(data, pools) is None
            file = ledger_lines_file(data)
            assert file != published_then
            published = file.read_bytes()
            add_a_dollar_to_a_usage_line(file)

            with pytest.raises(duckdb.Error) as refused:
                reader.read(lambda con: con.execute(total).fetchall())
            error = refusal_in(refused.value)
            assert isinstance(error, PublishedFileChanged)
            where = f"(ledger_lines of pool {POOL} hour {hour_key(SIMULATED_HOUR)})"
            assert str(error).startswith(f"{file} {where}: sha256 ")
            assert api.get(spend, api.finance) == (500, {"error": str(error)})

            file.write_bytes(published)
            assert reader.read(lambda con: con.execute(total).fetchall())[1] == [(clean_total,)]
            assert api.get(spend, api.finance) == (200, clean_spend)
    finally:
        reader.close()
