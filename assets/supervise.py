"""A Dagster process that stops within seconds of SIGTERM, whoever started it:

    python -m assets.supervise dagster api grpc -m assets.definitions -h 0.0.0.0 -p 4000

runs the command in a process group of its own and, on SIGTERM or SIGINT, passes SIGTERM on
and kills whatever of the group still runs `STOP_SECONDS` later. Left to itself, Dagster's code
server stops in about 4 s when nothing is connected, but waits up to its gRPC grace period
(60 s) for the calls a webserver or daemon keeps open, loses a SIGTERM that arrives while it
loads the code location, and ignores SIGTERM for good when it was started with SIGINT ignored
(a shell's `command &` does that): it maps SIGTERM onto SIGINT's handler. So the command gets
SIGINT at its default, a gRPC grace of `GRPC_GRACE_SECONDS` unless the environment sets one,
and a deadline. `stepledger dev` runs `dagster dev` the same way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

# What a process manager allows a service to stop in (systemd's default is 90 s; Kubernetes'
# terminationGracePeriodSeconds 30 s): the whole group is gone within 10 s of the signal.
STOP_SECONDS = 8.0
GRPC_GRACE_ENV = "DAGSTER_GRPC_SHUTDOWN_GRACE_PERIOD"
GRPC_GRACE_SECONDS = "3"
POLL_SECONDS = 0.1


def group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs. Zombies do not count: an orphan that the
    machine's init does not reap has exited all the same."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


def stop_group(process: subprocess.Popen[bytes], grace_seconds: float) -> int:
    """SIGTERM to the group's leader (Dagster's commands shut their children down in order),
    then SIGKILL to whatever of its process group is still running after the grace period."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline:
        process.poll()
        if not group_alive(process.pid):
            break
        time.sleep(POLL_SECONDS)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return process.wait()


def supervise(command: list[str], env: Mapping[str, str]) -> tuple[int, bool]:
    """Run `command` until it exits or SIGTERM/SIGINT arrives, then stop its group within
    STOP_SECONDS; (exit status, whether a signal asked for the stop)."""
    stop_requested: list[int] = []

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop_requested.append(signum)

    # Installed before the start, so that no signal can end this process and orphan the group.
    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}

    def default_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    env = {GRPC_GRACE_ENV: GRPC_GRACE_SECONDS, **env}
    try:
        # A session of its own: a terminal's Ctrl-C reaches only this process, which then stops
        # the whole group in order instead of every process dying at once.
        process = subprocess.Popen(
            command, env=env, start_new_session=True, preexec_fn=default_sigint
        )
        try:
            while process.poll() is None and not stop_requested:
                time.sleep(POLL_SECONDS)
        finally:
            returncode = stop_group(process, STOP_SECONDS)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return returncode, bool(stop_requested)


def main(argv: list[str] | None = None) -> None:
    command = sys.argv[1:] if argv is None else argv
    if not command or command[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if command else 2)
    returncode, stopped = supervise(command, dict(os.environ))
    raise SystemExit(0 if stopped else returncode)


if __name__ == "__main__":
    main()
