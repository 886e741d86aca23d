"""The production profile (dagster_home/production/dagster.yaml) against a real PostgreSQL
server started here: the instance stores everything in Postgres, and two pool-hours submitted
through the webserver are queued, launched by the daemon within the run limit, materialized and
checked per partition."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from assets.schedules import build_hourly_schedule
from pipeline import finance
from schemas.config import PoolsFile
from tests.helpers.children import STOP_GRACE_SECONDS
from tests.helpers.dagster_processes import (
    REQUEST_SECONDS,
    descendants,
    free_port,
    graphql,
    running,
    running_dev,
    schedule_statuses,
    store_schedule_stopped,
    wait_for_daemons,
)
from tests.helpers.fleets import SIMULATED_HOURS, small_pools
from tests.helpers.postgres_server import PostgresServer, postgres_or_skip

PROFILE = Path(__file__).resolve().parents[2] / "dagster_home" / "production" / "dagster.yaml"
# Bounds for a webserver, daemon or run that hangs, not waits: on a loaded two-core machine the
# start alone has taken three minutes.
STARTUP_SECONDS = 600
RUNS_SECONDS = 900
pytestmark = pytest.mark.timeout(1800)
HOUR_KEY = "2026-11-30-00:00"
LAUNCH = """mutation Launch($params: ExecutionParams!) {
  launchRun(executionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message }
  }
}"""


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with postgres_or_skip() as server:
        yield server


def two_pools() -> PoolsFile:
    """The small fleet's two replicas as two pools of one replica each."""
    pools = small_pools()
    chat = pools.pool("chat-8b")
    first, second = chat.replicas
    return pools.model_copy(
        update={
            "pools": [
                chat.model_copy(update={"replicas": [first]}),
                chat.model_copy(update={"name": "chat-8b-eu", "replicas": [second]}),
            ]
        }
    )


@pytest.fixture(scope="module")
def two_pool_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeline.simulator import simulate

    out = tmp_path_factory.mktemp("prod") / "data"
    simulate(out, two_pools(), hours=SIMULATED_HOURS, seed=11)
    return out


def instance_env(server: PostgresServer, home: Path) -> dict[str, str]:
    return {**os.environ, **server.env(), "DAGSTER_HOME": str(home)}


def test_the_profile_keeps_everything_in_postgres_and_queues_runs(
    postgres: PostgresServer, tmp_path: Path
) -> None:
    (tmp_path / "dagster.yaml").write_text(PROFILE.read_text())
    script = (
        "import json\n"
        "from dagster import DagsterInstance\n"
        "i = DagsterInstance.get()\n"
        "q = i.get_concurrency_config()\n"
        "print(json.dumps([type(i.run_storage).__name__, type(i.event_log_storage).__name__,\n"
        "    type(i.schedule_storage).__name__, type(i.run_coordinator).__name__,\n"
        "    q.run_queue_config.max_concurrent_runs, q.run_queue_config.tag_concurrency_limits,\n"
        "    q.pool_config.default_pool_limit]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=instance_env(postgres, tmp_path),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == [
        "PostgresRunStorage",
        "PostgresEventLogStorage",
        "PostgresScheduleStorage",
        "QueuedRunCoordinator",
        4,
        [
            {"key": "dagster/backfill", "limit": 1},
            {"key": "dagster/partition", "value": {"applyLimitPerUniqueValue": True}, "limit": 1},
        ],
        1,
    ]


