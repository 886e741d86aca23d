"""The atheris harness runs a fixed budget when atheris is installed (the `fuzz` extra)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNS = 3000


@pytest.mark.timeout(300)
def test_coverage_guided_fuzzing_finds_no_crash_hang_or_memory_blowup(tmp_path):
    pytest.importorskip("atheris")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.hardening.fuzz_decoder_atheris",
            f"-runs={RUNS}",
            "-timeout=10",
            "-rss_limit_mb=3072",
            "-seed=1",
        ],
        # libFuzzer writes its findings to the working directory, so the repository goes on
        # the import path instead.
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"Done {RUNS} runs" in result.stderr
    assert not [
        p.name for p in tmp_path.iterdir() if p.name.startswith(("crash-", "timeout-", "oom-"))
    ]
