"""A pool served by SGLang (`engine: {name: sglang}`) is simulated with SGLang's name in its
segment headers and billed through the same pool-hour job as a vLLM pool."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import polars as pl

from pipeline.ingestion.decoder import read_segments
from schemas.config import PoolsFile
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
