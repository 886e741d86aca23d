"""A command's output file never replaces its inputs, a data directory's files or the
warehouse, however the path reaches them: directly, beneath a directory, as a database's
sidecar, through a symlink, a symlinked directory, `..` or a hard link."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from assets.cli import main
from pipeline.datadir import OutputPathError, check_output

COMMANDS = {
    "report": ["report"],
    "costs": ["costs", "--format", "csv"],
    "export": ["export", "focus"],
}
FILES = (
    "pipeline.duckdb",
    "pools.yaml",
    "calibration.yaml",
    "warehouse/catalog.sqlite",
    "lake/steps/pool=p/hour=2026-11-30T00/r0.000000000000.b1.parquet",
    "outbox/r0/r0.000000000000.abc.seg",
    "gateway/2026-11-30T00.jsonl",
)


@pytest.fixture
def data(tmp_path: Path) -> Path:
    """A data directory's files, each holding its own name (the guard reads none of them)."""
    root = tmp_path / "data"
    for name in FILES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)
    return root


def contents(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): p.read_text()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def targets(data: Path, tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """How an output path can reach a protected file -> (path, what the error names)."""
    (data / "latest.html").symlink_to(data / "pipeline.duckdb")
    (tmp_path / "alias").symlink_to(data, target_is_directory=True)
    os.link(data / "pools.yaml", tmp_path / "pools-link.yaml")
    return {
        "state file": (data / "pipeline.duckdb", "it is the data directory's pipeline.duckdb"),
        "pools file": (data / "pools.yaml", "it is the data directory's pools.yaml"),
        "in the warehouse": (
            data / "warehouse" / "catalog.sqlite",
            "it is inside the data directory's warehouse",
        ),
        "new file in the lake": (
            data / "lake" / "new.parquet",
            "it is inside the data directory's lake",
        ),
        "sidecar": (
            data / "pipeline.duckdb.wal",
            "it is a file its database keeps beside the data directory's pipeline.duckdb",
        ),
        "symlink": (data / "latest.html", "it is the data directory's pipeline.duckdb"),
        "symlinked directory": (
            tmp_path / "alias" / "gateway" / "2026-11-30T00.jsonl",
            "it is inside the data directory's gateway",
        ),
        "dot-dot": (
            data / "gateway" / ".." / "outbox" / "r0" / "x.seg",
            "it is inside the data directory's outbox",
        ),
        "hard link": (tmp_path / "pools-link.yaml", "it is the data directory's pools.yaml"),
    }


@pytest.mark.parametrize("command", COMMANDS)
def test_no_output_replaces_a_file_of_the_data_directory(
    command: str, data: Path, tmp_path: Path
) -> None:
    before = contents(data)
    for how, (out, what) in targets(data, tmp_path).items():
        result = CliRunner().invoke(
            main, [*COMMANDS[command], "--data", str(data), "--out", str(out)]
        )
        assert result.exit_code == 3, (how, result.output)
        message = " ".join(result.output.split())
        assert message.startswith(f"Error: {out}: refusing to write there, {what} ("), (
            how,
            message,
        )
        assert contents(data) == before, how


def test_the_report_refuses_to_replace_a_warehouse_named_elsewhere(
    data: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "ledger.duckdb"
    elsewhere.write_text("ledger")
    result = CliRunner().invoke(
        main,
        ["report", "--data", str(data), "--warehouse", str(elsewhere), "--out", str(elsewhere)],
    )
    assert result.exit_code == 3
    assert f"{elsewhere}: refusing to write there, it is an input of this command" in " ".join(
        result.output.split()
    )
    assert elsewhere.read_text() == "ledger"


def test_outputs_beside_the_data_directory_or_of_its_own_reports_are_allowed(
    data: Path, tmp_path: Path
) -> None:
    for out in (data / "report-all.html", data / "costs.csv", tmp_path / "focus.parquet"):
        assert check_output(out, data) == out.resolve()
    with pytest.raises(OutputPathError, match="it is the data directory's lake "):
        check_output(data / "lake", data)
