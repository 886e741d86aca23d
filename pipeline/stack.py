"""The production stack on one machine, for trying the production profile and for tests:
PostgreSQL (Dagster's instance storage, the pipeline's state and the DuckLake catalog), an S3
server (the object store the engines' segments are shipped to), the Dagster daemon and the
webserver, on loopback, started by `up` and stopped by `down`.

Everything lives in one directory: the PostgreSQL cluster (`postgres/`; run as root, in a
directory of its own that `down` removes), the S3 server's data and identity (`s3/`,
SeaweedFS: `pipeline.ship.s3server`), the Dagster instance (`dagster/`, the production
profile), the services' logs (`logs/`) and `stack.json`, which
records what runs (process groups, ports) and the environment that reaches the stack (with its
passwords and the store's keys: the file is the owner's alone, and nothing else records them;
the services and clients get them through their environment). PostgreSQL comes from the
machine's packages (`initdb`, `pg_ctl`, `psql`); it refuses to run as root, so as root it runs
as the `postgres` user. More services join through `up(..., services=...)`: each is started
after PostgreSQL and the S3 server and before Dagster, with the stack's environment, and
stopped by `down`.

pipeline/ never imports the code location: the Dagster commands are started naming it.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, RunsFilter

from pipeline.datadir import DATA_ENV, DataDir
from pipeline.ship.s3server import S3Server, s3_filesystem
from pipeline.ship.store import STORE_VARIABLE
from pipeline.storage.data_files import WAREHOUSE_DATA_VARIABLE
from pipeline.storage.warehouse import (
    FINANCE_ROLE,
    POSTGRES_ENV,
    connect,
    create_reader_role,
    warehouse_dir,
)
from schemas.errors import ExternalError, StateError

PROFILE = Path(__file__).resolve().parents[1] / "dagster_home" / "production" / "dagster.yaml"
CODE_LOCATION = "assets.definitions"
STACK_FILE = "stack.json"
PIPELINE_ROLE = "stepledger"
# Dagster's instance and the pipeline's store: one database each on the stack's server.
DAGSTER_DB = "dagster"
STORE_DB = "stepledger"
DEMO_FINANCE_ROLE = f"{FINANCE_ROLE}_demo"
# The object store's prefixes: the fleet's (`STEPLEDGER_STORE` of `stack env`), and the demo's
# own, replaced by each demo as its database is; below each, the warehouse's data files.
FLEET_PREFIX = "fleet"
DEMO_PREFIX = "demo"
WAREHOUSE_PREFIX = "warehouse"
# Bounds for a server or service that cannot start or stop, far above what a loaded machine
# needs.
SERVER_WAIT_S = 300
STOP_GRACE_S = 20.0


class StackError(StateError):
    """The stack's directory is in use, or not a stack."""


@dataclass(frozen=True)
class Service:
    """A long-running process of the stack: its command and the variables it adds."""

    name: str
    command: list[str]
    env: dict[str, str]


@dataclass(frozen=True)
class StackLayout:
    root: Path

    @property
    def dagster_home(self) -> Path:
        return self.root / "dagster"

    @property
    def object_store(self) -> Path:
        return self.root / "s3"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def record(self) -> Path:
        return self.root / STACK_FILE


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_binaries() -> Path:
    """The directory of PostgreSQL's server commands: pg_ctl on PATH, else Debian's newest."""
    on_path = shutil.which("pg_ctl")
    if on_path:
        return Path(on_path).resolve().parent
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parts[-3])
    )
    if not versions:
        raise ExternalError("no PostgreSQL server (pg_ctl): install the `postgresql` package")
    return versions[-1].parent


def _server_user() -> str:
    """Who runs the server: initdb and postgres refuse root."""
    return "postgres" if os.geteuid() == 0 else getpass.getuser()


def _pg(binaries: Path, *command: str, cwd: Path) -> None:
    done = subprocess.run(
        [str(binaries / command[0]), *command[1:]],
        user=_server_user(),
        capture_output=True,
        text=True,
        cwd=cwd,
    )
    if done.returncode != 0:
        raise ExternalError(
            f"`{' '.join(command[:2])}` failed ({done.returncode}): {done.stderr.strip()[-800:]}"
        )


def _server_root(layout: StackLayout) -> Path:
    """Where the cluster lives: in the stack's directory, or as root (the server then runs as
    `postgres`, who may not reach a directory of root's) in a directory of its own under the
    system's temporary directory, which `down` removes."""
    if os.geteuid() != 0:
        return layout.root
    root = Path(tempfile.mkdtemp(prefix="stepledger-stack-postgres-"))
    shutil.chown(root, user=_server_user())
    return root


