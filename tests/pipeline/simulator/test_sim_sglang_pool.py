"""A pool served by SGLang (`engine: {name: sglang}`) is simulated with SGLang's name in its
segment headers and billed through the same pool-hour job as a vLLM pool."""

from __future__ import annotations

import shutil
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from pipeline.ingestion.decoder import read_segments
from schemas.config import PoolsFile, load_pools
from tests.helpers.fleets import bill, costs, simulate_small, small_pools


def sglang_pools() -> PoolsFile:
    pools = small_pools()
    chat = pools.pool("chat-8b")
    served_by_sglang = chat.model_copy(
        update={"engine": chat.engine.model_copy(update={"name": "sglang"})}
    )
    return pools.model_copy(update={"pools": [served_by_sglang]})


def test_a_pool_served_by_sglang_is_billed_through_the_pool_hour_job(tmp_path: Path) -> None:
    pools = sglang_pools()
    data = simulate_small(tmp_path / "run", pools)
    segments = pl.DataFrame(read_segments(sorted((data / "outbox").rglob("*.seg"))).segments)
    assert segments["engine_name"].unique().to_list() == ["sglang"]

    (result,) = bill(data, pools, dg.DagsterInstance.ephemeral())
    assert result.success
    published = costs(data)["published"]
    tenants = {tenant for tenant, _, _, _ in published}
    workload = pools.pool("chat-8b").workload
    assert workload is not None
    assert tenants >= {tenant.name for tenant in workload.tenants}
    assert sum(amount for _, _, _, amount in published) > 0


def data_parallel_attention_pools() -> PoolsFile:
    """DeepSeek-V3 on SGLang with data-parallel attention: each 8-GPU replica is two attention
    ranks of 4 GPUs feeding one expert-parallel MoE group."""
    pools = load_pools()
    dsv3 = pools.pool("reason-dsv3")
    served = dsv3.model_copy(
        update={
            "engine": dsv3.engine.model_copy(update={"name": "sglang"}),
            "data_parallel": 2,
            "expert_parallel": True,
        }
    )
    return pools.model_copy(update={"pools": [served]})


@pytest.fixture(scope="module")
def data_parallel_attention_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return simulate_small(tmp_path_factory.mktemp("dp") / "run", data_parallel_attention_pools())


def test_each_attention_rank_is_billed_on_its_own_gpus_and_the_money_is_conserved(
    data_parallel_attention_run: Path, tmp_path: Path
) -> None:
    pools = data_parallel_attention_pools()
    data = shutil.copytree(data_parallel_attention_run, tmp_path / "run")
    segments = pl.DataFrame(read_segments(sorted((data / "outbox").rglob("*.seg"))).segments)
    assert sorted(set(zip(segments["replica"], segments["gpus_per_replica"], strict=True))) == [
        ("reason-dsv3-r0.dp0", 4),
        ("reason-dsv3-r0.dp1", 4),
    ]

    (result,) = bill(data, pools, dg.DagsterInstance.ephemeral())
    assert result.success
    billed = costs(data)
    assert billed["held_back"] == []
    # The replica's 8 GPUs for the hour, at 4.50 USD each, to the nano-dollar.
    assert sum(amount for _, _, _, amount in billed["published"]) == 8 * 4_500_000_000
    workload = pools.pool("reason-dsv3").workload
    assert workload is not None
    assert {tenant for tenant, _, _, _ in billed["published"]} >= {
        tenant.name for tenant in workload.tenants
    }


def test_a_missing_attention_rank_stream_holds_the_hour_rather_than_billing_it_idle(
    data_parallel_attention_run: Path, tmp_path: Path
) -> None:
    pools = data_parallel_attention_pools()
    data = shutil.copytree(data_parallel_attention_run, tmp_path / "run")
    # Rank 1 worked (DCGM saw its GPUs busy) but none of its segments arrived.
    shutil.rmtree(data / "outbox" / "reason-dsv3-r0.dp1")

    bill(data, pools, dg.DagsterInstance.ephemeral())
    billed = costs(data)
    assert billed["published"] == []
    # Rank 1's GPUs busy without its stream: the silence check holds the pool-hour back.
    assert billed["held_back"] == [("reason-dsv3", "failed blocking checks: silence")]


def test_an_attention_rank_without_requests_is_idle_on_its_own_gpus(tmp_path: Path) -> None:
    pools = data_parallel_attention_pools()
    # The replica's last rank gets no traffic: its stream logs nothing and DCGM sees its
    # GPUs idle.
    data = simulate_small(tmp_path / "run", pools, faults={"idle-replica": None})
    outbox = data / "outbox"
    assert not list((outbox / "reason-dsv3-r0.dp1").glob("*.seg"))

    (result,) = bill(data, pools, dg.DagsterInstance.ephemeral())
    assert result.success
    billed = costs(data)
    assert billed["held_back"] == []
    published = billed["published"]
    assert sum(amount for _, _, _, amount in published) == 8 * 4_500_000_000
    # At least the idle rank's 4 GPU-hours are idle, to the pool's capacity owner.
    idle = sum(amount for _, _, kind, amount in published if kind == "idle")
    assert idle >= 4 * 4_500_000_000
