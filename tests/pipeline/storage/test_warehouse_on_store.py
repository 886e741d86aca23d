"""The warehouse's data files on a real S3 server: an hour billed with them on the store is
the same, row for row, as the hour billed on local disk; finance reads it with the reader's
keys only and still cannot write, and an object changed after publishing is refused."""

from __future__ import annotations

import hashlib
import io
import shutil
from pathlib import Path

import dagster as dg
import duckdb
import polars as pl
import pyarrow.fs as pafs
import pytest

from pipeline import finance
from pipeline.datadir import DataDir
from pipeline.ship.s3server import S3Server
from pipeline.storage.data_files import (
    DATA_POINTER,
    READER_ACCESS_KEY,
    READER_SECRET_KEY,
    WAREHOUSE_DATA_VARIABLE,
    reader_data_files,
)
from pipeline.storage.integrity import IntegrityError, sweep_warehouse, verify_published_hour
from pipeline.storage.read_only_files import PROTOCOL, PublishedFileChanged, refusal_in
from pipeline.storage.warehouse import connect, data_files, warehouse_dir
from schemas.errors import ConfigError
from tests.helpers.fleets import bill, small_pools
from tests.helpers.hours import SIMULATED_HOUR

TABLES = ("invoices", "ledger_lines", "request_costs")
PREFIX = "warehouse-on-store"


def billed(simulated: Path, data: Path) -> Path:
    shutil.copytree(simulated, data)
    with dg.DagsterInstance.ephemeral() as instance:
        assert all(r.success for r in bill(data, small_pools(), instance))
    return data


