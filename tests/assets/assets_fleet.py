"""A small simulated fleet for the Dagster tests."""

from __future__ import annotations

from schemas.config import PoolsFile, load_pools

HOURS = 0.05  # three simulated minutes: enough traffic for every kind of ledger line


def small_pools() -> PoolsFile:
    """The default pools cut to two chat replicas, so a simulated hour takes seconds."""
    pools = load_pools()
    chat = pools.pool("chat-8b")
    return pools.model_copy(
        update={"pools": [chat.model_copy(update={"replicas": chat.replicas[:2]})]}
    )


# Reconciliation check -> whether Dagster labels it blocking: only the checks whose failure
# holds an hour back from the finance views.
BLOCKING_CHECKS = {
    "sequence": True,
    "time": True,
    "money": True,
    "plausibility": False,
    "unattributed": False,
    "calibration": False,
    "calibration_drift": False,
}
