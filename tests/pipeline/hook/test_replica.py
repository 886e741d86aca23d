"""Reading the replica descriptor: every way it can be wrong is named with its file."""

from __future__ import annotations

import pytest

from pipeline.hook.replica import (
    EngineFacts,
    HookConfigError,
    ReplicaDescriptor,
    checked_header,
    driver_version,
    read_descriptor,
)

SUGGESTION = "; write it with `stepledger hook-config --replica REPLICA`"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (
            '{"pool":"chat-8b","replica":"r0","model":"m","gpus_per_replica":1}',
            "field gpu_type: required",
        ),
        (
            '{"pool":"chat-8b","replica":"r0","model":"m","gpu_type":"h100","gpus_per_replica":"1"}',
            "field gpus_per_replica: expected an integer in [1, 2147483647], got '1'",
        ),
        (
            '{"pool":"chat-8b","replica":"r0","model":"m","gpu_type":"h100","gpus_per_replica":0}',
            "field gpus_per_replica: expected an integer in [1, 2147483647], got 0",
        ),
        (
            '{"pool":"","replica":"r0","model":"m","gpu_type":"h100","gpus_per_replica":1}',
            "field pool: expected a non-empty string, got ''",
        ),
        (
            '{"pool":"p","replica":"r0","model":"m","gpu_type":"h100","gpus_per_replica":1,'
            '"hostname":"gpu-node-01"}',
            "field hostname: not a field of ReplicaDescriptor",
        ),
        ('["chat-8b-r0"]', "expected a JSON object, got list"),
        ("pool: chat-8b", "not JSON: Expecting value: line 1 column 1 (char 0)"),
    ],
    ids=["missing", "text-count", "zero-gpus", "empty-pool", "unknown", "array", "yaml"],
)
def test_a_bad_descriptor_is_named_with_its_file_and_field(tmp_path, text, reason):
    path = tmp_path / "replica.json"
    path.write_text(text)
    with pytest.raises(HookConfigError) as refused:
        read_descriptor(path)
    assert str(refused.value) == f"{path}: not a replica descriptor ({reason}){SUGGESTION}"


def test_a_missing_descriptor_names_the_variable_that_points_to_it(tmp_path):
    path = tmp_path / "absent.json"
    with pytest.raises(HookConfigError) as refused:
        read_descriptor(path)
    assert str(refused.value) == (
        f"{path}: cannot read the replica descriptor (STEPLEDGER_HOOK_CONFIG): "
        "No such file or directory"
    )


def test_a_descriptor_reads_back_as_written(tmp_path):
    descriptor = ReplicaDescriptor(
        pool="reason-dsv3",
        replica="reason-dsv3-r0",
        model="deepseek-v3",
        gpu_type="h200",
        gpus_per_replica=8,
    )
    path = tmp_path / "replica.json"
    path.write_bytes(descriptor.to_json())
    assert read_descriptor(path) == descriptor


def test_the_driver_version_comes_from_the_environment_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STEPLEDGER_DRIVER_VERSION", "550.54.15")
    assert driver_version() == "550.54.15"


def test_an_engine_without_attention_ranks_is_refused_for_a_pool_of_ranks():
    # vLLM reports no attention data-parallel ranks: a pool billing rank streams would never
    # receive them.
    pool_of_ranks = ReplicaDescriptor(
        pool="reason-dsv3",
        replica="reason-dsv3-r0",
        model="deepseek-v3",
        gpu_type="h200",
        gpus_per_replica=8,
        data_parallel=2,
    )
    engine = EngineFacts(
        engine_name="vllm",
        engine_version="0.34.0",
        driver_version="550.54.15",
        gpus=8,
        gpus_described="8 GPUs",
        served_model_name="deepseek-v3",
        model="deepseek-ai/DeepSeek-V3",
        device=None,
        kv_block_size=16,
    )
    with pytest.raises(HookConfigError) as refused:
        checked_header(pool_of_ranks, engine)
    assert str(refused.value) == (
        "replica 'reason-dsv3-r0' runs 1 attention data-parallel rank(s) but pool "
        "'reason-dsv3' declares data_parallel=2"
    )
