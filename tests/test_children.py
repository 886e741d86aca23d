"""The suite's own guard on child processes: a test module that leaves one running fails, and a
child that ignores SIGTERM is killed once its grace period is over."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from tests.helpers.children import child, stop

ROOT = Path(__file__).resolve().parents[1]

LEAKING_MODULE = """
import subprocess, sys

def test_starts_a_child_and_forgets_it():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
"""


def test_a_module_that_leaves_a_child_running_fails_and_the_child_is_stopped(
    tmp_path: Path,
) -> None:
    (tmp_path / "conftest.py").write_text("from tests.conftest import no_child_left_running\n")
    (tmp_path / "test_leak.py").write_text(LEAKING_MODULE)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1, done.stdout
    assert "1 passed, 1 error" in done.stdout
    found = re.search(r"child processes left running: (\d+): .*time\.sleep\(3600\)", done.stdout)
    assert found, done.stdout
    assert not psutil.pid_exists(int(found[1]))


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period() -> None:
    ignoring = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    ignoring += "print('ready', flush=True); time.sleep(3600)"
    with subprocess.Popen(
        [sys.executable, "-c", ignoring], stdout=subprocess.PIPE, text=True
    ) as process:
        assert process.stdout is not None
        assert process.stdout.readline() == "ready\n"
        assert stop(process, grace_seconds=0.5) == -signal.SIGKILL


def test_a_child_is_stopped_when_the_test_fails_inside_its_context() -> None:
    command = [sys.executable, "-c", "import time; time.sleep(3600)"]
    try:
        with child(command) as process:
            raise RuntimeError("the test failed")
    except RuntimeError:
        pass
    assert process.returncode == -signal.SIGTERM
