"""One billing of a pool-hour at a time: the lock every billing of a pool-hour holds from its
first step to its last (ingestion, request context, attribution, ledger, reconciliation).

Each step's own transactions are safe side by side, but two billings of the same pool-hour
would both find no previous rows of it and both append: DuckLake's DELETE of a first
publication matches no row, so it meets no other transaction, and both inserts commit. With
the lock the second billing waits for the first to finish, then re-bills the hour exactly (the
same rows, replaced), so the ledger is the same whichever ran first; after `LOCK_WAIT_S` it
gives up with an error naming the pool, the hour and who holds it.

- PostgreSQL (`STEPLEDGER_POSTGRES`): a session-level advisory lock, on a connection of its own
  held for the whole billing, keyed by a stable 64-bit hash of the pool and hour. A billing
  process that dies (SIGKILL, lost node) loses its session and so its locks: nothing to clean.
- The embedded file: an exclusive `flock` on a file per pool-hour beside the state file, which
  the kernel releases when the process dies. The DuckDB file's own lock keeps one writer at a
  time, but only for a step: two billings would take turns step by step, each redoing the
  other's work, and the second would fail after DuckDB's wait with DuckDB's words.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import socket
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import IO

import psycopg2
import psycopg2.errors

from schemas.errors import StateError
from schemas.units import hour_key

# A backfill's run of a day of one pool holds its hours' locks for many minutes; a billing of
# one busy pool-hour for about a minute on a loaded machine. A second billing waits for it,
# bounded, so a stuck holder shows up as an error rather than a queue that never moves.
LOCK_WAIT_S = 900.0
# How often the embedded lock is tried again while another process holds it.
_RETRY_S = 0.05
# The advisory-lock connection's application_name: who holds a lock, as pg_stat_activity shows.
APPLICATION = "stepledger billing"


class PoolHourBusy(StateError):
    """Another billing of the pool-hour held its lock for longer than the wait allowed."""


def lock_key(pool: str, hour: datetime) -> int:
    """The pool-hour's advisory-lock key: the first 8 bytes of the sha256 of `pool|hour` as a
    signed 64-bit integer, the same in every process and release (Python's hash() is salted
    per process)."""
    digest = hashlib.sha256(f"{pool}|{hour_key(hour)}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def holder_name() -> str:
    """Who this process is, for the message of a billing that waits for it in vain."""
    return f"pid {os.getpid()} on {socket.gethostname()}"


def _busy(pool: str, hour: datetime, waited_s: float, holder: str) -> PoolHourBusy:
    return PoolHourBusy(
        f"pool {pool} hour {hour_key(hour)}: another billing of this pool-hour holds it "
        f"({holder}); waited {waited_s:g} s. It is re-billed exactly once that billing ends: "
        "run it again then, or stop that one"
    )


@contextlib.contextmanager
def pool_hour_locks(
    pool_hours: Sequence[tuple[str, datetime]],
    state_file: Path,
    postgres: str | None,
    wait_s: float = LOCK_WAIT_S,
) -> Iterator[None]:
    """Hold the lock of every (pool, hour) in `pool_hours` while the block runs: in PostgreSQL
    when `postgres` names the store, else beside the embedded `state_file`. Locks are taken in
    one order (pool, then hour) so that two backfills over overlapping hours cannot deadlock;
    each waits at most `wait_s` seconds, then raises PoolHourBusy."""
    ordered = sorted(set(pool_hours))
    if postgres:
        with _advisory_locks(ordered, postgres, wait_s):
            yield
    else:
        with _file_locks(ordered, state_file, wait_s):
            yield


@contextlib.contextmanager
def _advisory_locks(
    pool_hours: list[tuple[str, datetime]], postgres: str, wait_s: float
) -> Iterator[None]:
    con = psycopg2.connect(postgres, application_name=f"{APPLICATION} ({holder_name()})")
    try:
        # Autocommit: a session-level lock outlives transactions, and an idle-in-transaction
        # session would hold back the store's vacuum for the whole billing.
        con.autocommit = True
        with con.cursor() as cursor:
            # At least 1 ms: a lock_timeout of 0 would wait for ever.
            cursor.execute("SET lock_timeout = %s", [f"{max(1, int(wait_s * 1000))}ms"])
            for pool, hour in pool_hours:
                key = lock_key(pool, hour)
                try:
                    cursor.execute("SELECT pg_advisory_lock(%s)", [key])
                except psycopg2.errors.LockNotAvailable:
                    raise _busy(pool, hour, wait_s, _advisory_holder(cursor, key)) from None
        yield
    finally:
        # Closing the session releases its advisory locks.
        con.close()


def _advisory_holder(cursor: psycopg2.extensions.cursor, key: int) -> str:
    """The application_name of the session holding the advisory lock `key`, as PostgreSQL
    lists it (a bigint key is split into classid, its high 32 bits, and objid, its low 32)."""
    cursor.execute(
        "SELECT a.application_name, a.pid FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
        "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 "
        "AND l.classid::bigint = %s AND l.objid::bigint = %s",
        [(key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF],
    )
    row = cursor.fetchone()
    if row is None:
        return "a session that has since ended"
    return f"{row[0] or 'a session without application_name'}, server process {row[1]}"


def lock_dir(state_file: Path) -> Path:
    """Where the embedded store's pool-hour locks live: beside its state file."""
    return state_file.with_name(f"{state_file.name}.locks")


@contextlib.contextmanager
def _file_locks(
    pool_hours: list[tuple[str, datetime]], state_file: Path, wait_s: float
) -> Iterator[None]:
    directory = lock_dir(state_file)
    directory.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as held:
        for pool, hour in pool_hours:
            path = directory / f"{pool}@{hour_key(hour)}.lock"
            held.enter_context(_file_lock(path, pool, hour, wait_s))
        yield


@contextlib.contextmanager
def _file_lock(path: Path, pool: str, hour: datetime, wait_s: float) -> Iterator[None]:
    deadline = time.monotonic() + wait_s
    while True:
        # "a+": the file is created if missing, and its holder's name is read before truncating it.
        lock = path.open("a+")
        try:
            _wait_for_flock(lock, pool, hour, wait_s, deadline)
        except BaseException:
            lock.close()
            raise
        # The holder removes the file as it releases it (so that the directory does not keep a
        # file per pool-hour ever billed): a lock taken on a removed file is taken again.
        if _same_file(path, lock):
            break
        lock.close()
    try:
        _name_holder(lock)
        yield
    finally:
        path.unlink(missing_ok=True)
        lock.close()


def _name_holder(lock: IO[str]) -> None:
    """Write who holds the lock into its file, for the message of a billing that waits in vain.
    The lock itself is the flock, which takes no space: on a full disk the name is not written
    (a waiter then says "a process") and the billing goes on, to fail where the state cannot be
    written, naming the state file."""
    descriptor = lock.fileno()
    os.ftruncate(descriptor, 0)
    try:
        os.pwrite(descriptor, holder_name().encode(), 0)
    except OSError:
        os.ftruncate(descriptor, 0)


def _same_file(path: Path, lock: IO[str]) -> bool:
    try:
        return path.stat().st_ino == os.fstat(lock.fileno()).st_ino
    except FileNotFoundError:
        return False


def _wait_for_flock(
    lock: IO[str], pool: str, hour: datetime, wait_s: float, deadline: float
) -> None:
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                lock.seek(0)
                raise _busy(pool, hour, wait_s, lock.read().strip() or "a process") from None
        time.sleep(_RETRY_S)
