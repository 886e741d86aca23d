"""The SGLang hook's cost on the engine thread, on SGLang's real scheduling code.

256 requests decode side by side in SGLang 0.5.23's batches, radix cache and memory pools
(CPU, a tiny model config, driven as tests/pipeline/hook/sglang_engine.py does in SGLang's default
overlap loop; every request shares a 64-token system prompt held in the radix tree). Timed per step: everything the
recording scheduler adds to `run_batch` and `process_batch_result` (what it keeps of the
batch, queueing it to the recorder), as the time of each call less that of the loop's own
method inside it, with the recorder's writer thread running. The loop's own
step time (SGLang's scheduling and KV bookkeeping, hook included) is reported beside it.

SGLang lives beside the venv (`make test` installs it into .venv/sglang-0.5.23, see the
Makefile), with a torchvision the vLLM benchmarks must not see: the measurement runs in a
child process whose path has it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.figure import Figure

ROOT = Path(__file__).resolve().parents[1]
SGLANG_DIR = ROOT / ".venv" / "sglang-0.5.23"
SLOTS_PER_STEP = 256
SHARED_PROMPT = list(range(1000, 1064))


def _timed_scheduler(base: type, durations: dict[str, list[int]]) -> type:
    """`base` with the wall time of each run_batch() and process_batch_result() call appended
    to `durations` under the method's name."""

    class Timed(base):  # type: ignore[misc]  # the base class is chosen at run time
        def run_batch(self, *args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter_ns()
            result = super().run_batch(*args, **kwargs)
            durations["run_batch"].append(time.perf_counter_ns() - began)
            return result

        def process_batch_result(self, *args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter_ns()
            processed = super().process_batch_result(*args, **kwargs)
            durations["process_batch_result"].append(time.perf_counter_ns() - began)
            return processed

    return Timed


def hook_cost(steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Nanoseconds the recording scheduler adds on the engine thread per decode step (its
    run_batch() and process_batch_result() less the loop's own, timed inside), and per loop
    step (hook included)."""
    from pipeline.datadir import DataDir
    from pipeline.hook import sglang as adapter
    from pipeline.hook.recorder import StepRecorder
    from tests.helpers.steplog_samples import HEADER
    from tests.pipeline.hook.sglang_engine import Engine, server_args

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        args = server_args(
            root / "tiny-llama",
            chunked_prefill_size=8192,
            max_running_requests=SLOTS_PER_STEP,
        )
        inner: dict[str, list[int]] = {"run_batch": [], "process_batch_result": []}
        outer: dict[str, list[int]] = {"run_batch": [], "process_batch_result": []}
        recording = adapter.recording_scheduler_class(
            _timed_scheduler(Engine, inner),
            lambda scheduler: StepRecorder(DataDir(root).outbox, HEADER),
        )
        # SGLang's default event loop, the overlap one.
        engine = _timed_scheduler(recording, outer)(args, SLOTS_PER_STEP * 512, True)
        for index in range(SLOTS_PER_STEP):
            prompt = SHARED_PROMPT + [2000 + index] * (16 + index % 48)
            engine.add_request(f"cmpl-{index:04d}", prompt, max_new_tokens=400)
        while engine.waiting_queue or engine.chunked_req is not None:
            engine.step()
        for _ in range(8):
            engine.step()
        for durations in (inner, outer):
            for calls in durations.values():
                calls.clear()
        loop_ns = []
        for _ in range(steps):
            began = time.perf_counter_ns()
            batch = engine.step()
            loop_ns.append(time.perf_counter_ns() - began)
            if batch is None or len(batch.reqs) != SLOTS_PER_STEP:
                raise RuntimeError("the benchmark's requests stopped decoding side by side")
            time.sleep(0.0005)
        recorder = engine.step_tracker.recorder
        engine.release_host_resources()
        if recorder.dropped_steps or recorder.rejected_steps:
            raise RuntimeError(
                f"the recorder dropped {recorder.dropped_steps} and rejected "
                f"{recorder.rejected_steps} steps"
            )
    added = {
        name: np.asarray(outer[name], np.int64) - np.asarray(inner[name], np.int64)
        for name in outer
    }
    per_step = added["run_batch"] + added["process_batch_result"]
    return per_step, np.asarray(loop_ns, np.int64)


def measure(steps: int) -> dict[str, list[float]]:
    from tests.pipeline.hook.sglang_torchvision import declare_torchvision_operators

    declare_torchvision_operators()
    hook, loop = hook_cost(steps)
    return {"hook_ns": hook.tolist(), "loop_ns": loop.tolist()}


def figures(quick: bool) -> list[Figure]:
    steps = 100 if quick else 300
    child = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_sglang_hook", str(steps)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(SGLANG_DIR)])},
        capture_output=True,
        text=True,
        check=True,
    )
    measured = json.loads(child.stdout.strip().splitlines()[-1])
    hook, loop = np.asarray(measured["hook_ns"]), np.asarray(measured["loop_ns"])
    return [
        Figure("sglang_hook_step_us_median", float(np.median(hook)) / 1e3, "us", 20, "max"),
        Figure("sglang_hook_step_us_p99", float(np.percentile(hook, 99)) / 1e3, "us", 100, "max"),
        Figure("sglang_scheduler_step_us_median", float(np.median(loop)) / 1e3, "us", 0, "min"),
    ]


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]))))
