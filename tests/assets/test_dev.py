"""`stepledger dev` for real: the webserver, daemon and code server start on a data directory,
answer over HTTP on loopback only with the history of the pool-hours billed there, and all stop
on SIGTERM (Ctrl-C, and DAGSTER_HOME set by the user: tests/assets/test_production.py)."""

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

from assets.schedules import build_hourly_schedule
from assets.supervise import group_alive
from pipeline.cli.dagster_instance import (
    INSTANCE_TEMPLATE,
    instance_dir,
    materialize_pool_hours,
    prepare_instance,
)
from tests.helpers.children import STOP_GRACE_SECONDS
from tests.helpers.dagster_processes import (
    REQUEST_SECONDS,
    descendants,
    free_port,
    graphql,
    listening_addresses,
    running,
    running_dev,
    schedule_statuses,
    store_schedule_stopped,
    wait_for_daemons,
)
from tests.helpers.fleets import BLOCKING_CHECKS, small_pools

# Bounds for a webserver or daemon that hangs, not waits: on a loaded two-core machine the start
# alone has taken three minutes.
STARTUP_SECONDS = 600
pytestmark = pytest.mark.timeout(1200)


def test_dagster_home_when_set_else_the_data_directory_instance(tmp_path: Path) -> None:
    assert instance_dir(tmp_path, {"DAGSTER_HOME": str(tmp_path / "mine")}) == tmp_path / "mine"
    assert instance_dir(tmp_path, {}) == tmp_path / "dagster"


def test_an_instance_directory_gets_the_committed_configuration_only_when_it_has_none(
    tmp_path: Path,
) -> None:
    home = tmp_path / "new" / "home"
    assert prepare_instance(home)
    assert (home / "dagster.yaml").read_text() == INSTANCE_TEMPLATE.read_text()
    (home / "dagster.yaml").write_text("telemetry: {enabled: false}\n")
    assert not prepare_instance(home)
    assert (home / "dagster.yaml").read_text() == "telemetry: {enabled: false}\n"


HISTORY_QUERY = """{
  assetNodeOrError(assetKey: {path: ["ledger"]}) {
    ... on AssetNode {
      partitionStats { numMaterialized numFailed numPartitions }
      assetChecksOrError { ... on AssetChecks { checks { name blocking } } }
    }
  }
  runsOrError(filter: {pipelineName: "pool_hour_job"}) {
    ... on Runs { results { status tags { key value } } }
  }
}"""


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads processes from /proc")
def test_dev_serves_the_data_directory_history_on_loopback_and_stops_every_process(
    simulated: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    shutil.copytree(simulated, data)
    # Without DAGSTER_HOME, the instance is the data directory's own, as `stepledger demo` uses.
    env = {k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"}
    env["STEPLEDGER_ALERT_FILE"] = str(tmp_path / "alerts.jsonl")
    home = instance_dir(data, env)
    assert home == data / "dagster"
    prepare_instance(home)
    outcomes = list(materialize_pool_hours(data, [datetime(2026, 11, 30, tzinfo=UTC)], home))
    assert [(o["hour"], o["pool"], o["success"], o["held_back"], o["error"]) for o in outcomes] == [
        ("2026-11-30T00", "chat-8b", True, False, None)
    ]
    # The short fixture hour warns; nothing holds it back.
    assert sorted(f.split(":")[0] for f in outcomes[0]["failed_checks"]) == [
        "WARN calibration",
        "WARN plausibility",
    ]

    # The history is the test's own at any time of day: the hourly schedule never ticks here
    # (that it runs by default: tests/assets/test_definitions.py).
    store_schedule_stopped({**env, "DAGSTER_HOME": str(home)}, build_hourly_schedule(small_pools()))
    port = free_port()
    with running_dev(data, port, env, tmp_path) as dev:
        status = wait_for_daemons(port, time.monotonic() + STARTUP_SECONDS)
        children = descendants(dev.pid)
        with urllib.request.urlopen(
            f"http://127.0.0.1:{port}/server_info", timeout=REQUEST_SECONDS
        ) as r:
            assert json.loads(r.read())["dagster_webserver_version"] == "1.13.27"
        history = graphql(port, HISTORY_QUERY)
        # 127.0.0.1 only, as /proc/net/tcp writes it (little-endian hex).
        assert listening_addresses(port) == {"0100007F"}
        commands = " | ".join(children.values())
        for part in ("dagster dev", "dagster_webserver", "dagster._daemon run", "dagster api grpc"):
            assert part in commands
        assert f"base_dir: {home}" in status["instance"]["info"]
        assert schedule_statuses(status) == {"hourly_ledger": "STOPPED"}
        assert {
            s["name"]: s["sensorState"]["status"] for s in status["sensorsOrError"]["results"]
        } == {
            "new_segments": "RUNNING",
            "deadman": "RUNNING",
            "page_on_call": "RUNNING",
            "deliver_alerts": "RUNNING",
            "verify_published": "RUNNING",
        }
        ledger = history["assetNodeOrError"]
        # The partitions are the data directory's one hour (its data stopped long ago).
        assert ledger["partitionStats"] == {
            "numMaterialized": 1,
            "numFailed": 0,
            "numPartitions": 1,
        }
        assert {
            c["name"]: c["blocking"] for c in ledger["assetChecksOrError"]["checks"]
        } == BLOCKING_CHECKS
        (run,) = history["runsOrError"]["results"]
        tags = {t["key"]: t["value"] for t in run["tags"]}
        assert (run["status"], tags["dagster/partition"]) == ("SUCCESS", "2026-11-30-00:00|chat-8b")

        started = time.monotonic()
        dev.send_signal(signal.SIGTERM)
        _, stderr = dev.communicate(timeout=STOP_GRACE_SECONDS)
        stopped_in = time.monotonic() - started
    assert dev.returncode == 0, stderr.decode()[-2000:]
    assert stopped_in < 10
    assert [pid for pid in children if running(pid)] == []
    assert not group_alive(next(pid for pid, cmd in children.items() if "dagster dev" in cmd))
    assert listening_addresses(port) == set()
