"""A throwaway PostgreSQL server for the tests: a cluster in a temporary directory, on
loopback, stopped and deleted afterwards. Needs Debian's `postgresql` package (`.ci/run`
installs it); as root, the server runs as the `postgres` user, which refuses to run as root."""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.dagster_processes import free_port

USER = "stepledger"
PASSWORD = "throwaway"
DATABASE = "dagster"
# How long pg_ctl waits for the server to start or stop: a bound for a server that cannot, far
# above what a loaded machine needs (the tests run no timer of their own on these commands).
SERVER_WAIT_SECONDS = 600


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
    """The directory holding initdb and pg_ctl: on PATH, else Debian's versioned directory."""
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).resolve().parent
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3])
    )
    if not versions:
        raise PostgresUnavailable(
            "no PostgreSQL server binaries (initdb): install Debian's `postgresql` package"
        )
    return versions[-1].parent


@contextlib.contextmanager
def throwaway_postgres() -> Iterator[PostgresServer]:
    binaries = server_binaries()
    run_as = "postgres" if os.geteuid() == 0 else getpass.getuser()
    root = Path(tempfile.mkdtemp(prefix="stepledger-pg-"))
    cluster = root / "cluster"
    password_file = root / "password"
    password_file.write_text(PASSWORD)
    if os.geteuid() == 0:
        try:
            shutil.chown(root, user=run_as)
            shutil.chown(password_file, user=run_as)
        except LookupError as err:
            shutil.rmtree(root)
            raise PostgresUnavailable(
                f"running as root and there is no `postgres` user: {err}"
            ) from err
    port = free_port()

    def run(*command: str) -> None:
        done = subprocess.run(
            [str(binaries / command[0]), *command[1:]],
            user=run_as,
            capture_output=True,
            text=True,
            cwd=root,
        )
        if done.returncode != 0:
            raise PostgresUnavailable(
                f"`{' '.join(command[:2])}` failed ({done.returncode}): {done.stderr.strip()[-500:]}"
            )

    try:
        run(
            "initdb",
            "-D",
            str(cluster),
            "-U",
            USER,
            f"--pwfile={password_file}",
            "--auth=scram-sha-256",
            "--no-sync",
        )
        run(
            "pg_ctl",
            "-D",
            str(cluster),
            "-l",
            str(root / "server.log"),
            "-o",
            f"-h 127.0.0.1 -p {port} -k {root} -c fsync=off",
            "-w",
            "-t",
            str(SERVER_WAIT_SECONDS),
            "start",
        )
        # The database through the server itself, as a client would create it.
        subprocess.run(
            [
                str(binaries / "psql") if (binaries / "psql").exists() else "psql",
                f"postgresql://{USER}:{PASSWORD}@127.0.0.1:{port}/postgres",
                "-c",
                f"CREATE DATABASE {DATABASE}",
            ],
            check=True,
            capture_output=True,
        )
        yield PostgresServer("127.0.0.1", port, USER, PASSWORD, DATABASE)
    finally:
        # Also after a start that failed or outlasted pg_ctl's wait: the server may be running.
        if (cluster / "postmaster.pid").exists():
            run(
                "pg_ctl",
                "-D",
                str(cluster),
                "-m",
                "fast",
                "-w",
                "-t",
                str(SERVER_WAIT_SECONDS),
                "stop",
            )
        shutil.rmtree(root, ignore_errors=True)
