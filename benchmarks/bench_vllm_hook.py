"""The vLLM hook's cost on the engine thread, through vLLM's real scheduler.

256 requests decode side by side in vLLM's AsyncScheduler (CPU, a tiny model config, synthetic
model outputs, prefix caching on, every request sharing a 4-block system prompt). Timed per
step: everything the recording subclass adds to schedule() and update_from_output() (what it
keeps of the step, queueing it to the recorder), as the time of each call less that of vLLM's
own method inside it, with the recorder's writer thread running. The scheduler's own
schedule() + update_from_output() time is reported beside it for scale.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.figure import Figure

SLOTS_PER_STEP = 256
SHARED_PROMPT = list(range(1000, 1064))


def _timed_scheduler(base: type, durations: dict[str, list[int]]) -> type:
    """`base` with the wall time of each schedule() and update_from_output() call appended to
    `durations` under the method's name."""

    class Timed(base):  # type: ignore[misc]  # the base class is chosen at run time
        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter_ns()
            output = super().schedule(*args, **kwargs)
            durations["schedule"].append(time.perf_counter_ns() - began)
            return output

        def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter_ns()
            result = super().update_from_output(*args, **kwargs)
            durations["update_from_output"].append(time.perf_counter_ns() - began)
            return result

    return Timed


def hook_cost(adapter: Any, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Nanoseconds per recorded step that `adapter`'s recording subclass adds on the engine
    thread (its schedule() and update_from_output() less vLLM's own, timed inside), and per
    engine step (schedule + update_from_output, hook included)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from pipeline.datadir import DataDir
    from pipeline.hook.recorder import StepRecorder
    from tests.helpers.steplog_samples import HEADER
    from tests.pipeline.hook.vllm_engine import (
        Engine,
        build_scheduler,
        request_factory,
        vllm_config,
    )

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        config = vllm_config(
            root / "tiny-llama",
            num_gpu_blocks=8192,
            max_num_seqs=SLOTS_PER_STEP,
            max_num_batched_tokens=8192,
            async_scheduling=True,
            num_speculative_tokens=0,
        )
        inner: dict[str, list[int]] = {"schedule": [], "update_from_output": []}
        outer: dict[str, list[int]] = {"schedule": [], "update_from_output": []}
        recording = adapter.recording_scheduler_class(
            _timed_scheduler(AsyncScheduler, inner),
            lambda scheduler: StepRecorder(DataDir(root).outbox, HEADER),
        )
        scheduler = build_scheduler(_timed_scheduler(recording, outer), config)
        make_request = request_factory(config)
        for index in range(SLOTS_PER_STEP):
            prompt = SHARED_PROMPT + [2000 + index] * (16 + index % 48)
            scheduler.add_request(make_request(f"cmpl-{index:04d}", prompt, max_tokens=10**6))
        engine = Engine(scheduler, async_scheduling=True)
        for _ in range(8):
            engine.step()
        for durations in (inner, outer):
            for calls in durations.values():
                calls.clear()
        engine_steps = []
        for _ in range(steps):
            began = time.perf_counter_ns()
            engine.step()
            engine_steps.append(time.perf_counter_ns() - began)
            time.sleep(0.0005)
        engine.drain()
        recorder = scheduler.step_recorder
        scheduler.shutdown()
        if recorder.dropped_steps or recorder.rejected_steps:
            raise RuntimeError(f"the recorder dropped or rejected steps: {recorder.dropped_steps}")

    # Every step decodes all requests, so the n-th schedule() and update_from_output() calls
    # belong to the same step.
    added = {
        name: np.asarray(outer[name], np.int64) - np.asarray(inner[name], np.int64)
        for name in outer
    }
    paired = min(map(len, added.values()))
    per_step = added["schedule"][:paired] + added["update_from_output"][:paired]
    return per_step, np.asarray(engine_steps, np.int64)


def figures(quick: bool) -> list[Figure]:
    import pipeline.hook.vllm as adapter

    per_step, with_hook = hook_cost(adapter, 100 if quick else 3000)
    return [
        Figure("vllm_hook_step_us_median", float(np.median(per_step)) / 1e3, "us", 20, "max"),
        Figure("vllm_hook_step_us_p99", float(np.percentile(per_step, 99)) / 1e3, "us", 100, "max"),
        Figure("vllm_scheduler_step_us_median", float(np.median(with_hook)) / 1e3, "us", 0, "min"),
    ]
