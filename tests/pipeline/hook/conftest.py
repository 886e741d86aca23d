"""The replica descriptor the engine hooks' tests start their engines with, written by the real
`stepledger hook-config` from the default pools file."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.hook.replica import ReplicaDescriptor, read_descriptor

REPLICA = "chat-8b-r0"


def write_descriptor(path: Path, replica: str = REPLICA) -> Path:
    result = CliRunner().invoke(main, ["hook-config", "--replica", replica, "--out", str(path)])
    assert result.exit_code == 0, result.output
    return path


@pytest.fixture(scope="session")
def descriptor_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_descriptor(tmp_path_factory.mktemp("hook-config") / f"{REPLICA}.json")


@pytest.fixture(scope="session")
def replica(descriptor_path: Path) -> ReplicaDescriptor:
    """chat-8b-r0 of the default pools file: pool chat-8b, llama-3.1-8b-instruct on one h100."""
    return read_descriptor(descriptor_path)
