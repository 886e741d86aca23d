"""A two-hour, one-replica fleet with hand-checkable costs, billed through the real pipeline.

Hour 05: 1 800 one-second steps, each a 1 s gap apart, every step decoding one token for
request `req-acme` (acme-support / support-bot) and one for `req-globex` (globex-search /
query-rewrite), identical in tokens, context and blocks. At $3.60 per GPU-hour a 1 s step costs
$0.001, so each request is charged exactly $0.900000 and the capacity owner's idle line is the
other $1.800000. Hour 06: the same traffic for `req-acme-2`, but the recorder drops one step,
so the sequence check fails and the hour is held back from finance.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import yaml

from pipeline.attribution.attribute import attribute_pool_hour, gather_inputs
from pipeline.attribution.weights import weight_source
from pipeline.datadir import DataDir
from pipeline.ingestion import gateway
from pipeline.ingestion.ingest import ingest_outbox
from pipeline.reconcile import reconcile_hour
from pipeline.storage.lake import save_ledger
from pipeline.storage.publish import publish_hour
from pipeline.storage.warehouse import connect
from schemas.config import load_pools
from tests.helpers.hours import HOUR
from tests.helpers.warehouse_fleet import NS, write_gateway, write_replica_log

NEXT_HOUR = HOUR + timedelta(hours=1)
STEPS_PER_HOUR = 1800
POOL = {
    "name": "chat-test",
    "model": "llama-3.1-8b-instruct",
    "gpu_type": "h100",
    "gpus_per_replica": 1,
    "kv_block_size": 16,
    "usd_per_gpu_hour": 3.60,
    "capacity_owner": "platform-inference",
    "slo_owner": "support-bot",
    "target_utilization": 0.7,
    "replicas": [
        {
            "id": "chat-test-r0",
            "hostname": "gpu-node-01",
            "gpu_uuids": ["GPU-5f1c2a10-0000-4000-8000-000000000001"],
        }
    ],
    "policies": {
        "weights": "kernel",
        "fixed_cost": "per_slot",
        "alpha": 0.8,
        "prefix_cache": "split_by_holders",
        "idle": "capacity_owner",
    },
}
CONTEXT = [
    ("req-acme", "acme-support", "support-bot", HOUR),
    ("req-globex", "globex-search", "query-rewrite", HOUR),
    ("req-acme-2", "acme-support", "support-bot", NEXT_HOUR),
]


def build_fleet(root: Path) -> Path:
    """Simulate, ingest, attribute, publish and reconcile both hours; returns the data directory."""
    (root / "pools.yaml").write_text(yaml.safe_dump({"pools": [POOL]}))
    pools = load_pools(root / "pools.yaml")
    pool = pools.pools[0]
    replica = pool.replicas[0].id
    # One step log over both hours: the second continues the first's sequence and clock.
    for hour, requests, first_seq, drop_at in (
        (HOUR, ["req-acme", "req-globex"], 0, None),
        (NEXT_HOUR, ["req-acme-2"], STEPS_PER_HOUR, STEPS_PER_HOUR // 2),
    ):
        write_replica_log(
            root / "outbox",
            pool,
            replica,
            start=hour,
            steps=STEPS_PER_HOUR,
            step_ns=NS,
            gap_ns=NS,
            requests=requests,
            rotate_seconds=1200.0,
            first_seq=first_seq,
            mono_start_ns=10 * NS + int((hour - HOUR).total_seconds()) * NS,
            prompt_tokens=500,
            kv_blocks=32.0,
            drop_at=drop_at,
        )
    gateway_dir = root / "gateway"
    for hour in (HOUR, NEXT_HOUR):
        write_gateway(
            gateway_dir, hour, [(r, t, f, f"sk-{t}") for r, t, f, h in CONTEXT if h == hour]
        )

    lake = root / "lake"
    with connect(root / "warehouse.duckdb") as con:
        ingest_outbox(con, root / "outbox", lake)
        for hour in (HOUR, NEXT_HOUR):
            gateway.load_gateway_files(
                con, gateway.gateway_files_for_hour(gateway_dir, hour), gateway.key_salt()
            )
            inputs = gather_inputs(con, lake, pool, hour)
            weights = weight_source(pool, inputs.engine, DataDir(root).calibration_file)
            ledger = attribute_pool_hour(lake, pool, inputs, weights).ledger
            save_ledger(lake, ledger)
            publish_hour(con, ledger)
            reconcile_hour(con, lake, root / "dcgm", pool, hour, pools.settings)
    return root
