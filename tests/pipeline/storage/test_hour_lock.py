"""The pool-hour lock: held by one billing at a time, on a real PostgreSQL server (advisory
locks) and on the embedded store (a file lock); a second billing that waits in vain is told
the pool, the hour and who holds it; a holder that dies releases it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from pipeline.storage.hour_lock import (
    APPLICATION,
    PoolHourBusy,
    lock_dir,
    lock_key,
    pool_hour_locks,
)
from tests.helpers.postgres_server import PostgresServer, postgres_or_skip

HOUR = datetime(2026, 11, 30, 5, tzinfo=UTC)
REPOSITORY = Path(__file__).resolve().parents[3]
# A process that takes a pool-hour's lock, says so, and holds it until it is killed.
HOLD_UNTIL_KILLED = """
import sys, threading
from datetime import UTC, datetime
from pathlib import Path
from pipeline.storage.hour_lock import pool_hour_locks
postgres = sys.argv[2] or None
with pool_hour_locks([("chat-8b", datetime(2026, 11, 30, 5, tzinfo=UTC))], Path(sys.argv[1]), postgres):
    print("held", flush=True)
    threading.Event().wait()
"""


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with postgres_or_skip() as server:
        yield server


@pytest.fixture(params=["embedded", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, str | None]:
    """The state file and the PostgreSQL store (None: embedded) a lock is taken in."""
    if request.param == "embedded":
        return tmp_path / "pipeline.duckdb", None
    server: PostgresServer = request.getfixturevalue("postgres")
    return tmp_path / "pipeline.duckdb", server.dsn()


def test_the_key_is_a_stable_signed_64_bit_hash_of_pool_and_hour() -> None:
    assert lock_key("chat-8b", HOUR) == 5265324575191310248
    assert lock_key("chat-8b", HOUR) != lock_key("chat-8b-eu", HOUR)
    assert lock_key("chat-8b", HOUR) != lock_key("chat-8b", HOUR.replace(hour=6))
    assert -(2**63) <= lock_key("reason-dsv3", HOUR) < 2**63


def test_a_second_billing_of_the_pool_hour_waits_in_vain_and_is_told_who_holds_it(
    store: tuple[Path, str | None],
) -> None:
    state_file, postgres = store
    with pool_hour_locks([("chat-8b", HOUR)], state_file, postgres):
        # Other pool-hours are not held: another hour of the pool, the hour of another pool.
        with pool_hour_locks(
            [("chat-8b", HOUR.replace(hour=6)), ("chat-8b-eu", HOUR)], state_file, postgres, 0
        ):
            pass
        with (
            pytest.raises(PoolHourBusy) as busy,
            pool_hour_locks([("chat-8b", HOUR)], state_file, postgres, wait_s=0.2),
        ):
            pytest.fail("two billings of one pool-hour held its lock at once")
    message = str(busy.value)
    assert message.startswith(
        "pool chat-8b hour 2026-11-30T05: another billing of this pool-hour holds it ("
    )
    assert f"pid {os.getpid()} on " in message
    assert "waited 0.2 s" in message
    if postgres:
        assert f"{APPLICATION} (pid " in message
        assert ", server process " in message
    # Released on exit: taken again at once. The embedded store's lock files go with the locks.
    with pool_hour_locks([("chat-8b", HOUR)], state_file, postgres, wait_s=0):
        pass
    assert postgres or list(lock_dir(state_file).iterdir()) == []


def test_a_holder_killed_with_sigkill_releases_the_lock(store: tuple[Path, str | None]) -> None:
    state_file, postgres = store
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_UNTIL_KILLED, str(state_file), postgres or ""],
        env={"PYTHONPATH": str(REPOSITORY), "PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "held\n"
        with (
            pytest.raises(PoolHourBusy),
            pool_hour_locks([("chat-8b", HOUR)], state_file, postgres, wait_s=0),
        ):
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate()
    # PostgreSQL ends the killed client's session when its socket closes: waited for, bounded.
    with pool_hour_locks([("chat-8b", HOUR)], state_file, postgres, wait_s=60):
        pass
