"""`stepledger dev` for real: the webserver, daemon and code server start on a data directory,
answer over HTTP on loopback only, and all stop on SIGTERM or Ctrl-C (SIGINT)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pipeline.cli.dev import DATA_ENV, INSTANCE_TEMPLATE, group_alive, instance_dir

STARTUP_SECONDS = 180
STOP_SECONDS = 60
STATUS_QUERY = """{
  instance { info daemonHealth { allDaemonStatuses { daemonType healthy } } }
  schedulesOrError(repositorySelector: {repositoryName: "__repository__",
                                        repositoryLocationName: "assets.definitions"}) {
    ... on Schedules { results { name scheduleState { status } } }
  }
  sensorsOrError(repositorySelector: {repositoryName: "__repository__",
                                      repositoryLocationName: "assets.definitions"}) {
    ... on Sensors { results { name sensorState { status } } }
  }
}"""


def test_the_code_location_reads_the_data_directory_from_the_same_variable() -> None:
    from assets.resources import DATA_ENV as CODE_LOCATION_DATA_ENV

    assert DATA_ENV == CODE_LOCATION_DATA_ENV


def test_dagster_home_when_set_else_the_data_directory_instance(tmp_path: Path) -> None:
    assert instance_dir(tmp_path, {"DAGSTER_HOME": str(tmp_path / "mine")}) == tmp_path / "mine"
    assert instance_dir(tmp_path, {}) == tmp_path / "dagster"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def proc_stat(pid: int) -> list[str] | None:
    """state, ppid, pgrp, ... of a process; None when it no longer exists."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def descendants(root: int) -> dict[int, str]:
    """pid -> command line of every living process below `root`."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        stat = proc_stat(int(entry.name))
        if stat is not None:
            children.setdefault(int(stat[1]), []).append(int(entry.name))
    found: dict[int, str] = {}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            try:
                found[child] = (Path("/proc") / str(child) / "cmdline").read_bytes().decode()
            except FileNotFoundError:
                continue
            todo.append(child)
    return {pid: cmd.replace("\0", " ") for pid, cmd in found.items()}


def running(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} write them) with a socket listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, _, state = line.split()[1:4]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:
                found.add(address)
    return found


def graphql(port: int, query: str) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql",
        data=json.dumps({"query": query}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["data"]


def wait_for_daemons(port: int, deadline: float) -> dict:
    """The status query's answer once every daemon reports healthy."""
    while time.monotonic() < deadline:
        try:
            status = graphql(port, STATUS_QUERY)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            status = None
        if status is not None:
            daemons = status["instance"]["daemonHealth"]["allDaemonStatuses"]
            if daemons and all(d["healthy"] for d in daemons):
                return status
        time.sleep(1)
    raise AssertionError(f"no healthy Dagster webserver and daemon on port {port}")


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
    stepledger = Path(sys.executable).parent / "stepledger"
    dev = subprocess.Popen(
        [str(stepledger), "dev", "--data", str(data), "--port", str(port)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
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
