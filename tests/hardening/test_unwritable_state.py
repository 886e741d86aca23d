"""A data directory whose pipeline state cannot be written: every pool still runs, each
failure is one line naming the path, and on-call is paged straight through the sink (standard
error, or a webhook: neither needs the disk) instead of the outbox. A Dagster instance that
cannot be written stops the run before any pool-hour, in one line naming its directory.

The state file is made a directory: opening it fails for every user, root included, where
a read-only permission or mount would not stop root. A full disk is a real one: a small tmpfs
filled to the last byte (mounting needs root; without it that test is skipped, saying so)."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner

from assets.cli import main
from pipeline.cli.dagster_instance import INSTANCE_TEMPLATE
from pipeline.reconcile.alerts import RUN_FAILED_TODO
from pipeline.storage.warehouse import STATE_FILE, connect
from schemas.config import PoolsFile, load_pools
from schemas.errors import StateError
from tests.helpers.fleets import simulate_small
from tests.helpers.webhooks import RecordingSink

ALERT_VARIABLES = (
    "STEPLEDGER_ALERT_WEBHOOK_URL",
    "STEPLEDGER_PAGERDUTY_ROUTING_KEY",
    "STEPLEDGER_ALERT_FORMAT",
    "STEPLEDGER_ALERT_FILE",
)


def one_replica_each() -> PoolsFile:
    pools = load_pools()
    return pools.model_copy(
        update={"pools": [p.model_copy(update={"replicas": p.replicas[:1]}) for p in pools.pools]}
    )


@pytest.fixture(autouse=True)
def no_alert_sink_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "1000")
    for name in ALERT_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_every_pool_runs_and_pages_when_the_state_cannot_be_written(tmp_path: Path) -> None:
    pools = load_pools()
    data = simulate_small(tmp_path / "run", one_replica_each())
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
    # Pages printed by the default sink go to standard error: the table stays clean.
    assert not [line for line in result.stdout.splitlines() if line.startswith("{")]
    paged = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert [(a["kind"], a["pool"], a["hour"]) for a in paged] == [
        ("run_failed", pool, "2026-11-30T00") for pool in names
    ]
    assert all(str(state) in a["detail"] for a in paged)
    assert "Traceback" not in result.output


@contextmanager
def full_filesystem(mount_point: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` at `mount_point`, unmounted at the end; skips the test without the
    privilege to mount."""
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def fill(directory: Path) -> None:
    """Write zeros into `directory` until its filesystem refuses with ENOSPC."""
    refused: OSError | None = None
    with (directory / "filler").open("wb", buffering=0) as filler:
        while refused is None:
            try:
                filler.write(b"\0" * 65536)
            except OSError as err:
                refused = err
    assert refused.errno == errno.ENOSPC


def test_a_full_disk_names_the_path_pages_through_the_webhook_and_every_pool_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = simulate_small(tmp_path / "source", one_replica_each())
    with full_filesystem(tmp_path / "full", "32m") as disk, RecordingSink() as webhook:
        data = disk / "run"
        shutil.copytree(source, data)
        fill(disk)
        monkeypatch.setenv("STEPLEDGER_ALERT_WEBHOOK_URL", webhook.url)
        # The Dagster instance lives apart from the data, as in production (DAGSTER_HOME).
        monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
        result = CliRunner().invoke(main, ["run", "--data", str(data)])
        state = data / STATE_FILE
        state_left = state.exists()
    assert result.exit_code == 1, result.output
    names = [p.name for p in load_pools().pools]
    for pool in names:
        (line,) = [
            row for row in result.stdout.splitlines() if row.startswith(f"2026-11-30T00 {pool}: ")
        ]
        assert line.startswith(f"2026-11-30T00 {pool}: failed: ")
        assert str(state) in line
        # Each pool's open failed for the full disk, not for an empty file an earlier one left.
        assert "No space left on device" in line
        (said,) = [
            row
            for row in result.stderr.splitlines()
            if row.endswith(f"2026-11-30T00 {pool} cannot be recorded or its pages kept")
        ]
        assert said.startswith(f"{state}: the pipeline's state cannot be written (")
    # No empty state file is left for DuckDB to refuse once the disk has room again.
    assert not state_left
    # Paged without the disk: straight to the webhook, one page per failed pool-hour.
    texts = [body["text"] for body in webhook.bodies]
    assert [text.split(" hour ")[0] for text in texts] == [
        f"[ERROR] stepledger run_failed failed for {pool}" for pool in names
    ]
    assert all(f"What to do: {RUN_FAILED_TODO}." in text for text in texts)
    assert "paged on-call: 2 alert(s) delivered to WebhookSink(slack -> http://127.0.0.1/…)" in (
        result.stderr
    )
    assert "Traceback" not in result.output


def test_a_state_file_a_full_disk_cut_short_is_not_left_empty(tmp_path: Path) -> None:
    """Only the empty file the failed open created goes: one that was there is left as it was."""
    with full_filesystem(tmp_path / "full", "1m") as disk:
        fill(disk)
        created = disk / "created" / STATE_FILE
        with pytest.raises(duckdb.IOException, match="No space left on device"), connect(created):
            pass
        created_left = created.exists()
        there_before = disk / STATE_FILE
        there_before.touch()
        invalid = "not a valid DuckDB database file"
        with pytest.raises(duckdb.IOException, match=invalid), connect(there_before):
            pass
        before_left = there_before.stat().st_size if there_before.exists() else None
    assert not created_left
    assert before_left == 0


@pytest.mark.parametrize("configured", [False, True], ids=["new instance", "configured instance"])
def test_a_full_disk_under_the_dagster_instance_is_one_line_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, configured: bool
) -> None:
    """Without DAGSTER_HOME the instance is the data directory's own: on a full disk neither
    its configuration nor its SQLite storage can be written, and no pool-hour can run."""
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    with full_filesystem(tmp_path / "full", "1m") as disk:
        data = disk / "run"
        (data / "gateway").mkdir(parents=True)
        (data / "gateway" / "2026-11-30T00.jsonl").write_text("")
        instance = data / "dagster"
        if configured:
            instance.mkdir()
            shutil.copyfile(INSTANCE_TEMPLATE, instance / "dagster.yaml")
        fill(disk)
        result = CliRunner().invoke(main, ["run", "--data", str(data)])
        left = sorted(p.name for p in instance.iterdir())
        state_left = (data / STATE_FILE).exists()
    assert result.exit_code == StateError.exit_code == 6, result.output
    cause = "No space left on device" if not configured else "database or disk is full"
    assert result.stderr.splitlines() == [
        f"Error: {instance}: the Dagster instance cannot be created or opened ({cause}); free "
        "space there, or set DAGSTER_HOME to a writable directory"
    ]
    assert result.stdout.strip() == ""
    # A configuration cut short is not left for the next run to take for one, nor an empty
    # state file that DuckDB would refuse once the disk has room again.
    assert left == (["dagster.yaml", "history"] if configured else [])
    assert not state_left
