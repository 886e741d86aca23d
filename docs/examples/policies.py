"""Worked examples of every attribution policy on one tiny pool-hour.

Run from the repository root: `.venv/bin/python docs/examples/policies.py`. Each section
attributes the same two logged steps with `attribute_hour` under one policy change and prints
the request costs and ledger lines in nano-dollars; docs/attribution.md quotes the output.
"""

from __future__ import annotations

from datetime import UTC, datetime

import polars as pl

from pipeline.attribution.hour import attribute_hour
from pipeline.attribution.workmodel import Coefficients, FittedWeights, KernelWeights
from schemas.config import AlphaFromEvidence, Policies, Pool, Replica
from schemas.records import SLOT_COLUMNS

HOUR = datetime(2026, 11, 30, 5, tzinfo=UTC)
T0 = int(HOUR.timestamp()) * 1_000_000_000
MS = 1_000_000
SEED_COEFFICIENTS = Coefficients(c0_ms=12.0, a_ms=0.05, b_ms=0.00005)

# (request, new_tokens, context, kv_blocks, prompt, prefix_hit, drafted, accepted) per step.
STEP0 = [  # the seed's 50 ms step: one 512-token prefill chunk and three decodes
    ("A", 512, 0, 32.0, 512, 0, 0, 0),
    ("B", 1, 3800, 238.0, 3000, 0, 0, 0),
    ("C", 1, 1000, 63.0, 800, 0, 0, 0),
    ("D", 1, 100, 7.0, 90, 0, 0, 0),
]
STEP1 = [  # 40 ms: a prefix-cache hit, a speculative decode, a platform retry, a request without context
    ("E", 256, 1024, 80.0, 1280, 1024, 0, 0),
    ("F", 3, 500, 32.0, 400, 0, 2, 1),
    ("G", 1, 200, 13.0, 150, 0, 0, 0),
    ("U", 1, 300, 19.0, 250, 0, 0, 0),
]
HOLDERS1 = [("H", 100.0, "waiting"), ("S", 50.0, "swapped")]
CONTEXT = [  # request, tenant, feature, retry_cause
    ("A", "acme", "chat", None),
    ("B", "acme", "chat", None),
    ("C", "globex", "search", None),
    ("D", "globex", "search", None),
    ("E", "acme", "chat", None),
    ("F", "initech", "docs", None),
    ("G", "acme", "chat", "platform_timeout"),
    ("H", "globex", "search", None),
    ("S", "globex", "search", None),
]


def pool(**policies) -> Pool:
    return Pool(
        name="chat",
        model="llama-3.1-8b-instruct",
        gpu_type="h100",
        gpus_per_replica=1,
        kv_block_size=16,
        usd_per_gpu_hour=3.60,
        capacity_owner="platform",
        slo_owner="support",
        target_utilization=0.7,
        replicas=[Replica(id="r0", hostname="node", gpu_uuids=["GPU-0"])],
        policies=Policies(**policies),
    )


def log(
    step0_start_ns: int = T0, blocked: tuple[bool, bool] = (False, False)
) -> tuple[pl.DataFrame, ...]:
    """The two steps: step 0 from `step0_start_ns` for 50 ms, step 1 at T0 + 100 ms for 40 ms."""
    steps = pl.DataFrame(
        {
            "pool": ["chat", "chat"],
            "replica": ["r0", "r0"],
            "seq": [0, 1],
            "start_utc_ns": [step0_start_ns, T0 + 100 * MS],
            "end_utc_ns": [step0_start_ns + 50 * MS, T0 + 140 * MS],
            "admission_blocked": list(blocked),
        }
    )
    names = ("request_id", *SLOT_COLUMNS)
    rows = [(0, i, *slot) for i, slot in enumerate(STEP0)] + [
        (1, i, *slot) for i, slot in enumerate(STEP1)
    ]
    slots = pl.DataFrame(
        [dict(zip(("seq", "slot_index", *names), row, strict=True)) for row in rows]
    ).with_columns(pl.lit("r0").alias("replica"))
    holders = pl.DataFrame(
        {
            "replica": ["r0"] * 2,
            "seq": [1, 1],
            "holder_index": [0, 1],
            "request_id": [h[0] for h in HOLDERS1],
            "kv_blocks": [h[1] for h in HOLDERS1],
            "state": [h[2] for h in HOLDERS1],
        }
    )
    context = pl.DataFrame(
        [
            {
                "request_id": r,
                "tenant": t,
                "feature": f,
                "api_key_id": f"key-{t}",
                "retry_of": None if cause is None else "A-earlier",
                "retry_cause": cause,
            }
            for r, t, f, cause in CONTEXT
        ],
        schema={
            c: pl.String
            for c in ("request_id", "tenant", "feature", "api_key_id", "retry_of", "retry_cause")
        },
    )
    return steps, slots, holders, context


