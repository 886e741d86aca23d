"""The SGLang hook's cost on the engine thread, on SGLang's real scheduling code.

256 requests decode side by side in SGLang 0.5.23's batches, radix cache and memory pools
(CPU, a tiny model config, driven as tests/pipeline/sglang_engine.py does; every request
shares a 64-token system prompt held in the radix tree). Timed per step: the three calls the
recording scheduler adds around `run_batch` and `process_batch_result` (what it keeps of the
batch, queueing it to the recorder), with the recorder's writer thread running. The loop's own
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

import numpy as np

from benchmarks.figure import Figure

ROOT = Path(__file__).resolve().parents[1]
SGLANG_DIR = ROOT / ".venv" / "sglang-0.5.23"
SLOTS_PER_STEP = 256
SHARED_PROMPT = list(range(1000, 1064))


def hook_cost(steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Nanoseconds the hook adds on the engine thread per decode step, and per loop step."""
    from pipeline import sglang_adapter as adapter
    from pipeline.steplog import StepRecorder
    from tests.helpers.steplog_samples import HEADER
    from tests.pipeline.sglang_engine import Engine, server_args

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        args = server_args(
            root / "tiny-llama",
            chunked_prefill_size=8192,
            max_running_requests=SLOTS_PER_STEP,
        )
        engine = Engine(args, kv_tokens=SLOTS_PER_STEP * 512)
        recorder = StepRecorder(root / "outbox", HEADER)
        tracker = adapter.StepTracker(
            recorder,
            engine.req_to_token_pool.req_to_token,
            engine.page_size,
            engine.token_to_kv_pool_allocator.size,
        )
        hook_ns: list[int] = []
        launched: list[adapter.LaunchedStep] = []

        def on_launch(engine: Engine, batch: object) -> None:
            began = time.perf_counter_ns()
            allocator = engine.token_to_kv_pool_allocator
            tracker.launched(
                batch,
                engine.running_batch,
                engine.chunked_req,
                bool(engine.retracted),
                len(engine.waiting_queue),
                engine.max_running_requests,
                allocator.available_size() + engine.tree_cache.evictable_size(),
            )
            hook_ns.append(time.perf_counter_ns() - began)

        def on_result(engine: Engine, batch: object) -> None:
            began = time.perf_counter_ns()
            launched.append(tracker.result_arrived())
            hook_ns[-1] += time.perf_counter_ns() - began

        def after_result(engine: Engine, batch: object) -> None:
            began = time.perf_counter_ns()
            tracker.result_processed(launched.pop())
            hook_ns[-1] += time.perf_counter_ns() - began

        engine.on_launch, engine.on_result, engine.after_result = (
            on_launch,
            on_result,
            after_result,
        )
        for index in range(SLOTS_PER_STEP):
            prompt = SHARED_PROMPT + [2000 + index] * (16 + index % 48)
            engine.add_request(f"cmpl-{index:04d}", prompt, max_new_tokens=400)
        while engine.waiting_queue or engine.chunked_req is not None:
            engine.step()
        for _ in range(8):
            engine.step()
        hook_ns.clear()
        loop_ns = []
        for _ in range(steps):
            began = time.perf_counter_ns()
            batch = engine.step()
            loop_ns.append(time.perf_counter_ns() - began)
            if batch is None or len(batch.reqs) != SLOTS_PER_STEP:
                raise RuntimeError("the benchmark's requests stopped decoding side by side")
            time.sleep(0.0005)
        recorder.close()
        if recorder.dropped_steps or recorder.rejected_steps:
            raise RuntimeError(
                f"the recorder dropped {recorder.dropped_steps} and rejected "
                f"{recorder.rejected_steps} steps"
            )
    return np.asarray(hook_ns, np.int64), np.asarray(loop_ns, np.int64)


def measure(steps: int) -> dict[str, list[float]]:
    from tests.pipeline.sglang_torchvision import declare_torchvision_operators

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
