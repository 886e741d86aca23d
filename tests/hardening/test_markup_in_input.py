"""Paths and names from input that look like terminal markup print as text: `inspect`, `run`
and `demo` show "[bold]..." as it is named, and `run --json` gives the same finding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from assets.cli import main
from tests.helpers.fleets import simulate_small, small_pools

pytestmark = pytest.mark.timeout(300)

MARKUP = "[bold]fleet"


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rich folds long lines at the terminal's width; a path is asserted on one line.
    monkeypatch.setenv("COLUMNS", "1000")


def test_inspect_prints_a_damaged_file_under_a_markup_named_directory(
    tmp_path: Path, write_segment
) -> None:
    (path,) = write_segment(count=4, outbox=tmp_path / MARKUP)
    path.write_bytes(path.read_bytes()[:-10])
    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert result.exit_code == 1, result.output
    assert str(path) in result.output
    assert "torn_tail" in result.output


def test_run_prints_a_finding_naming_a_markup_named_replica(tmp_path: Path) -> None:
    """A replica named like markup, in a data directory named like markup (whose path is no
    glob pattern either)."""
    pools = small_pools()
    chat = pools.pools[0]
    replica = chat.replicas[0].model_copy(update={"id": "[bold]r0"})
    pools = pools.model_copy(
        update={"pools": [chat.model_copy(update={"replicas": [replica, *chat.replicas[1:]]})]}
    )
    data = simulate_small(tmp_path / MARKUP, pools, faults={"clock-jump": 7200.0})
    # The recorder opened a segment where the clock stepped: the finding names it.
    segment = sorted((data / "outbox" / "[bold]r0").glob("*.seg"))[-1].relative_to(data)
    finding = f"WARN clock: [bold]r0: {segment}: the wall clock stepped +7200.000 s"
    result = CliRunner().invoke(main, ["run", "--data", str(data)])
    assert result.exit_code == 0, result.output
    assert "2026-11-30T00 chat-8b: published with WARN" in result.output
    assert f"    {finding}" in result.output
    as_json = CliRunner().invoke(main, ["run", "--data", str(data), "--json"])
    (run,) = json.loads(as_json.stdout)
    assert [f for f in run["failed_checks"] if f.startswith(finding)]