def show(title: str, the_pool: Pool, weights=None, **log_options) -> None:
    ledger = attribute_hour(
        HOUR, the_pool, *log(**log_options), weights or FittedWeights(SEED_COEFFICIENTS)
    )
    print(f"== {title} (alpha {ledger.alpha:g}, weights {ledger.weights_version})")
    costs = ledger.ledger.request_costs.select(
        "request_id",
        "tenant",
        "compute_nano",
        "kv_nano",
        "amount_nano",
        "new_tokens",
        "cached_tokens",
        "output_tokens",
    )
    print("request  tenant   compute_nano  kv_nano  amount_nano  new_tokens  cached  output")
    for r in costs.iter_rows(named=True):
        print(
            f"{r['request_id']:<8} {r['tenant'] or '-':<8} {r['compute_nano']:>12} {r['kv_nano']:>8} "
            f"{r['amount_nano']:>12} {r['new_tokens']:>11} {r['cached_tokens']:>7} {r['output_tokens']:>7}"
        )
    print("ledger line                                   amount_nano")
    for r in ledger.ledger.ledger_lines.sort("line_kind", "tenant", "feature").iter_rows(
        named=True
    ):
        print(
            f"{r['line_kind']:<14} {r['tenant'] + ' / ' + r['feature']:<30} {r['amount_nano']:>12}"
        )
    print(f"{'invoice':<45} {ledger.ledger.amount_nano:>12}\n")


def main() -> None:
    show("seed step, compute only, fixed cost per slot", pool(alpha=1.0, idle="capacity_owner"))
    show("fixed cost per token", pool(alpha=1.0, fixed_cost="per_token", idle="capacity_owner"))
    show("alpha 0.8: KV memory-time weighs 20 %", pool(alpha=0.8, idle="capacity_owner"))
    show(
        "alpha from evidence: step 1 waited on free blocks (1 of 2 steps)",
        pool(alpha=AlphaFromEvidence(min_alpha=0.5, max_alpha=1.0), idle="capacity_owner"),
        blocked=(False, True),
    )
    show(
        "kernel weights (llama-3.1-8b-instruct on 1x h100)",
        pool(alpha=1.0, idle="capacity_owner"),
        weights=KernelWeights.for_pool(pool()),
    )
    show(
        "step 0 starts 20 ms before the hour",
        pool(alpha=1.0, idle="capacity_owner"),
        step0_start_ns=T0 - 20 * MS,
    )
    show(
        "prefix cache: first writer pays",
        pool(alpha=0.8, prefix_cache="first_writer", idle="capacity_owner"),
    )
    show(
        "prefix cache: cache-read pricing at 10 %",
        pool(alpha=0.8, prefix_cache="cache_read", cache_read_fraction=0.1, idle="capacity_owner"),
    )
    show("idle spread by usage", pool(alpha=1.0, idle="spread"))
    show(
        "idle: spread_then_headroom (spread up to 30 % of the invoice, the rest headroom)",
        pool(alpha=1.0, idle="spread_then_headroom"),
    )
    show(
        "retries: the caller pays platform timeouts too",
        pool(alpha=1.0, idle="capacity_owner", platform_pays_platform_retries=False),
    )


if __name__ == "__main__":
    main()
