"""`stepledger dev` for real: the webserver, daemon and code server start on a data directory,
answer over HTTP on loopback only, and all stop on SIGTERM or Ctrl-C (SIGINT)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import pytest

from assets.cli.dev import group_alive
from pipeline.cli.dagster_instance import (
    DATA_ENV,
    INSTANCE_TEMPLATE,
    instance_dir,
    materialize_pool_hours,
    prepare_instance,
)
from tests.helpers.dagster_processes import (
    descendants,
    free_port,
    graphql,
    listening_addresses,
    running,
    start_dev,
    wait_for_daemons,
)
from tests.helpers.fleets import BLOCKING_CHECKS

STARTUP_SECONDS = 180
STOP_SECONDS = 60


def test_the_code_location_reads_the_data_directory_from_the_same_variable() -> None:
    from assets.resources import DATA_ENV as CODE_LOCATION_DATA_ENV

    assert DATA_ENV == CODE_LOCATION_DATA_ENV


def test_dagster_home_when_set_else_the_data_directory_instance(tmp_path: Path) -> None:
    assert instance_dir(tmp_path, {"DAGSTER_HOME": str(tmp_path / "mine")}) == tmp_path / "mine"
    assert instance_dir(tmp_path, {}) == tmp_path / "dagster"


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads processes from /proc")
@pytest.mark.parametrize(
    ("own_dagster_home", "stop_signal"), [(False, signal.SIGTERM), (True, signal.SIGINT)]
)
def test_dev_serves_on_loopback_and_stops_every_process(
    tmp_path: Path, own_dagster_home: bool, stop_signal: signal.Signals
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"}
    env["STEPLEDGER_ALERT_FILE"] = str(tmp_path / "alerts.jsonl")
    home = tmp_path / "my-dagster-home" if own_dagster_home else data / "dagster"
    if own_dagster_home:
        env["DAGSTER_HOME"] = str(home)
    dev = start_dev(data, port, env, tmp_path)
    try:
        status = wait_for_daemons(port, time.monotonic() + STARTUP_SECONDS)
        children = descendants(dev.pid)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=30) as r:
            assert json.loads(r.read())["dagster_webserver_version"] == "1.13.27"
    except BaseException:
        dev.kill()
        raise
    # 127.0.0.1 only, as /proc/net/tcp writes it (little-endian hex).
    assert listening_addresses(port) == {"0100007F"}
    commands = " | ".join(children.values())
    for part in ("dagster dev", "dagster_webserver", "dagster._daemon run", "dagster api grpc"):
        assert part in commands
    assert f"base_dir: {home}" in status["instance"]["info"]
    assert (home / "dagster.yaml").read_text() == INSTANCE_TEMPLATE.read_text()
    assert (data / "dagster").exists() == (not own_dagster_home)
    assert {
        s["name"]: s["scheduleState"]["status"] for s in status["schedulesOrError"]["results"]
    } == {"hourly_ledger": "RUNNING"}
    assert {s["name"]: s["sensorState"]["status"] for s in status["sensorsOrError"]["results"]} == {
        "new_segments": "RUNNING",
        "deadman": "RUNNING",
        "page_on_call": "RUNNING",
    }

    dev.send_signal(stop_signal)
    _, stderr = dev.communicate(timeout=STOP_SECONDS)
    assert dev.returncode == 0, stderr.decode()[-2000:]
    assert [pid for pid in children if running(pid)] == []
    assert not group_alive(next(pid for pid, cmd in children.items() if "dagster dev" in cmd))
    assert listening_addresses(port) == set()


HISTORY_QUERY = """{
  assetNodeOrError(assetKey: {path: ["ledger"]}) {
    ... on AssetNode {
      partitionStats { numMaterialized numFailed }
      assetChecksOrError { ... on AssetChecks { checks { name blocking } } }
    }
  }
  runsOrError(filter: {pipelineName: "pool_hour_job"}) {
    ... on Runs { results { status tags { key value } } }
  }
}"""


def test_dev_shows_the_pool_hours_billed_on_the_data_directory_instance(
    simulated: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    shutil.copytree(simulated, data)
    home = instance_dir(data, {})
    prepare_instance(home)
    outcomes = list(materialize_pool_hours(data, [datetime(2026, 11, 30, tzinfo=UTC)], home))
    assert [(o["hour"], o["pool"], o["success"], o["held_back"], o["error"]) for o in outcomes] == [
        ("2026-11-30T00", "chat-8b", True, False, None)
    ]
    # The short fixture hour warns; nothing holds it back.
    assert sorted(f.split(":")[0] for f in outcomes[0]["failed_checks"]) == [
        "calibration",
        "plausibility",
    ]

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"}
    env["STEPLEDGER_ALERT_FILE"] = str(tmp_path / "alerts.jsonl")
    dev = start_dev(data, port, env, tmp_path)
    try:
        wait_for_daemons(port, time.monotonic() + STARTUP_SECONDS)
        history = graphql(port, HISTORY_QUERY)
    finally:
        dev.send_signal(signal.SIGTERM)
        dev.communicate(timeout=STOP_SECONDS)
    ledger = history["assetNodeOrError"]
    assert ledger["partitionStats"] == {"numMaterialized": 1, "numFailed": 0}
    assert {
        c["name"]: c["blocking"] for c in ledger["assetChecksOrError"]["checks"]
    } == BLOCKING_CHECKS
    (run,) = history["runsOrError"]["results"]
    tags = {t["key"]: t["value"] for t in run["tags"]}
    assert (run["status"], tags["dagster/partition"]) == ("SUCCESS", "2026-11-30-00:00|chat-8b")
