"""A throwaway PostgreSQL server for the tests: a cluster in a temporary directory, on
loopback, stopped and deleted afterwards. Needs Debian's `postgresql` package (`.ci/run`
installs it); as root, the server runs as the `postgres` user, which refuses to run as root."""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline import stack
from schemas.errors import ExternalError
from tests.helpers.dagster_processes import free_port

USER = stack.PIPELINE_ROLE
PASSWORD = "throwaway"
DATABASE = "dagster"


class PostgresUnavailable(Exception):
    """Why no server could start here (the tests that need one are skipped with it)."""


@dataclass(frozen=True)
class PostgresServer:
    host: str
    port: int
    user: str
    password: str
    database: str
    # The directory of the cluster (`postgres/`), its log and socket.
    root: Path

    def env(self) -> dict[str, str]:
        """The variables dagster_home/production/dagster.yaml reads."""
        return {
            "DAGSTER_PG_HOST": self.host,
            "DAGSTER_PG_PORT": str(self.port),
            "DAGSTER_PG_USER": self.user,
            "DAGSTER_PG_PASSWORD": self.password,
            "DAGSTER_PG_DB": self.database,
        }

    def dsn(self) -> str:
        """The libpq connection string of its database (STEPLEDGER_POSTGRES)."""
        return (
            f"host={self.host} port={self.port} user={self.user} "
            f"password={self.password} dbname={self.database}"
        )


def server_binaries() -> Path:
    """The directory holding initdb and pg_ctl (pipeline.stack finds it)."""
    try:
        return stack.server_binaries()
    except ExternalError as err:
        raise PostgresUnavailable(str(err)) from err


@contextlib.contextmanager
def postgres_or_skip() -> Iterator[PostgresServer]:
    """A throwaway server, or the test skipped with the reason none could start here."""
    with contextlib.ExitStack() as servers:
        try:
            server = servers.enter_context(throwaway_postgres())
        except PostgresUnavailable as err:
            pytest.skip(f"no PostgreSQL server could start here: {err}")
        yield server


@contextlib.contextmanager
def throwaway_postgres() -> Iterator[PostgresServer]:
    server_binaries()
    root = Path(tempfile.mkdtemp(prefix="stepledger-pg-"))
    if os.geteuid() == 0:
        try:
            shutil.chown(root, user="postgres")
        except LookupError as err:
            shutil.rmtree(root)
            raise PostgresUnavailable(
                f"running as root and there is no `postgres` user: {err}"
            ) from err
    port = free_port()
    try:
        try:
            binaries = stack.start_postgres(root, PASSWORD, port, durable=False)
            stack.psql(binaries, PASSWORD, port, f"CREATE DATABASE {DATABASE};\n")
        except ExternalError as err:
            raise PostgresUnavailable(str(err)) from err
        yield PostgresServer("127.0.0.1", port, USER, PASSWORD, DATABASE, root)
    finally:
        # Also after a start that failed or outlasted pg_ctl's wait: the server may be running.
        stack.stop_postgres(root / "postgres")
        shutil.rmtree(root, ignore_errors=True)


def _server_processes(postmaster: int) -> list[int]:
    """The postmaster and the processes it started (backends, writer, checkpointer...)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            # The command (field 2) may hold spaces; the parent id is the second field after it.
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == postmaster:
                children.append(int(stat.parent.name))
    return [postmaster, *children]


def crash(server: PostgresServer, deadline_s: float = 60.0) -> None:
    """SIGKILL every process of the server at once, as the kernel's OOM killer or a lost node
    would, and wait until each has exited. Its files stay as the crash left them."""
    postmaster = int((server.root / "postgres" / "postmaster.pid").read_text().split()[0])
    # Stopped first, it starts no backend while its processes are listed.
    os.kill(postmaster, signal.SIGSTOP)
    exits = []
    for pid in _server_processes(postmaster):
        with contextlib.suppress(ProcessLookupError):
            # A pidfd becomes readable when its process exits, whoever its parent is.
            exits.append(os.pidfd_open(pid))
            os.kill(pid, signal.SIGKILL)
    try:
        for fd in exits:
            if not select.select([fd], [], [], deadline_s)[0]:
                raise TimeoutError(f"a PostgreSQL process outlived SIGKILL by {deadline_s} s")
    finally:
        for fd in exits:
            os.close(fd)
    # The lock file names the postmaster, and a restart takes an exited postmaster not yet
    # reaped (a zombie, whose parent is init since pg_ctl exited) for a live one. Init reaps it
    # when it gets to it (1.6 s once on this machine), which nothing signals: polled.
    deadline = time.monotonic() + deadline_s
    while Path(f"/proc/{postmaster}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the killed postmaster {postmaster} was not reaped in {deadline_s} s"
            )
        time.sleep(0.05)


def restart(server: PostgresServer) -> None:
    """Start the crashed server again on its port: PostgreSQL replays its write-ahead log."""
    stack.run_postgres(server.root, server.port, durable=False)