@pytest.fixture(scope="module")
def local_run(simulated: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return billed(simulated, tmp_path_factory.mktemp("local") / "run")


@pytest.fixture(scope="module")
def store_run(simulated: Path, tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(WAREHOUSE_DATA_VARIABLE, s3_server.uri(PREFIX))
        yield billed(simulated, tmp_path_factory.mktemp("store") / "run")


def rows(data: Path) -> dict[str, pl.DataFrame]:
    with finance.connect(data) as con:
        return {
            table: con.execute(f"SELECT * EXCLUDE (filename) FROM {table} ORDER BY ALL").pl()
            if "filename" in con.execute(f"SELECT * FROM {table} LIMIT 0").pl().columns
            else con.execute(f"SELECT * FROM {table} ORDER BY ALL").pl()
            for table in TABLES
        }


def objects(server: S3Server) -> dict[str, str]:
    """Every object under the warehouse's prefix, by key, with the sha256 of its bytes."""
    store = server.filesystem()
    found = store.get_file_info(pafs.FileSelector(f"{server.bucket}/{PREFIX}", recursive=True))
    return {
        info.path: hashlib.sha256(store.open_input_stream(info.path).read()).hexdigest()
        for info in found
        if info.type == pafs.FileType.File
    }


def test_the_hour_billed_on_the_store_reads_the_same_as_on_disk(local_run, store_run, s3_server):
    warehouse = warehouse_dir(store_run)
    assert not any((warehouse / "data").rglob("*.parquet"))
    stored = [key for key in objects(s3_server) if key.endswith(".parquet")]
    assert stored
    local, on_store = rows(local_run), rows(store_run)
    assert local["ledger_lines"].height > 0
    for table in TABLES:
        assert on_store[table].equals(local[table]), table
    with finance.connect(store_run) as con:
        published = con.execute("SELECT path FROM published_files").fetchall()
    assert len(published) >= len(TABLES) - 1
    assert {f"{s3_server.bucket}/{PREFIX}/{path}" for (path,) in published} <= set(stored)


def test_no_key_is_written_anywhere(store_run, s3_server):
    """The writer's and the reader's keys are in no file of the run: not the catalog, the
    pipeline's state, the data-path pointer, nor anything else."""
    env = s3_server.env()
    keys = [
        env[name].encode()
        for name in (
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            READER_ACCESS_KEY,
            READER_SECRET_KEY,
        )
    ]
    for path in store_run.rglob("*"):
        if path.is_file():
            content = path.read_bytes()
            assert not any(key in content for key in keys), path
    assert (warehouse_dir(store_run) / DATA_POINTER).read_text().count("s3://") == 1


LOCAL_FILES_OFF = "File system LocalFileSystem has been disabled by configuration"
OUTSIDE = "file system operations are disabled by configuration"
READ_ONLY = "ReadOnlyFileRefused: .*read-only here"
# (statement, DuckDB's error class, message) for a finance connection of a warehouse on the
# store: it has no way to the store but ReadOnlyFiles (no httpfs, no S3 secret type).
STORE_ESCAPES = {
    "copy into the store": (
        "COPY (SELECT 1 AS one) TO 's3://{bucket}/{prefix}/mine.csv'",
        duckdb.PermissionException,
        LOCAL_FILES_OFF,
    ),
    "copy over a published object": (
        f"COPY (SELECT 1 AS one) TO '{PROTOCOL}://{{object}}' (FORMAT parquet)",
        duckdb.Error,
        READ_ONLY,
    ),
    "attach a database on the store": (
        "ATTACH 's3://{bucket}/{prefix}/mine.duckdb' AS mine",
        duckdb.Error,
        "requires the extension httpfs to be loaded",
    ),
    "export among the data files": (
        f"EXPORT DATABASE '{PROTOCOL}://{{bucket}}/{{prefix}}/export'",
        duckdb.Error,
        READ_ONLY,
    ),
    "write beside the data path": (
        f"COPY (SELECT 1 AS one) TO '{PROTOCOL}://{{bucket}}/elsewhere.parquet' (FORMAT parquet)",
        duckdb.PermissionException,
        OUTSIDE,
    ),
    "read beside the data path": (
        f"SELECT * FROM read_parquet('{PROTOCOL}://{{bucket}}/x/*')",
        duckdb.PermissionException,
        OUTSIDE,
    ),
    "create a secret for the store": (
        "CREATE SECRET mine (TYPE s3, KEY_ID 'k', SECRET 's')",
        duckdb.InvalidInputException,
        "Secret type 's3' does not exist",
    ),
    "load httpfs": (
        "LOAD httpfs",
        duckdb.PermissionException,
        "Loading external extensions is disabled",
    ),
    "rewrite the data files in maintenance": ("CHECKPOINT ledger", duckdb.Error, READ_ONLY),
}


@pytest.mark.parametrize(
    ("statement", "kind", "message"), STORE_ESCAPES.values(), ids=STORE_ESCAPES
)
def test_a_finance_reader_of_the_store_cannot_write(store_run, s3_server, statement, kind, message):
    before = objects(s3_server)
    parquet = sorted(key for key in before if key.endswith(".parquet"))[0]
    filled = statement.format(bucket=s3_server.bucket, prefix=PREFIX, object=parquet)
    with finance.connect(store_run) as con, pytest.raises(kind, match=message) as raised:
        con.execute(filled)
    assert type(raised.value) is kind
    assert objects(s3_server) == before


def test_the_reader_keys_cannot_write_to_the_store(store_run, s3_server):
    reader = reader_data_files(warehouse_dir(store_run))
    with (
        pytest.raises(OSError, match="ACCESS_DENIED"),
        reader.filesystem.open_output_stream(reader.path("mine.txt")) as stream,
    ):
        stream.write(b"mine")


def test_a_reader_without_reader_keys_is_refused(store_run, monkeypatch):
    monkeypatch.delenv(READER_ACCESS_KEY)
    with pytest.raises(ConfigError, match=READER_ACCESS_KEY):
        finance.connect(store_run)


def test_another_data_path_for_a_warehouse_is_refused(store_run, monkeypatch):
    monkeypatch.setenv(WAREHOUSE_DATA_VARIABLE, "s3://elsewhere/wh")
    with (
        pytest.raises(ConfigError, match="keeps its data files in s3://"),
        connect(DataDir(store_run).state_file),
    ):
        pass


def test_a_changed_object_is_refused_naming_it(store_run, s3_server):
    """By finance's reads, the verification sweep and a re-run about to replace the hour.
    Last: it leaves an object changed."""
    with finance.connect(store_run) as con:
        (path,) = con.execute(
            "SELECT path FROM published_files WHERE table_name = 'ledger_lines' LIMIT 1"
        ).fetchall()[0]
    key = f"{s3_server.bucket}/{PREFIX}/{path}"
    store = s3_server.filesystem()
    frame = pl.read_parquet(io.BytesIO(store.open_input_stream(key).read()))
    doubled = io.BytesIO()
    frame.with_columns(amount_nano=pl.col("amount_nano") * 2).write_parquet(doubled)
    with store.open_output_stream(key) as stream:
        stream.write(doubled.getvalue())
    with finance.connect(store_run) as con, pytest.raises(duckdb.Error) as raised:
        con.execute("SELECT sum(amount_nano) FROM ledger_lines").fetchall()
    refusal = refusal_in(raised.value)
    assert isinstance(refusal, PublishedFileChanged)
    assert f"s3://{key} (ledger_lines of pool chat-8b" in str(refusal)
    (change,) = sweep_warehouse(warehouse_dir(store_run)).changed
    assert change.pool == "chat-8b"
    assert f"s3://{key} (ledger_lines of pool chat-8b" in change.detail
    with connect(DataDir(store_run).state_file) as con, pytest.raises(IntegrityError) as rerun:
        verify_published_hour(con, data_files(con), SIMULATED_HOUR, "chat-8b")
    assert f"s3://{key} (ledger_lines of pool chat-8b" in str(rerun.value)
