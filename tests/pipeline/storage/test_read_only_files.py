"""A finance connection's files under a directory named with glob wildcards: a pattern that
begins with the directory escaped (`ReadOnlyFiles.pattern`, as DuckDB escapes a local path)
finds the files below it, and nothing outside it, and still writes nothing."""

from __future__ import annotations

import os
from pathlib import Path

import duckdb
import polars as pl
import pytest

from pipeline.storage.read_only_files import ReadOnlyFiles


@pytest.mark.parametrize("name", ["[bold]demo", "run*1", "run?1", "plain"])
def test_a_pattern_below_a_wildcard_named_directory_reads_its_files(
    tmp_path: Path, name: str
) -> None:
    lake = tmp_path / name / "lake"
    partition = lake / "steps" / "hour=1"
    partition.mkdir(parents=True)
    pl.DataFrame({"tokens": [3, 4]}).write_parquet(partition / "a.parquet")
    # A file outside the directory, reachable by a symbolic link from inside it.
    outside = tmp_path / "outside"
    outside.mkdir()
    pl.DataFrame({"tokens": [1000]}).write_parquet(outside / "b.parquet")
    os.symlink(outside, lake / "steps" / "hour=2")
    files = ReadOnlyFiles(lake)
    con = duckdb.connect()
    con.register_filesystem(files)
    pattern = files.pattern(lake) + "steps/*/*.parquet"

    rows = con.execute(
        f"SELECT hour, tokens FROM read_parquet('{pattern}', hive_partitioning = true) "
        "ORDER BY tokens"
    ).fetchall()

    assert rows == [(1, 3), (1, 4)]
    assert files.glob(pattern) == [str(partition / "a.parquet")]
    with pytest.raises(duckdb.Error, match="read-only here"):
        con.execute(f"COPY (SELECT 1 AS tokens) TO '{files.pattern(lake)}steps/hour=1/a.parquet'")
    assert pl.read_parquet(partition / "a.parquet", glob=False)["tokens"].to_list() == [3, 4]
