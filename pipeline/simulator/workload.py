"""Traffic for one pool: Poisson arrivals per tenant feature, routed to the pool's replicas.

Each feature of each tenant is an independent Poisson stream at its `requests_per_s`. A
request's prompt is the feature's shared system prompt followed by a log-normal number of
user tokens (`prompt_tokens` describes that user part); its output length is log-normal too.
The gateway routes every request to one of the pool's serving replicas uniformly at random,
which splits each stream into independent Poisson streams per replica.

A `retry_fraction` of requests are retries of the feature's previous request (same tenant
and API key), and a `platform_timeout_fraction` of retries were caused by the platform.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schemas.config import Feature, LengthDistribution, Pool, Tenant
from schemas.units import NS_PER_SECOND

RETRY_CAUSES = ("client_timeout", "platform_timeout")
# Time between the gateway receiving a request and the engine seeing it.
ROUTING_DELAY_NS = (500_000, 3_000_000)


@dataclass(frozen=True)
class PoolTraffic:
    """Every request of a pool over the simulated span, sorted by engine arrival time.

    Times are ns since the start of the span. `feature` indexes `feature_names`, whose
    tenants are `feature_tenants`; `retry_of` is the index of the retried request or -1.
    """

    request_ids: np.ndarray  # str
    received_ns: np.ndarray  # int64: at the gateway
    arrival_ns: np.ndarray  # int64: at the engine
    replica: np.ndarray  # int64 index into the pool's replicas
    feature: np.ndarray  # int64
    prompt_tokens: np.ndarray  # int64, system prompt included
    output_tokens: np.ndarray  # int64
    api_key: np.ndarray  # str
    retry_of: np.ndarray  # int64
    retry_cause: np.ndarray  # int8 index into RETRY_CAUSES, -1 when not a retry
    feature_names: tuple[str, ...]
    feature_tenants: tuple[str, ...]
    prefix_tokens: np.ndarray  # int64 per feature: system prompt tokens

    def __len__(self) -> int:
        return int(self.arrival_ns.shape[0])


def _lengths(rng: np.random.Generator, dist: LengthDistribution, n: int) -> np.ndarray:
    drawn = np.rint(dist.median * np.exp(dist.sigma * rng.standard_normal(n)))
    return np.clip(drawn, dist.min, dist.max).astype(np.int64)


def generate_pool_traffic(
    pool: Pool, span_ns: int, rng: np.random.Generator, *, serving_replicas: list[int]
) -> PoolTraffic:
    """Draw the pool's requests over [0, span_ns) and route them to `serving_replicas`.

    Requests whose prompt plus output would not fit the replica's KV blocks have their output
    shortened so they fit, as an engine's max_model_len would cap them.
    """
    workload = pool.workload
    tenants = workload.tenants if workload is not None and serving_replicas else []
    features = [(tenant, feature) for tenant in tenants for feature in tenant.features]
    # Only read when there are features, which come from the workload.
    retry_fraction = workload.retry_fraction if workload is not None else 0.0
    platform_timeout_fraction = workload.platform_timeout_fraction if workload is not None else 0.0
    parts = [
        _feature_requests(
            rng, index, tenant, feature, span_ns, retry_fraction, platform_timeout_fraction
        )
        for index, (tenant, feature) in enumerate(features)
    ]
    received, retry_global, columns = _concatenated(parts)
    n_total = received.shape[0]
    arrival = received + rng.integers(*ROUTING_DELAY_NS, n_total)
    replica = (
        np.asarray(serving_replicas, np.int64)[
            rng.integers(0, max(len(serving_replicas), 1), n_total)
        ]
        if n_total
        else np.zeros(0, np.int64)
    )

    capacity_tokens = pool.engine.total_kv_blocks * pool.kv_block_size
    prompt = np.minimum(columns["prompt"], capacity_tokens // 2)
    output = np.clip(np.minimum(columns["output"], capacity_tokens - prompt), 1, None)

    order = np.argsort(arrival, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(n_total)
    retry_of = np.where(retry_global >= 0, rank[np.maximum(retry_global, 0)], -1)[order]
    ids = np.array([f"req-{pool.name}-{i:07d}" for i in range(n_total)], dtype=object)
    return PoolTraffic(
        request_ids=ids,
        received_ns=received[order],
        arrival_ns=arrival[order],
        replica=replica[order],
        feature=columns["feature"][order],
        prompt_tokens=prompt[order],
        output_tokens=output[order],
        api_key=columns["key"][order],
        retry_of=retry_of,
        retry_cause=columns["cause"][order],
        feature_names=tuple(f.name for _, f in features),
        feature_tenants=tuple(t.name for t, _ in features),
        prefix_tokens=np.array([f.system_prompt_tokens for _, f in features], np.int64),
    )


def _feature_requests(
    rng: np.random.Generator,
    index: int,
    tenant: Tenant,
    feature: Feature,
    span_ns: int,
    retry_fraction: float,
    platform_timeout_fraction: float,
) -> dict[str, np.ndarray]:
    """One feature's requests over [0, span_ns), in the order they were received."""
    n = int(rng.poisson(feature.requests_per_s * span_ns / NS_PER_SECOND))
    received = np.sort(rng.integers(0, span_ns, n))
    user_tokens = _lengths(rng, feature.prompt_tokens, n)
    prompt = feature.system_prompt_tokens + user_tokens
    output = _lengths(rng, feature.output_tokens, n)
    keys = np.array(tenant.api_keys, dtype=object)[rng.integers(0, len(tenant.api_keys), n)]
    # A retry repeats the feature's previous request: same key, same lengths.
    is_retry = rng.random(n) < retry_fraction
    is_retry[:1] = False
    previous = np.arange(n) - 1
    keys[is_retry] = keys[previous[is_retry]]
    prompt[is_retry] = prompt[previous[is_retry]]
    output[is_retry] = output[previous[is_retry]]
    cause = np.where(is_retry, (rng.random(n) < platform_timeout_fraction).astype(np.int8), -1)
    return {
        "received": received,
        "prompt": prompt,
        "output": output,
        "key": keys,
        "feature": np.full(n, index, np.int64),
        "retry_local": np.where(is_retry, previous, -1),
        "cause": cause.astype(np.int8),
    }


def _concatenated(
    parts: list[dict[str, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Every feature's requests in one set of columns; retries point at global indices."""
    if not parts:
        empty = {
            "prompt": np.zeros(0, np.int64),
            "output": np.zeros(0, np.int64),
            "key": np.zeros(0, object),
            "feature": np.zeros(0, np.int64),
            "cause": np.zeros(0, np.int8),
        }
        return np.zeros(0, np.int64), np.zeros(0, np.int64), empty
    offsets = np.cumsum([0] + [p["received"].shape[0] for p in parts[:-1]])
    received = np.concatenate([p["received"] for p in parts])
    retry_global = np.concatenate(
        [
            np.where(p["retry_local"] >= 0, p["retry_local"] + offset, -1)
            for p, offset in zip(parts, offsets, strict=False)
        ]
    )
    columns = {
        k: np.concatenate([p[k] for p in parts])
        for k in ("prompt", "output", "key", "feature", "cause")
    }
    return received, retry_global, columns