def start_postgres(server_root: Path, password: str, port: int, *, durable: bool = True) -> Path:
    """A new cluster in `server_root`/postgres for the role PIPELINE_ROLE, started on loopback;
    its binaries' directory. Not `durable`: nothing is flushed to disk (for throwaway
    clusters)."""
    binaries = server_binaries()
    unsynced = [] if durable else ["--no-sync"]
    password_file = server_root / "postgres.password"
    password_file.write_text(password)
    if os.geteuid() == 0:
        shutil.chown(password_file, user=_server_user())
    cluster = server_root / "postgres"
    _pg(
        binaries,
        "initdb",
        "-D",
        str(cluster),
        "-U",
        PIPELINE_ROLE,
        f"--pwfile={password_file}",
        "--auth=scram-sha-256",
        *unsynced,
        cwd=server_root,
    )
    password_file.unlink()
    run_postgres(server_root, port, durable=durable)
    return binaries


def run_postgres(server_root: Path, port: int, *, durable: bool = True) -> None:
    """Start the server of the cluster in `server_root`/postgres on loopback and wait until it
    takes connections (after a crash, once it has replayed its write-ahead log)."""
    _pg(
        server_binaries(),
        "pg_ctl",
        "-D",
        str(server_root / "postgres"),
        "-l",
        str(server_root / "postgres.log"),
        "-o",
        f"-h 127.0.0.1 -p {port} -k {server_root}" + ("" if durable else " -c fsync=off"),
        "-w",
        "-t",
        str(SERVER_WAIT_S),
        "start",
        cwd=server_root,
    )


