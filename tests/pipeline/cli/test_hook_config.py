"""`stepledger hook-config`: the replica descriptor an engine hook starts with."""

from __future__ import annotations

from click.testing import CliRunner

from pipeline.cli import main
from pipeline.hook.replica import ReplicaDescriptor, read_descriptor
from schemas.config import DEFAULT_POOLS_PATH


def hook_config(*args: str):
    return CliRunner().invoke(main, ["hook-config", *args])


def test_the_descriptor_holds_the_replicas_pool_as_the_pools_file_declares_it():
    # pipeline/data/pools.yaml: reason-dsv3 serves deepseek-v3 on 8 h200 per replica.
    result = hook_config("--replica", "reason-dsv3-r0")
    assert result.exit_code == 0, result.output
    assert result.output == (
        '{"pool":"reason-dsv3","replica":"reason-dsv3-r0","model":"deepseek-v3",'
        '"gpu_type":"h200","gpus_per_replica":8,"data_parallel":1}\n'
    )


def test_the_descriptor_written_to_a_file_reads_back(tmp_path):
    path = tmp_path / "chat-8b-r2.json"
    result = hook_config("--replica", "chat-8b-r2", "--out", str(path))
    assert (result.exit_code, result.output) == (0, "")
    assert read_descriptor(path) == ReplicaDescriptor(
        pool="chat-8b",
        replica="chat-8b-r2",
        model="llama-3.1-8b-instruct",
        gpu_type="h100",
        gpus_per_replica=1,
    )


def test_a_replica_in_no_pool_is_refused_by_name():
    result = hook_config("--replica", "chat-8b-r9")
    assert result.exit_code == 1
    assert result.output == f"Error: {DEFAULT_POOLS_PATH}: replica 'chat-8b-r9' is in no pool\n"


def test_an_invalid_pools_file_is_named_without_a_traceback(tmp_path):
    pools = tmp_path / "pools.yaml"
    pools.write_text("pools: [\n")
    result = hook_config("--replica", "chat-8b-r0", "--pools", str(pools))
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: {pools}:")
    assert "not valid YAML" in result.output
    assert "Traceback" not in result.output
