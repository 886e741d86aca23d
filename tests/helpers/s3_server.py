"""A real S3 server for the tests: SeaweedFS on loopback over a temporary directory
(`pipeline.ship.s3server`), always stopped when the test's context ends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.ship.s3server import S3Server


@contextlib.contextmanager
def running_s3_server(directory: Path) -> Iterator[S3Server]:
    server = S3Server(directory)
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A started server, and its variables in the environment, as a deployment sets them; one
    per module (each test uses a prefix of its own)."""
    directory = tmp_path_factory.mktemp("s3")
    with running_s3_server(directory) as server, pytest.MonkeyPatch.context() as patch:
        for name, value in server.env().items():
            patch.setenv(name, value)
        yield server
