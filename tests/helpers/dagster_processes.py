"""Dagster processes seen from outside: free ports, /proc, the webserver's GraphQL."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

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


def start_dev(data: Path, port: int, env: dict[str, str], cwd: Path) -> subprocess.Popen[bytes]:
    """`stepledger dev` on `data` as a user starts it, its stderr kept for failure messages."""
    stepledger = Path(sys.executable).parent / "stepledger"
    return subprocess.Popen(
        [str(stepledger), "dev", "--data", str(data), "--port", str(port)],
        env=env,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
