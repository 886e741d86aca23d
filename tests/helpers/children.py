"""Child processes of the tests: each stopped by the test that started it, however the test ends,
and any left running after a test module found and reported (tests/conftest.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psutil

# How long a child may take to exit after SIGTERM before it is killed: a bound for a child
# that is stuck, far above what a loaded machine needs to stop one that is not.
STOP_GRACE_SECONDS = 120.0


def stop(process: subprocess.Popen[Any], grace_seconds: float = STOP_GRACE_SECONDS) -> int:
    """SIGTERM, then SIGKILL if `process` still runs after `grace_seconds`; its exit status."""
    if process.poll() is None:
        process.terminate()
        try:
            return process.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait()


@contextmanager
def child(command: list[str], **popen: Any) -> Iterator[subprocess.Popen[Any]]:
    """`command` running while the context is open, stopped (`stop`) when it closes."""
    with subprocess.Popen(command, **popen) as process:
        try:
            yield process
        finally:
            stop(process)


def live_children() -> list[psutil.Process]:
    """This process's descendants that still run (zombies, already exited, do not count)."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.NoSuchProcess:
            continue
    return found


def stop_leftovers(grace_seconds: float = STOP_GRACE_SECONDS) -> list[str]:
    """Stop every descendant still running, as `stop` does; the command lines of those found."""
    leftovers = live_children()
    described = []
    for process in leftovers:
        try:
            described.append(f"{process.pid}: {' '.join(process.cmdline())}")
            process.terminate()
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(leftovers, timeout=grace_seconds)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(alive)
    return described
