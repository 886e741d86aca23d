"""The vLLM adapter's mapping, against objects shaped like vLLM's v1 scheduler state."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipeline.vllm_adapter as adapter
from pipeline.steplog import StepRecorder, read_segments
from schemas.config import ConfigError, load_pools


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()


@dataclass
class Request:
    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.RUNNING


@dataclass
class KVCacheManager:
    """get_block_ids and block_pool as in vllm/v1/core/kv_cache_manager.py."""

    held: dict[str, tuple[list[int], ...]]
    num_gpu_blocks: int = 64
    free: int = 10
    block_pool: SimpleNamespace = field(init=False)

    def __post_init__(self) -> None:
        ref_counts: dict[int, int] = {}
        for groups in self.held.values():
            for block in (b for group in groups for b in group):
                ref_counts[block] = ref_counts.get(block, 0) + 1
        blocks = [
            SimpleNamespace(block_id=i, ref_cnt=ref_counts.get(i, 0))
            for i in range(self.num_gpu_blocks)
        ]
        self.block_pool = SimpleNamespace(
            blocks=blocks,
            null_block=blocks[0],
            num_gpu_blocks=self.num_gpu_blocks,
            get_num_free_blocks=lambda: self.free,
        )

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.held.get(request_id, ([],))


def scheduler_state() -> tuple[SimpleNamespace, SimpleNamespace]:
    """Three scheduled requests (a new one with a prefix hit, a decode with two drafts, a
    chunked prefill), one running request left out, one preempted request holding a block."""
    requests = {
        "new": Request("new", num_prompt_tokens=300, num_cached_tokens=256),
        "dec": Request("dec", num_prompt_tokens=40),
        "chunk": Request("chunk", num_prompt_tokens=900, num_cached_tokens=0),
        "idle": Request("idle", num_prompt_tokens=20),
        "pre": Request(
            "pre", num_prompt_tokens=50, status=RequestStatus.PREEMPTED, num_preemptions=1
        ),
        "queued": Request("queued", num_prompt_tokens=70, status=RequestStatus.WAITING),
    }
    # Block 1-2 shared by "new" and "dec" (a common prefix); block 0 is vLLM's null block.
    kv = KVCacheManager(
        held={
            "new": ([1, 2, 3], [0]),
            "dec": ([1, 2, 4, 5],),
            "chunk": ([6, 7],),
            "idle": ([8],),
            "pre": ([9],),
        }
    )
    scheduler = SimpleNamespace(
        requests=requests,
        running=[requests["dec"], requests["chunk"], requests["idle"], requests["new"]],
        waiting=[requests["pre"], requests["queued"]],
        kv_cache_manager=kv,
        max_num_running_reqs=8,
        max_num_scheduled_tokens=4096,
    )
    output = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="new", num_computed_tokens=256)],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=["dec", "chunk"], num_computed_tokens=[57, 512], resumed_req_ids=set()
        ),
        num_scheduled_tokens={"dec": 3, "chunk": 388, "new": 44},
        total_num_scheduled_tokens=435,
        scheduled_spec_decode_tokens={"dec": [11, 12]},
        preempted_req_ids=None,
    )
    return scheduler, output


def test_scheduled_step_maps_scheduler_state():
    scheduler, output = scheduler_state()
    step = adapter.scheduled_step(scheduler, output)
    assert step.request_ids == ["dec", "chunk", "new"]
    assert step.new_tokens == [3, 388, 44]
    assert step.context_tokens == [57, 512, 256]
    assert step.prompt_tokens == [40, 900, 300]
    assert step.prefix_hit_tokens == [0, 0, 256]
    assert step.spec_drafted == [2, 0, 0]
    assert step.kv_blocks.tolist() == [0.5 + 0.5 + 1 + 1, 2.0, 0.5 + 0.5 + 1]
    assert step.holder_ids == ["idle", "pre"]
    assert step.holder_states == ["waiting", "preempted"]
    assert step.holder_blocks.tolist() == [1.0, 1.0]
    assert step.admission_blocked is True
    assert (step.free_blocks, step.total_blocks) == (10, 64)


def test_block_shares_split_shared_prefixes_and_skip_null_blocks():
    kv = KVCacheManager(
        held={
            "a": ([1, 2, 3, 4],),
            "b": ([1, 2, 5],),
            "c": ([1, 6],),
            "window": ([0, 0, 7, 8],),
            "window-twin": ([0, 7, 9],),
        }
    )
    shares = adapter._BlockShares(kv)
    # Block 1 is held by three requests, block 2 by two, block 7 by two.
    assert shares.held(["a", "b", "c", "window", "window-twin", "none"]).tolist() == [
        1 / 3 + 1 / 2 + 2,
        1 / 3 + 1 / 2 + 1,
        1 / 3 + 1,
        1 / 2 + 1,
        1 / 2 + 1,
        0.0,
    ]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 4)), min_size=1, max_size=8))
def test_block_shares_of_all_holders_sum_to_the_blocks_held(requests):
    """Requests share prefixes of one cached chain (blocks 1-6), then own private blocks."""
    held, next_private = {}, 100
    for index, (shared, private) in enumerate(requests):
        held[f"r{index}"] = (
            list(range(1, shared + 1)) + list(range(next_private, next_private + private)),
        )
        next_private += private
    kv = KVCacheManager(held=held, num_gpu_blocks=200)
    shares = adapter._BlockShares(kv).held(list(held))
    distinct = {block for groups in held.values() for block in groups[0]}
    assert math.isclose(shares.sum(), len(distinct), rel_tol=1e-12)
    expected = [
        sum(1 / sum(b in other[0] for other in held.values()) for b in groups[0])
        for groups in held.values()
    ]
    assert np.allclose(shares, expected, rtol=1e-12, atol=0)


def test_admission_not_blocked_when_a_limit_explains_the_queue():
    scheduler, output = scheduler_state()
    scheduler.max_num_scheduled_tokens = output.total_num_scheduled_tokens
    assert adapter.scheduled_step(scheduler, output).admission_blocked is False
    scheduler.waiting = []
    scheduler.max_num_scheduled_tokens = 4096
    assert adapter.scheduled_step(scheduler, output).admission_blocked is False


def test_prefix_hits_only_on_a_first_schedule():
    scheduler, output = scheduler_state()
    scheduler.requests["new"].num_preemptions = 1
    assert adapter.scheduled_step(scheduler, output).prefix_hit_tokens == [0, 0, 0]


def test_accepted_tokens_are_sampled_tokens_minus_the_bonus():
    scheduler, output = scheduler_state()
    step = adapter.scheduled_step(scheduler, output)
    runner = SimpleNamespace(
        req_id_to_index={"chunk": 0, "dec": 1, "new": 2}, sampled_token_ids=[[], [5, 6], [9]]
    )
    assert adapter.accepted_tokens(step, runner) == [1, 0, 0]
    runner.sampled_token_ids = [[], [5, 6, 7], [9]]
    assert adapter.accepted_tokens(step, runner) == [2, 0, 0]
    runner.sampled_token_ids = []
    assert adapter.accepted_tokens(step, runner) == [0, 0, 0]


class FakeScheduler:
    """The slice of vllm.v1.core.sched.scheduler.Scheduler the recording subclass touches."""

    def __init__(self, steps: list[tuple[SimpleNamespace, SimpleNamespace]]) -> None:
        self._steps = list(steps)
        self.updates: list[object] = []
        self.shut_down = False
        state, _ = scheduler_state()
        vars(self).update(vars(state))

    def schedule(self):
        return self._steps.pop(0)[0]

    def update_from_output(self, scheduler_output, model_runner_output):
        self.updates.append(scheduler_output)
        return {0: "outputs"}

    def shutdown(self) -> None:
        self.shut_down = True


def test_recording_scheduler_records_each_scheduled_step(tmp_path: Path):
    pool = load_pools().pools[0]
    header = adapter.header_for(
        pool, pool.replicas[0].id, "0.11.0", "550.54.15", pool.gpus_per_replica, 16
    )
    _, output = scheduler_state()
    idle = SimpleNamespace(total_num_scheduled_tokens=0)
    runner = SimpleNamespace(
        req_id_to_index={"dec": 0, "chunk": 1, "new": 2}, sampled_token_ids=[[5, 6, 7], [], [1]]
    )
    outbox = tmp_path / "outbox"
    recording = adapter.recording_scheduler_class(
        FakeScheduler, lambda scheduler: StepRecorder(outbox, header)
    )
    assert recording.__name__ == "RecordingFakeScheduler"
    scheduler = recording([(output, runner), (idle, None)])
    first = scheduler.schedule()
    assert scheduler.update_from_output(first, runner) == {0: "outputs"}
    second = scheduler.schedule()
    scheduler.update_from_output(second, None)
    scheduler.shutdown()
    assert scheduler.shut_down and scheduler.updates == [first, second]
    decoded = read_segments(outbox.glob("*.seg"))
    assert decoded.steps.column("seq").to_pylist() == [0]
    slots = decoded.slots.to_pylist()
    assert [
        (s["request_id"], s["new_tokens"], s["spec_drafted"], s["spec_accepted"]) for s in slots
    ] == [
        ("dec", 3, 2, 2),
        ("chunk", 388, 0, 0),
        ("new", 44, 0, 0),
    ]
    assert decoded.holders.column("state").to_pylist() == ["waiting", "preempted"]
    step = decoded.steps.to_pylist()[0]
    assert step["end_ns"] >= step["start_ns"] and step["admission_blocked"]


def test_header_checks_the_pools_file():
    pool = load_pools().pools[0]
    replica = pool.replicas[0].id
    header = adapter.header_for(pool, replica, "0.11.0", "550.54.15", pool.gpus_per_replica, 16)
    assert (header.pool, header.replica, header.model, header.gpu_type) == (
        pool.name,
        replica,
        pool.model,
        pool.gpu_type,
    )
    with pytest.raises(ConfigError, match="runs on 3 GPUs"):
        adapter.header_for(pool, replica, "0.11.0", "550", 3, 16)
    with pytest.raises(ConfigError, match="not listed in pool"):
        adapter.header_for(pool, "nope", "0.11.0", "550", pool.gpus_per_replica, 16)


def test_driver_version_from_environment(monkeypatch):
    monkeypatch.setenv("STEPLEDGER_DRIVER_VERSION", "550.54.15")
    assert adapter.driver_version() == "550.54.15"


def test_vllm_is_imported_only_on_demand():
    with pytest.raises(AttributeError):
        adapter.NotAScheduler  # noqa: B018
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError):
            adapter.RecordingScheduler  # noqa: B018
