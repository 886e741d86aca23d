"""Dagster processes seen from outside: free ports, /proc, the webserver's GraphQL; and the
instance a daemon will start on, prepared before it starts."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import dagster as dg
import psutil

from pipeline.cli.dagster_instance import CODE_LOCATION
from tests.helpers.children import child, stop

# The installed command line, run as its own process.
STEPLEDGER = str(Path(sys.executable).parent / "stepledger")

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


# A bound for a webserver that does not answer; a loaded machine's answers take seconds.
REQUEST_SECONDS = 300

# Stores a schedule as stopped, as `dagster schedule stop` does, without loading the code
# location: the daemon looks a schedule's state up by its selector (code location, repository,
# name) and never ticks one stored as stopped. argv: name, cron schedule.
STORE_SCHEDULE_STOPPED = f"""
import sys
from dagster import DagsterInstance
from dagster._core.definitions.run_request import InstigatorType
from dagster._core.remote_origin import (
    RegisteredCodeLocationOrigin, RemoteInstigatorOrigin, RemoteRepositoryOrigin)
from dagster._core.scheduler.instigation import (
    InstigatorState, InstigatorStatus, ScheduleInstigatorData)
name, cron = sys.argv[1:]
location = RegisteredCodeLocationOrigin({CODE_LOCATION!r})
origin = RemoteInstigatorOrigin(RemoteRepositoryOrigin(location, "__repository__"), name)
with DagsterInstance.get() as instance:
    instance.add_instigator_state(InstigatorState(
        origin, InstigatorType.SCHEDULE, InstigatorStatus.STOPPED, ScheduleInstigatorData(cron)))
"""


def store_schedule_stopped(env: dict[str, str], schedule: dg.ScheduleDefinition) -> None:
    """Stop `schedule` in the instance `env` names (DAGSTER_HOME) before a daemon starts there.

    A daemon ticks a running schedule at the wall clock's minutes: a test that starts one with the
    hourly schedule running would bill an extra hour whenever it spans :15 past the hour."""
    cron = schedule.cron_schedule
    assert isinstance(cron, str)
    subprocess.run(
        [sys.executable, "-c", STORE_SCHEDULE_STOPPED, schedule.name, cron],
        env=env,
        check=True,
        capture_output=True,
    )


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
        for pid in children.get(todo.pop(), []):
            try:
                found[pid] = (Path("/proc") / str(pid) / "cmdline").read_bytes().decode()
            except FileNotFoundError:
                continue
            todo.append(pid)
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


def graphql(port: int, query: str) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql",
        data=json.dumps({"query": query}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=REQUEST_SECONDS) as response:
        data: dict[str, Any] = json.loads(response.read())["data"]
    return data


def schedule_statuses(status: dict[str, Any]) -> dict[str, str]:
    """Schedule name -> RUNNING or STOPPED, from the status query's answer."""
    return {s["name"]: s["scheduleState"]["status"] for s in status["schedulesOrError"]["results"]}


def wait_for_daemons(port: int, deadline: float) -> dict[str, Any]:
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


@contextmanager
def running_dev(
    data: Path, port: int, env: dict[str, str], cwd: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """`stepledger dev` on `data` as a user starts it, its stderr kept for failure messages.

    A test stops it as a user does and checks that it stopped; this stops it if the test did not
    get that far, and then whatever of its webserver, daemon and code servers still runs."""
    with child(
        [STEPLEDGER, "dev", "--data", str(data), "--port", str(port)],
        env=env,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    ) as dev:
        try:
            yield dev
        finally:
            below = []
            with suppress(psutil.NoSuchProcess):
                below = psutil.Process(dev.pid).children(recursive=True)
            stop(dev)
            for process in below:
                with suppress(psutil.NoSuchProcess):
                    process.kill()
