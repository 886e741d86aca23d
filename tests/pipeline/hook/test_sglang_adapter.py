"""The SGLang hook's refusals, header and KV split, without SGLang where they do not need it;
its plugin registration with SGLang's own hook registry where SGLang is installed."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

import pipeline.hook.sglang as adapter
from pipeline.hook.replica import HookConfigError, ReplicaDescriptor

ROOT = Path(__file__).resolve().parents[3]
ONE_GPU = adapter.Parallelism(tp_size=1, pp_size=1, moe_ep_size=1, attn_dp_size=1, attn_tp_rank=0)


@pytest.mark.parametrize("version", ["0.5.23", "0.5.23.post1"])
def test_the_tested_release_is_accepted(version: str) -> None:
    adapter.check_sglang_version(version)


@pytest.mark.parametrize("version", ["0.5.22", "0.5.24", "0.6.0", "0.4.10.post2", "main"])
def test_other_releases_are_refused_naming_version_and_range(version: str) -> None:
    with pytest.raises(adapter.UnsupportedSglangVersion) as refused:
        adapter.check_sglang_version(version)
    assert str(refused.value) == (
        f"the step-recording scheduler does not support SGLang {version}; "
        "supported: sglang>=0.5.23,<0.5.24 (0.5.23 and its post releases)"
    )


# What the server runs: its parallel layout, speculative algorithm, and whether the overlap
# loop and mixed chunks are on.
@pytest.mark.parametrize(
    ("parallel", "speculative", "loop", "message"),
    [
        (
            adapter.Parallelism(4, 2, 1, 1, 0),
            None,
            (True, False),
            "pipeline parallelism (pp_size=2) is not supported",
        ),
        (
            adapter.Parallelism(4, 1, 1, 1, 0, attn_cp_size=2),
            None,
            (True, False),
            "attention context parallelism (attn_cp_size=2) is not supported",
        ),
        (
            ONE_GPU,
            "EAGLE",
            (True, False),
            "speculative decoding (EAGLE) is recorded only without the overlap scheduler: "
            "start the server with --disable-overlap-schedule",
        ),
        (
            ONE_GPU,
            "EAGLE3",
            (False, True),
            "speculative decoding (EAGLE3) is recorded only without mixed chunks: start the "
            "server without --enable-mixed-chunk",
        ),
        (
            ONE_GPU,
            "DFLASH",
            (False, False),
            "speculative decoding with DFLASH is not supported; supported: EAGLE, EAGLE3, "
            "STANDALONE, NGRAM",
        ),
    ],
)
def test_setups_a_record_cannot_describe_are_refused(
    parallel: adapter.Parallelism,
    speculative: str | None,
    loop: tuple[bool, bool],
    message: str,
) -> None:
    overlap, mixed_chunk = loop
    with pytest.raises(adapter.UnsupportedSglangSetup) as refused:
        adapter.check_setup(parallel, speculative, overlap, mixed_chunk)
    assert str(refused.value) == message


def test_tensor_and_expert_parallelism_on_one_attention_rank_are_recorded() -> None:
    adapter.check_setup(adapter.Parallelism(8, 1, 8, 1, 3), None, True, True)


def test_data_parallel_attention_is_recorded() -> None:
    adapter.check_setup(adapter.Parallelism(8, 1, 8, 4, 0, attn_dp_rank=3), None, True, True)


@pytest.mark.parametrize("algorithm", adapter.SPECULATIVE_ALGORITHMS)
def test_speculative_decoding_in_the_normal_loop_is_recorded(algorithm: str) -> None:
    adapter.check_setup(ONE_GPU, algorithm, False)


def test_header_names_the_pool_and_what_the_server_reports(replica: ReplicaDescriptor) -> None:
    header = adapter.header_for(
        replica,
        ONE_GPU,
        None,
        "/models/Llama-3.1-8B-Instruct",
        "NVIDIA H100 80GB HBM3",
        "0.5.23",
        "550.54.15",
        16,
    )
    assert dataclasses.asdict(header) == {
        "pool": "chat-8b",
        "replica": "chat-8b-r0",
        "engine_name": "sglang",
        "engine_version": "0.5.23",
        "driver_version": "550.54.15",
        "model": "llama-3.1-8b-instruct",
        "gpu_type": "h100",
        "gpus_per_replica": 1,
        "kv_block_size": 16,
        "engine_model": "/models/Llama-3.1-8B-Instruct",
        "engine_device": "NVIDIA H100 80GB HBM3",
        "tp_size": 1,
        "ep_size": 1,
        "attn_dp_rank": 0,
        "attn_dp_size": 1,
    }


def test_a_data_parallel_attention_rank_records_its_own_stream_on_its_gpus(
    replica: ReplicaDescriptor, tmp_path: Path
) -> None:
    # DeepSeek-style: TP 8 with expert parallelism, 4 attention ranks of 2 GPUs each.
    pool_of_four_ranks = dataclasses.replace(replica, gpus_per_replica=8, data_parallel=4)
    header = adapter.header_for(
        pool_of_four_ranks,
        adapter.Parallelism(8, 1, 8, 4, 0, attn_dp_rank=2),
        None,
        "llama-3.1-8b-instruct",
        None,
        "0.5.23",
        "550.54.15",
        1,
    )
    assert (header.replica, header.gpus_per_replica) == ("chat-8b-r0.dp2", 2)
    assert (header.tp_size, header.ep_size, header.attn_dp_rank, header.attn_dp_size) == (
        8,
        8,
        2,
        4,
    )
    # Beside the replica's directory in the node's outbox, shipped under the stream's name.
    outbox = tmp_path / "outbox" / "chat-8b-r0"
    assert adapter.rank_outbox(outbox, "chat-8b-r0", header) == tmp_path / "outbox/chat-8b-r0.dp2"


def test_a_server_with_other_attention_ranks_than_its_pool_declares_is_refused(
    replica: ReplicaDescriptor,
) -> None:
    with pytest.raises(HookConfigError) as refused:
        adapter.header_for(
            replica,
            adapter.Parallelism(2, 1, 1, 2, 0, attn_dp_rank=1),
            None,
            "llama-3.1-8b-instruct",
            None,
            "0.5.23",
            "1",
            1,
        )
    assert str(refused.value) == (
        "replica 'chat-8b-r0' runs 2 attention data-parallel rank(s) but pool 'chat-8b' "
        "declares data_parallel=1"
    )


@pytest.mark.parametrize(
    ("parallel", "served", "device", "message"),
    [
        (
            adapter.Parallelism(2, 1, 1, 1, 0),
            None,
            None,
            "replica 'chat-8b-r0' runs on 2 GPUs (tp_size=2, pp_size=1) but pool 'chat-8b' "
            "declares gpus_per_replica=1",
        ),
        (
            ONE_GPU,
            "qwen",
            None,
            "replica 'chat-8b-r0' serves 'qwen' (model '/models/qwen3-8b') but pool "
            "'chat-8b' declares model 'llama-3.1-8b-instruct': serve it as "
            "--served-model-name llama-3.1-8b-instruct, or put the replica in the pool of "
            "the model it serves",
        ),
        (
            ONE_GPU,
            "llama-3.1-8b-instruct",
            "NVIDIA GH200 480GB",
            "replica 'chat-8b-r0' runs on 'NVIDIA GH200 480GB' but pool 'chat-8b' declares "
            "gpu_type 'h100': put the replica in the pool of its GPU",
        ),
    ],
)
def test_a_server_running_other_than_its_pool_declares_is_refused(
    replica: ReplicaDescriptor,
    parallel: adapter.Parallelism,
    served: str | None,
    device: str | None,
    message: str,
) -> None:
    with pytest.raises(HookConfigError) as refused:
        adapter.header_for(replica, parallel, served, "/models/qwen3-8b", device, "0.5.23", "1", 1)
    assert str(refused.value) == message


def test_tree_pages_held_by_several_requests_are_split_among_them() -> None:
    # Requests 0 and 1 share pages 3 and 4 (a prompt prefix); 1 and 2 share page 7; request 2
    # also holds two pages alone, request 3 only its own.
    shares = adapter.kv_page_shares(
        [np.array([3, 4]), np.array([3, 4, 7]), np.array([7]), np.array([], np.int64)],
        np.array([1.0, 0.0, 2.0, 5.0]),
        num_pages=8,
    )
    assert shares.tolist() == [2.0, 1.5, 2.5, 5.0]


def test_the_module_imports_without_sglang() -> None:
    probe = "import sys, pipeline.hook.sglang; print('sglang' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert result.stdout.strip() == "False"


def test_the_plugin_does_nothing_without_an_outbox(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEPLEDGER_OUTBOX", raising=False)
    monkeypatch.setitem(sys.modules, "sglang", None)  # importing it would raise
    adapter.register_plugin()


def test_the_plugin_replaces_sglangs_scheduler_with_the_recording_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tests.pipeline.hook.sglang_torchvision import declare_torchvision_operators

    declare_torchvision_operators()
    registry = pytest.importorskip(
        "sglang.srt.plugins.hook_registry",
        reason="SGLang is not installed (make test installs it beside the venv)",
    )
    from sglang.srt.managers import scheduler

    monkeypatch.setenv("STEPLEDGER_OUTBOX", str(tmp_path))
    monkeypatch.setattr(registry.HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(registry.HookRegistry, "_patched", set())
    original = scheduler.Scheduler
    try:
        adapter.register_plugin()
        registry.HookRegistry.apply_hooks()
        recording = scheduler.Scheduler
        assert recording.__name__ == "RecordingScheduler"
        assert recording.__mro__[1] is original
    finally:
        scheduler.Scheduler = original
