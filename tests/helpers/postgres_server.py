"""A throwaway PostgreSQL server for the tests: a cluster in a temporary directory, on
loopback, stopped and deleted afterwards. Needs Debian's `postgresql` package (`.ci/run`
installs it); as root, the server runs as the `postgres` user, which refuses to run as root."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
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

    def env(self) -> dict[str, str]:
        """The variables dagster_home/production/dagster.yaml reads."""
        return {
            "DAGSTER_PG_HOST": self.host,
            "DAGSTER_PG_PORT": str(self.port),
            "DAGSTER_PG_USER": self.user,
            "DAGSTER_PG_PASSWORD": self.password,
            "DAGSTER_PG_DB": self.database,
        }


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
        yield PostgresServer("127.0.0.1", port, USER, PASSWORD, DATABASE)
    finally:
        # Also after a start that failed or outlasted pg_ctl's wait: the server may be running.
        stack.stop_postgres(root / "postgres")
        shutil.rmtree(root, ignore_errors=True)
