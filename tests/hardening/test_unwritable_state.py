"""A data directory whose pipeline state cannot be written: every pool still runs, each
failure is one line naming the path, and on-call is paged straight through the sink (here
standard output, which needs no disk) instead of the outbox.

The state file is made a directory: opening it fails for every user, root included, where
a read-only permission or mount would not stop root or would need privileges to set up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from assets.cli import main
from pipeline.storage.warehouse import STATE_FILE
from schemas.config import load_pools
from tests.helpers.fleets import simulate_small


def test_every_pool_runs_and_pages_when_the_state_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "1000")
    for name in (
        "STEPLEDGER_ALERT_WEBHOOK_URL",
        "STEPLEDGER_PAGERDUTY_ROUTING_KEY",
        "STEPLEDGER_ALERT_FORMAT",
        "STEPLEDGER_ALERT_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    pools = load_pools()
    one_replica_each = pools.model_copy(
        update={"pools": [p.model_copy(update={"replicas": p.replicas[:1]}) for p in pools.pools]}
    )
    data = simulate_small(tmp_path / "run", one_replica_each)
    state = data / STATE_FILE
    state.mkdir()
    result = CliRunner().invoke(main, ["run", "--data", str(data)])
    assert result.exit_code == 1, result.output
    names = [p.name for p in pools.pools]
    assert len(names) == 2
    for pool in names:
        assert f"2026-11-30T00 {pool}: failed: " in result.stdout
        assert (
            f"{state}: the pipeline's state cannot be written (IO Error: Could not read from "
            f'file "{state}": Is a directory); 2026-11-30T00 {pool} cannot be recorded or its '
            "pages kept"
        ) in result.stderr.splitlines()
    paged = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [(a["kind"], a["pool"], a["hour"]) for a in paged] == [
        ("run_failed", pool, "2026-11-30T00") for pool in names
    ]
    assert all(str(state) in a["detail"] for a in paged)
    assert "Traceback" not in result.output
