"""SIGTERM stops `stepledger run` after the pool-hour in flight: that one is interrupted and
rolled back, no later one is started, and the command exits non-zero naming which were done
and which were not."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.simulator import simulate
from pipeline.warehouse import STATE_FILE, connect_read_only
from schemas.config import PoolsFile, load_pools
from tests.helpers.hours import SIMULATED_HOUR

pytestmark = pytest.mark.timeout(300)

STEPLEDGER = str(Path(sys.executable).parent / "stepledger")
HOUR = "2026-11-30T00"


def three_pools() -> PoolsFile:
    """Three pools of one replica each: three pool-hours in one hour."""
    pools = load_pools()
    chat = pools.pool("chat-8b")
    return pools.model_copy(
        update={
            "pools": [
                chat.model_copy(
                    update={
                        "name": f"p{i}",
                        "replicas": [chat.replicas[i].model_copy(update={"id": f"p{i}-r0"})],
                    }
                )
                for i in range(3)
            ]
        }
    )


def test_sigterm_stops_the_run_after_the_pool_hour_in_flight(tmp_path: Path) -> None:
    data = tmp_path / "fleet"
    simulate(data, three_pools(), hours=0.02, seed=7, start=SIMULATED_HOUR)
    process = subprocess.Popen(
        [STEPLEDGER, "run", "--data", str(data)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    # The line of a pool-hour is printed once it is done and paged; the next one starts then.
    first = process.stdout.readline()
    assert first.startswith(f"{HOUR} p0: published"), first
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=240)
    assert process.returncode == 1, (out, err)
    message = " ".join(err.split())
    assert message.startswith(f"Error: stopped by SIGTERM: 1 pool-hour(s) done ({HOUR} p0); ")
    assert message.endswith("; run those hours again to bill them")
    # The signal lands while p1 runs (interrupted) or just before it starts; p2 never starts.
    interrupted = f"interrupted and rolled back: {HOUR} p1; not started: 1 ({HOUR} p2)"
    before_p1 = f"not started: 2 ({HOUR} p1, {HOUR} p2)"
    assert interrupted in message or before_p1 in message, message
    if interrupted in message:
        assert f"{HOUR} p1: failed: interrupted by SIGTERM" in " ".join(out.split())
    with connect_read_only(data / STATE_FILE) as con:
        invoiced = {pool for (pool,) in con.execute("SELECT pool FROM invoices").fetchall()}
        published = {pool for (pool,) in con.execute("SELECT pool FROM published_hours").fetchall()}
    assert "p2" not in invoiced
    assert published == {"p0"}
