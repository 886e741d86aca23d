from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from pipeline.datadir import DataDir, OutputPathError, check_output
from schemas.config import DEFAULT_POOLS_PATH


def test_a_data_directory_names_each_of_its_paths(tmp_path: Path) -> None:
    layout = DataDir(tmp_path)
    paths = {
        "outbox": layout.outbox,
        "replica outbox": layout.replica_outbox("chat-8b-r0"),
        "gateway": layout.gateway,
        "dcgm": layout.dcgm,
        "lake": layout.lake,
        "redelivery": layout.redelivery,
        "pools": layout.own_pools_file,
        "calibration": layout.calibration_file,
        "state": layout.state_file,
        "warehouse": layout.warehouse,
        "previous layout": layout.previous_layout_file,
        "sent alert keys": layout.sent_alert_keys,
    }
    assert {what: str(path.relative_to(tmp_path)) for what, path in paths.items()} == {
        "outbox": "outbox",
        "replica outbox": "outbox/chat-8b-r0",
        "gateway": "gateway",
        "dcgm": "dcgm",
        "lake": "lake",
        "redelivery": "redelivery",
        "pools": "pools.yaml",
        "calibration": "calibration.yaml",
        "state": "pipeline.duckdb",
        "warehouse": "warehouse",
        "previous layout": "warehouse.duckdb",
        "sent alert keys": "alerts_sent.keys",
    }


def test_the_pools_are_the_directorys_own_else_the_default(tmp_path: Path) -> None:
    layout = DataDir(tmp_path)
    assert layout.pools_file == DEFAULT_POOLS_PATH
    (tmp_path / "pools.yaml").write_text("pools: []\n")
    assert layout.pools_file == tmp_path / "pools.yaml"


def test_the_hours_are_those_the_gateway_logged(tmp_path: Path) -> None:
    (tmp_path / "gateway").mkdir()
    for key in ("2026-11-30T05", "2026-11-29T23", "2026-11-30T00"):
        (tmp_path / "gateway" / f"{key}.jsonl").touch()
    (tmp_path / "gateway" / "notes.txt").touch()
    assert DataDir(tmp_path).hours() == [
        datetime(2026, 11, 29, 23, tzinfo=UTC),
        datetime(2026, 11, 30, 0, tzinfo=UTC),
        datetime(2026, 11, 30, 5, tzinfo=UTC),
    ]


@pytest.mark.parametrize(
    "inside",
    [
        "outbox/r0/1.seg",
        "gateway/2026-11-30T00.jsonl",
        "dcgm/host/x.prom",
        "lake/steps/x.parquet",
        "redelivery/outbox/r0/1.seg",
        "warehouse/catalog.sqlite",
        "pools.yaml",
        "calibration.yaml",
        "pipeline.duckdb",
        "pipeline.duckdb.wal",
        "warehouse.duckdb",
    ],
)
def test_no_output_replaces_what_the_directory_holds(tmp_path: Path, inside: str) -> None:
    with pytest.raises(OutputPathError, match="refusing to write there") as refused:
        check_output(tmp_path / inside, tmp_path)
    assert refused.value.exit_code == 3
