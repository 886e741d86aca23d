"""What loading the vLLM hook costs the engine's process: the time `import pipeline.hook.vllm`
takes in a fresh interpreter (what the interpreter loads at start excluded, bytecode already
compiled), the median of several interpreters started one after another."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.figure import Figure

ROOT = Path(__file__).resolve().parents[1]
_TIMED_IMPORT = (
    "import time\n"
    "began = time.perf_counter_ns()\n"
    "import pipeline.hook.vllm\n"
    "print(time.perf_counter_ns() - began)\n"
)


def _import_ns() -> int:
    # From the repository root, whose `pipeline` comes first on sys.path for `-c`.
    completed = subprocess.run(
        [sys.executable, "-c", _TIMED_IMPORT], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return int(completed.stdout)


def figures(quick: bool) -> list[Figure]:
    _import_ns()  # compiles the bytecode the timed imports then read
    timed = [_import_ns() for _ in range(5 if quick else 21)]
    return [Figure("hook_import_ms", statistics.median(timed) / 1e6, "ms", 150, "max")]