def launch(port: int, pool: str) -> str:
    tags = {"dagster/partition": f"{HOUR_KEY}|{pool}"}
    tags |= {"dagster/partition/hour": HOUR_KEY, "dagster/partition/pool": pool}
    params = {
        "selector": {
            "repositoryLocationName": "assets.definitions",
            "repositoryName": "__repository__",
            "jobName": "pool_hour_job",
        },
        "runConfigData": {},
        "executionMetadata": {"tags": [{"key": k, "value": v} for k, v in tags.items()]},
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql",
        data=json.dumps({"query": LAUNCH, "variables": {"params": params}}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=REQUEST_SECONDS) as response:
        launched = json.loads(response.read())["data"]["launchRun"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    return str(launched["run"]["runId"])


def wait_for_runs(port: int, run_ids: list[str]) -> dict[str, str]:
    query = "{ runsOrError(filter: {runIds: %s}) { ... on Runs { results { runId status } } } }"
    deadline = time.monotonic() + RUNS_SECONDS
    while time.monotonic() < deadline:
        runs = graphql(port, query % json.dumps(run_ids))["runsOrError"]["results"]
        status = {r["runId"]: r["status"] for r in runs}
        if all(s in ("SUCCESS", "FAILURE", "CANCELED") for s in status.values()):
            return status
        time.sleep(2)
    raise AssertionError(f"runs {run_ids} did not finish within {RUNS_SECONDS} s")


HISTORY = """
import json
from dagster import AssetKey, DagsterEventType, DagsterInstance, EventRecordsFilter
i = DagsterInstance.get()
runs = []
for record in i.get_run_records():
    run = record.dagster_run
    events = [e.dagster_event.event_type_value for e in i.all_logs(run.run_id) if e.dagster_event]
    runs.append({"run_id": run.run_id, "job": run.job_name, "status": run.status.value,
                 "partition": run.tags.get("dagster/partition"),
                 "start": record.start_time, "end": record.end_time,
                 "lifecycle": [e for e in events if e.startswith("PIPELINE_")]})
ledger = i.fetch_materializations(AssetKey("ledger"), limit=100).records
checks = i.get_event_records(EventRecordsFilter(DagsterEventType.ASSET_CHECK_EVALUATION))
print(json.dumps({
    "runs": runs,
    "ledger_partitions": sorted(r.partition_key for r in ledger),
    "checks": sorted(
        [r.event_log_entry.dagster_event.event_specific_data.check_name,
         r.event_log_entry.dagster_event.event_specific_data.partition]
        for r in checks),
}))
"""


def test_two_pool_hours_run_through_the_queue_on_postgres(
    postgres: PostgresServer, two_pool_data: Path, tmp_path: Path
) -> None:
    home = tmp_path / "dagster_home"
    home.mkdir()
    # The committed profile with its run limit lowered to 1, so the two runs must queue.
    profile = yaml.safe_load(PROFILE.read_text())
    profile["concurrency"]["runs"]["max_concurrent_runs"] = 1
    (home / "dagster.yaml").write_text(yaml.safe_dump(profile))
    env = instance_env(postgres, home)
    env |= {
        "STEPLEDGER_ALERT_FILE": str(tmp_path / "alerts.jsonl"),
        "STEPLEDGER_FIRST_HOUR": "2026-11-30T00",
    }
    # The runs are the test's own at any time of day: the hourly schedule never ticks here.
    store_schedule_stopped(env, build_hourly_schedule(two_pools()))
    port = free_port()
    with running_dev(two_pool_data, port, env, tmp_path) as dev:
        daemons = wait_for_daemons(port, time.monotonic() + STARTUP_SECONDS)
        children = descendants(dev.pid)
        run_ids = [launch(port, "chat-8b"), launch(port, "chat-8b-eu")]
        status = wait_for_runs(port, run_ids)
        # Ctrl-C, as in a terminal.
        dev.send_signal(signal.SIGINT)
        _, stderr = dev.communicate(timeout=STOP_GRACE_SECONDS)
    assert schedule_statuses(daemons) == {"hourly_ledger": "STOPPED"}
    assert status == {run_id: "SUCCESS" for run_id in run_ids}, stderr.decode()[-3000:]
    assert dev.returncode == 0
    assert [pid for pid in [dev.pid, *children] if running(pid)] == []
    # The DAGSTER_HOME set here was used as it is, and nothing was written beside the data.
    assert not (two_pool_data / "dagster").exists()

    out = subprocess.run([sys.executable, "-c", HISTORY], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    history = json.loads(out.stdout.splitlines()[-1])
    ours = {r["run_id"]: r for r in history["runs"] if r["run_id"] in run_ids}
    # Enqueued by the webserver, started by the daemon's queue (the coordinator logs no
    # separate dequeue event).
    lifecycle = ["PIPELINE_ENQUEUED", "PIPELINE_STARTING", "PIPELINE_START", "PIPELINE_SUCCESS"]
    assert sorted((r["job"], r["partition"], r["lifecycle"]) for r in ours.values()) == [
        ("pool_hour_job", f"{HOUR_KEY}|chat-8b", lifecycle),
        ("pool_hour_job", f"{HOUR_KEY}|chat-8b-eu", lifecycle),
    ]
    # One run at a time, whatever else the sensors launched meanwhile.
    spans = sorted((r["start"], r["end"]) for r in history["runs"] if r["start"] is not None)
    assert all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(spans))
    assert history["ledger_partitions"] == [f"{HOUR_KEY}|chat-8b", f"{HOUR_KEY}|chat-8b-eu"]
    check_names = sorted(
        (
            "calibration",
            "calibration_drift",
            "clock",
            "conservation",
            "money",
            "plausibility",
            "sequence",
            "silence",
            "time",
            "unattributed",
        )
    )
    assert history["checks"] == sorted(
        [name, f"{HOUR_KEY}|{pool}"] for name in check_names for pool in ("chat-8b", "chat-8b-eu")
    )

    with finance.connect(two_pool_data) as con:
        invoices = con.execute(
            "SELECT pool, hour, amount_nano FROM invoices ORDER BY pool"
        ).fetchall()
    pools = two_pools()
    assert invoices == [
        (
            pool.name,
            datetime(2026, 11, 30, 0),
            pool.nano_per_gpu_hour * len(pool.replicas[0].gpu_uuids),
        )
        for pool in pools.pools
    ]