def psql(binaries: Path, password: str, port: int, sql: str) -> None:
    client = binaries / "psql" if (binaries / "psql").exists() else Path("psql")
    done = subprocess.run(
        [str(client), f"postgresql://{PIPELINE_ROLE}:{password}@127.0.0.1:{port}/postgres"],
        input=sql,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0 or "ERROR" in done.stderr:
        raise ExternalError(f"psql: {done.stderr.strip()[-800:]}")


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """This process's environment with `env` added, as the stack's services get it; restored
    after."""
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _new_store(
    binaries: Path,
    password: str,
    port: int,
    database: str,
    data_dir: Path,
    store_env: Mapping[str, str],
    reader_role: str,
) -> str:
    """A database for the pipeline's store of `data_dir` (replacing one of the same name),
    with finance's read-only role `reader_role` (a role is the server's, not the database's:
    each store has its own, so making one never changes another's password); its connection
    string. Its warehouse is created with the object store's variables `store_env`, so its
    data files are where they say."""
    psql(
        binaries,
        password,
        port,
        f"DROP DATABASE IF EXISTS {database} WITH (FORCE);\nCREATE DATABASE {database};\n",
    )
    dsn = store_dsn(password, port, database)
    with (
        _environment(store_env),
        connect(DataDir(data_dir).state_file, postgres=dsn) as con,
    ):
        create_reader_role(
            con, warehouse_dir(data_dir), secrets.token_urlsafe(18), role=reader_role
        )
    return dsn


def stack_environment(password: str, port: int, data_dir: Path, home: Path) -> dict[str, str]:
    """The variables that point Dagster and the pipeline at the stack."""
    return {
        "DAGSTER_HOME": str(home),
        "DAGSTER_PG_HOST": "127.0.0.1",
        "DAGSTER_PG_PORT": str(port),
        "DAGSTER_PG_USER": PIPELINE_ROLE,
        "DAGSTER_PG_PASSWORD": password,
        "DAGSTER_PG_DB": DAGSTER_DB,
        DATA_ENV: str(data_dir),
    }


def store_dsn(password: str, port: int, database: str) -> str:
    return f"host=127.0.0.1 port={port} user={PIPELINE_ROLE} password={password} dbname={database}"


def dagster_services(webserver_port: int) -> list[Service]:
    bin_dir = Path(sys.executable).parent
    return [
        Service("daemon", [str(bin_dir / "dagster-daemon"), "run", "-m", CODE_LOCATION], {}),
        Service(
            "webserver",
            [
                str(bin_dir / "dagster-webserver"),
                "-m",
                CODE_LOCATION,
                "-h",
                "127.0.0.1",
                "-p",
                str(webserver_port),
            ],
            {},
        ),
    ]


def _start(service: Service, env: dict[str, str], logs: Path) -> int:
    with (logs / f"{service.name}.log").open("ab") as log:
        process = subprocess.Popen(
            service.command,
            env={**os.environ, **env, **service.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return process.pid


def up(
    directory: Path,
    data_dir: Path,
    *,
    webserver_port: int = 3000,
    services: Sequence[Callable[[dict[str, str]], Service]] = (),
) -> dict[str, object]:
    """Start the stack in `directory` (new, or stopped by `down`) for the data directory
    `data_dir`; returns what `stack.json` records. On a stack that runs there, restart the
    Dagster services it lost (`restart_lost_services`)."""
    layout = StackLayout(directory.resolve())
    if layout.record.is_file():
        return restart_lost_services(layout)
    if layout.root.exists() and any(layout.root.iterdir()):
        raise StackError(f"{layout.root}: not empty; give a new directory for the stack")
    password, port = secrets.token_urlsafe(18), free_port()
    data_dir = data_dir.resolve()
    layout.logs.mkdir(parents=True)
    server_root = _server_root(layout)
    record: dict[str, object] = {"cluster": str(server_root / "postgres")}
    started: dict[str, int] = {}
    record["processes"] = started
    _write_record(layout, record)
    try:
        record["binaries"] = str(binaries := start_postgres(server_root, password, port))
        _write_record(layout, record)
        psql(binaries, password, port, f"CREATE DATABASE {DAGSTER_DB};\n")
        env = stack_environment(password, port, data_dir, layout.dagster_home)
        record["env"] = env
        env.update(start_object_store(layout, started))
        _write_record(layout, record)
        env[POSTGRES_ENV] = _new_store(
            binaries, password, port, STORE_DB, data_dir, env, FINANCE_ROLE
        )
        _write_record(layout, record)
        layout.dagster_home.mkdir()
        shutil.copyfile(PROFILE, layout.dagster_home / "dagster.yaml")
        for service in [*(make(env) for make in services), *dagster_services(webserver_port)]:
            started[service.name] = _start(service, env, layout.logs)
            _write_record(layout, record)
        record["webserver"] = f"http://127.0.0.1:{webserver_port}"
        _write_record(layout, record)
    except BaseException:
        down(layout.root)
        raise
    return record


def restart_lost_services(layout: StackLayout) -> dict[str, object]:
    """Start again the Dagster services of the running stack in `layout` whose processes are
    all gone (killed, or lost with their machine), with the environment they had; what
    `stack.json` records then. Before the daemon starts, the runs it had launched whose process
    died with it are marked failed (`fail_runs_of_dead_workers`): Dagster's default launcher
    cannot tell, and the daemon's run retries (`run_retries` in the profile) then run them
    again. Raises StackError when nothing was lost."""
    record = json.loads(layout.record.read_text())
    started: dict[str, int] = record["processes"]
    port = int(str(record["webserver"]).rsplit(":", 1)[1])
    lost = [s for s in dagster_services(port) if not _process_exists(started[s.name])]
    if not lost:
        raise StackError(f"{layout.record}: a stack runs there; `stepledger stack down` first")
    for service in lost:
        # What of its process group outlived it (the daemon's code server, the runs that
        # server launched) goes with it, as on a lost machine: the new service starts clean.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(started[service.name], signal.SIGKILL)
    env: dict[str, str] = record["env"]
    if "daemon" in {s.name for s in lost}:
        fail_runs_of_dead_workers(env)
    for service in lost:
        started[service.name] = _start(service, env, layout.logs)
        _write_record(layout, record)
    return dict(record)


@contextlib.contextmanager
def _stack_instance(env: dict[str, str]) -> Iterator[DagsterInstance]:
    """The stack's Dagster instance: its dagster.yaml reads the connection from the
    environment, set for the while."""
    with _environment(env), DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
        yield instance


def fail_runs_of_dead_workers(env: dict[str, str]) -> list[str]:
    """Mark failed the runs in progress whose process (the pid their launch recorded: runs of
    this machine's daemon) no longer exists; their ids. Runs made in-process (`stepledger run`)
    record no such pid and are left alone, as are launched runs that have not started yet
    (run monitoring fails those after `start_timeout_seconds`)."""
    failed = []
    with _stack_instance(env) as instance:
        for run in instance.get_runs(RunsFilter(statuses=[DagsterRunStatus.STARTED])):
            pids = [
                int(str(event.dagster_event.engine_event_data.metadata["pid"].value))
                for event in instance.all_logs(run.run_id, of_type=DagsterEventType.ENGINE_EVENT)
                if event.dagster_event is not None
                and "pid" in event.dagster_event.engine_event_data.metadata
            ]
            if pids and not _process_exists(pids[0]):
                instance.report_run_failed(
                    run, f"its process (pid {pids[0]}) ended with the daemon that launched it"
                )
                failed.append(run.run_id)
    return failed


def _process_exists(pid: int) -> bool:
    """Whether `pid` runs: a process that has exited but not been reaped yet (a zombie) does
    not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    # The state follows the command name, which is in parentheses and may hold spaces.
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def start_object_store(layout: StackLayout, started: dict[str, int]) -> dict[str, str]:
    """Start the S3 server in `layout` (its process group recorded in `started`, for `down`);
    the variables that point the shipper and the pipeline at the fleet's prefix on it, and the
    reader's keys finance reads the warehouse's data files there with."""
    server = S3Server(layout.object_store)
    try:
        server.start()
    finally:
        # Recorded even when it did not answer in time, so `down` stops what did start.
        if server.process is not None:
            started["s3"] = server.process.pid
    return {
        **server.env(),
        STORE_VARIABLE: server.uri(FLEET_PREFIX),
        WAREHOUSE_DATA_VARIABLE: server.uri(f"{FLEET_PREFIX}/{WAREHOUSE_PREFIX}"),
    }


def _write_record(layout: StackLayout, record: dict[str, object]) -> None:
    partial = layout.record.with_suffix(".partial")
    partial.write_text(json.dumps(record, indent=2))
    partial.chmod(0o600)
    os.replace(partial, layout.record)


def group_running(pgid: int) -> bool:
    """Whether a process of the group `pgid` exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _reap(pgid: int) -> None:
    """Collect the group's leader if it has exited and this process started it (`up` and
    `down` in one process): until then it is a zombie, which still counts as a member of its
    group, and `_stop_group` would wait out its grace for a process that has ended."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pgid, os.WNOHANG)


def _stop_group(pgid: int) -> None:
    """SIGTERM to the service's process group, SIGKILL to what outlives the grace period."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline:
        _reap(pgid)
        if not group_running(pgid):
            break
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def down(directory: Path) -> list[str]:
    """Stop everything the stack in `directory` started, newest first, PostgreSQL last; the
    directory (data, logs) stays. Returns the names of what was stopped."""
    layout = StackLayout(directory.resolve())
    if not layout.record.is_file():
        raise StackError(f"{layout.record}: no stack runs in {layout.root}")
    record = json.loads(layout.record.read_text())
    stopped = []
    for name, pgid in reversed(list(record.get("processes", {}).items())):
        _stop_group(int(pgid))
        stopped.append(name)
    cluster = Path(record["cluster"])
    if "binaries" in record and stop_postgres(cluster):
        stopped.append("postgres")
    if not cluster.is_relative_to(layout.root):
        shutil.rmtree(cluster.parent, ignore_errors=True)
    layout.record.unlink()
    return stopped


def stop_postgres(cluster: Path) -> bool:
    """Stop the server of `cluster` if it runs (fast: open sessions are rolled back); whether
    it ran."""
    if not (cluster / "postmaster.pid").exists():
        return False
    stop = ["pg_ctl", "-D", str(cluster), "-m", "fast", "-w", "-t", str(SERVER_WAIT_S), "stop"]
    _pg(server_binaries(), *stop, cwd=cluster.parent)
    return True


def environment_of(directory: Path) -> dict[str, str]:
    """The variables that reach the running stack in `directory`."""
    record = StackLayout(directory.resolve()).record
    if not record.is_file():
        raise StackError(f"{record}: no stack runs in {directory}; `stepledger stack up` first")
    env: dict[str, str] = json.loads(record.read_text())["env"]
    return env


def demo_environment(directory: Path, data_dir: Path) -> dict[str, str]:
    """The running stack's variables for a demo billed into `data_dir`: a store of the demo's
    own on the stack's server (database `stepledger_demo`) and a prefix of its own on the
    stack's S3 server (`demo`: its segments, and its warehouse's data files below
    `demo/warehouse`), both replaced by each demo as the demo's directory is."""
    layout = StackLayout(directory.resolve())
    env = environment_of(layout.root)
    record = json.loads(layout.record.read_text())
    port = int(env["DAGSTER_PG_PORT"])
    password = env["DAGSTER_PG_PASSWORD"]
    bucket = env[STORE_VARIABLE].removeprefix("s3://").split("/")[0]
    try:
        s3_filesystem(env).delete_dir_contents(f"{bucket}/{DEMO_PREFIX}", missing_dir_ok=True)
    except OSError as err:
        raise ExternalError(f"the stack's S3 server ({env['AWS_ENDPOINT_URL']}): {err}") from err
    demo = {
        **env,
        DATA_ENV: str(data_dir.resolve()),
        STORE_VARIABLE: f"s3://{bucket}/{DEMO_PREFIX}",
        WAREHOUSE_DATA_VARIABLE: f"s3://{bucket}/{DEMO_PREFIX}/{WAREHOUSE_PREFIX}",
    }
    binaries = Path(record["binaries"])
    dsn = _new_store(binaries, password, port, "stepledger_demo", data_dir, demo, DEMO_FINANCE_ROLE)
    return {**demo, POSTGRES_ENV: dsn}
