"""The production layout of docs/production.md for real: a code server, a webserver and a daemon
(each under `python -m assets.supervise`, the webserver and daemon finding the code server
through the committed workspace.yaml) on a data directory that `stepledger run` billed. A
headless Chromium renders the UI: the ledger's partitions start at the data's hour, which shows
materialized, and the run is listed with its partition. Each process, started as a shell's `&`
starts it (SIGINT ignored), is gone within 10 s of SIGTERM, with everything it started."""

from __future__ import annotations

import html
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from assets.cli.run import run_pool_hours
from assets.schedules import build_hourly_schedule
from tests.helpers.children import child
from tests.helpers.dagster_processes import (
    descendants,
    free_port,
    running,
    store_schedule_stopped,
    wait_for_daemons,
)
from tests.helpers.fleets import small_pools
from tests.helpers.hours import SIMULATED_HOUR

REPOSITORY = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# Bounds for processes that hang, not wait: on a loaded two-core machine a start has taken minutes.
STARTUP_SECONDS = 600
STOP_SECONDS = 10
# Virtual time the browser lets the page run for (its scripts and GraphQL answers), and how
# often a page not yet showing its data is rendered again.
RENDER_BUDGET_MS = 20_000
RENDER_ATTEMPTS = 5
pytestmark = [
    pytest.mark.timeout(1800),
    pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads processes from /proc"),
]


def ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def page_text(port: int, path: str, expected: str) -> list[str]:
    """The text lines of the UI page at `path` as headless Chromium renders it, once they
    hold `expected` (or after RENDER_ATTEMPTS renderings)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no Chromium installed (Debian's `chromium` package; .ci/run installs it)")
    command = [browser, "--headless", "--disable-gpu", "--disable-dev-shm-usage"]
    if os.geteuid() == 0:
        command.append("--no-sandbox")  # Chromium's sandbox refuses to run as root
    command += [f"--virtual-time-budget={RENDER_BUDGET_MS}", "--dump-dom"]
    lines: list[str] = []
    for _ in range(RENDER_ATTEMPTS):
        dom = subprocess.run(
            [*command, f"http://127.0.0.1:{port}{path}"],
            capture_output=True,
            text=True,
            timeout=STARTUP_SECONDS,
            check=True,
        ).stdout
        visible = re.sub(r"<(script|style)[^>]*>.*?</\1>", "", dom, flags=re.S)
        text = html.unescape(re.sub(r"<[^>]+>", "\n", visible))
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if expected in lines:
            break
    return lines


@pytest.fixture
def billed(simulated: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The simulated hour billed by `stepledger run` into the data directory's own instance."""
    data = tmp_path / "data"
    shutil.copytree(simulated, data)
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    monkeypatch.delenv("STEPLEDGER_FIRST_HOUR", raising=False)
    monkeypatch.setenv("STEPLEDGER_ALERT_FILE", str(tmp_path / "alerts.jsonl"))
    (run,) = run_pool_hours(data, [SIMULATED_HOUR])
    assert run.success, run
    return data


@pytest.fixture
def deployment(
    billed: Path, tmp_path: Path
) -> Iterator[tuple[int, dict[str, subprocess.Popen[bytes]]]]:
    """The webserver's port, and the three supervised processes by role."""
    code_port, web_port = free_port(), free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPOSITORY),
        "DAGSTER_HOME": str(billed / "dagster"),
        "STEPLEDGER_DATA": str(billed),
        "STEPLEDGER_CODE_SERVER_HOST": "127.0.0.1",
        "STEPLEDGER_CODE_SERVER_PORT": str(code_port),
    }
    # The test's processes bill nothing of their own at any time of day.
    store_schedule_stopped(env, build_hourly_schedule(small_pools()))
    supervise = [sys.executable, "-m", "assets.supervise"]
    workspace = str(REPOSITORY / "workspace.yaml")
    code_server = [str(BIN / "dagster"), "api", "grpc", "-m", "assets.definitions"]
    webserver = [str(BIN / "dagster-webserver"), "-w", workspace]
    commands = {
        "code server": [*code_server, "-h", "127.0.0.1", "-p", str(code_port)],
        "webserver": [*webserver, "-h", "127.0.0.1", "-p", str(web_port)],
        "daemon": [str(BIN / "dagster-daemon"), "run", "-w", workspace],
    }
    with ExitStack() as stack:
        processes = {
            role: stack.enter_context(
                child(
                    [*supervise, *command],
                    env=env,
                    cwd=tmp_path,
                    preexec_fn=ignore_sigint,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            for role, command in commands.items()
        }
        yield web_port, processes


def test_the_ui_shows_the_billed_hour_and_every_process_stops_within_10_s(
    deployment: tuple[int, dict[str, subprocess.Popen[bytes]]],
) -> None:
    port, processes = deployment
    wait_for_daemons(port, time.monotonic() + STARTUP_SECONDS)

    partitions = page_text(port, "/assets/ledger?view=partitions", "Materialized (1)")
    # The partitions are the data's hour (not months before it up to now), and it is filled.
    assert partitions[partitions.index("All") + 1 : partitions.index("All") + 3] == [
        "2026-11-30-00:00",
        "2026-11-30-00:00",
    ]
    assert {"Materialized (1)", "Missing (0)", "Failed (0)"} <= set(partitions)
    runs = page_text(port, "/runs", "2026-11-30-00:00|chat-8b")
    # Each run's row: "partition:", its partition, "View all tags (n)", job, launched by,
    # status. The run billed by `stepledger run` is there, and an ingest run the new-segments
    # sensor may have launched meanwhile is labelled with the data's hour too.
    rows = [runs[i + 1 : i + 6] for i, line in enumerate(runs) if line == "partition:"]
    assert [row[0] for row in rows] == ["2026-11-30-00:00|chat-8b"] * len(rows), runs
    assert [row[2:] for row in rows if row[2] == "pool_hour_job"] == [
        ["pool_hour_job", "Manually launched", "Success"]
    ], runs

    for role, process in processes.items():
        below = descendants(process.pid)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=STOP_SECONDS)
        assert time.monotonic() - started < STOP_SECONDS, role
        assert [cmd for pid, cmd in below.items() if running(pid)] == [], role
