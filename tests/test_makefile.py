"""`make demo` installs the project alone; the test and engine extras come with `make test`."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def planned_commands(target: str, venv: Path) -> list[str]:
    """The commands make would run for `target` with an empty virtualenv at `venv`."""
    made = subprocess.run(
        ["make", "-n", target, f"VENV={venv}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return [line for line in made.stdout.splitlines() if "pip install" in line]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_demo_installs_the_project_without_the_test_and_engine_extras(tmp_path: Path) -> None:
    installs = planned_commands("demo", tmp_path / "venv")
    assert installs == [f"{tmp_path / 'venv'}/bin/pip install --quiet -e ."]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_test_installs_the_test_and_engine_extras(tmp_path: Path) -> None:
    installs = planned_commands("test", tmp_path / "venv")
    assert f"{tmp_path / 'venv'}/bin/pip install --quiet -e '.[test,vllm]'" in installs
