"""`stepledger ship`: the sidecar that moves an engine's closed segments from its local outbox to
the object store, each exactly once.

A segment is closed once the recorder has renamed it to `*.seg` (`pipeline.hook.recorder`); the
shipper reads only those, in its own process, so it never blocks or slows the engine. For each
one, oldest first: its sequence range and sha256 make its key (`pipeline.ship.store`); the
object is put unless the store already holds one of its size, read back and hashed, and only
then is the local file deleted. The outbox is the shipper's only state: killed at any point,
a restarted shipper finds the segment still there and either puts it again (the same key and
bytes: one object) or, finding it on the store and verified, deletes it. A store that fails is
retried with exponential backoff and full jitter, and the segments wait in the outbox; when
they outgrow the outbox's budget, on-call is paged through the alert sink.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from pipeline.ingestion.decoder import read_segments
from pipeline.ingestion.ingest import segment_files
from pipeline.reconcile.alerts import Alert, AlertSink, dedup_key
from pipeline.ship.store import SegmentObject, SegmentStore, StoreUnavailable, sha256_hex
from schemas.errors import DataError
from schemas.units import hour_at

log = logging.getLogger(__name__)

# Backoff after a failed pass: FIRST_RETRY_S, doubling per failure up to LAST_RETRY_S, each wait
# drawn uniformly below that bound ("full jitter"), so shippers of many nodes that lost the
# store together do not return together.
FIRST_RETRY_S = 0.5
LAST_RETRY_S = 60.0
ALERT_KIND = "ship"
OVER_BUDGET = "outbox_over_budget"


class UploadNotVerified(DataError, RuntimeError):
    """The object read back from the store is not the segment put there."""


def segment_object(path: Path, data: bytes) -> SegmentObject:
    """The store's object for the segment file at `path` (in `outbox/<replica>/`) holding
    `data`: its last sequence number is the decoder's (its first, for a segment without a
    step; the name's, for one whose header cannot be read)."""
    decoded = read_segments([path]).segments
    known = [
        s
        for s in decoded["last_seq"].to_pylist() + decoded["first_seq"].to_pylist()
        if s is not None
    ]
    if known:
        last = max(known)
    else:
        first = path.name.removesuffix(".seg").rsplit(".", 2)
        if len(first) != 3 or not first[1].isdigit():
            raise DataError(
                f"{path}: neither its header nor its name gives a sequence number, so it has "
                "no key on the store; it stays in the outbox (inspect it with `stepledger inspect`)"
            )
        last = int(first[1])
    return SegmentObject(path.parent.name, path.name, last, sha256_hex(data), len(data))


def ship_segment(store: SegmentStore, path: Path) -> SegmentObject:
    """Put the segment at `path` on the store unless it is there already, verify the object
    byte for byte, then delete the local file."""
    data = path.read_bytes()
    segment = segment_object(path, data)

    def stored() -> bool:
        return sha256_hex(store.get(segment.key)) == segment.sha256

    # Put by an earlier pass that was killed before it deleted the file: not put twice.
    if store.size_of(segment.key) == len(data) and stored():
        path.unlink()
        return segment
    store.put(segment.key, data)
    if not stored():
        raise UploadNotVerified(
            f"{store.uri}/{segment.key}: the object read back differs from {path}; the "
            "segment stays in the outbox and is put again"
        )
    path.unlink()
    return segment


@dataclass
class ShipReport:
    """What one pass over the outbox did."""

    shipped: list[SegmentObject] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # one line per segment left, saying why


def ship_pending(store: SegmentStore, outbox: Path) -> ShipReport:
    """Ship every closed segment in `outbox/<replica>/`, oldest first per replica. A store
    that cannot be reached ends the pass (the next one retries); a segment that cannot be
    shipped is reported and left in place, and the others go on."""
    report = ShipReport()
    for path in segment_files(outbox):
        try:
            report.shipped.append(ship_segment(store, path))
        except StoreUnavailable:
            raise
        except (DataError, OSError) as err:
            report.failed.append(f"{path}: {err}")
            log.error("cannot ship %s: %s", path, err)
    return report


def outbox_bytes(outbox: Path) -> int:
    """Bytes of every file under the outbox, closed segments and open ones alike."""
    return sum(p.stat().st_size for p in outbox.rglob("*") if p.is_file())


def budget_alert(outbox: Path, pool: str, size: int, budget: int, now: datetime) -> Alert:
    """The page for an outbox holding `size` bytes, past its `budget`: once per hour."""
    hour = hour_at((now - hour_at(0)) // timedelta(hours=1))
    return Alert(
        raised_at=now,
        severity="ERROR",
        kind=ALERT_KIND,
        hour=hour,
        pool=pool,
        replica=None,
        finding=OVER_BUDGET,
        detail=(
            f"outbox {outbox} holds {size:,} bytes, over its budget of {budget:,}: segments are "
            "not reaching the object store (check the shipper's log and the store); the engine "
            "keeps recording until the disk fills"
        ),
        dedup_key=dedup_key(ALERT_KIND, hour, pool, None, OVER_BUDGET),
    )


@dataclass
class Shipper:
    """The loop of `stepledger ship`: a pass every `interval_s`, backoff after failures, and a
    page when the outbox outgrows `budget_bytes`."""

    store: SegmentStore
    outbox: Path
    pool: str
    budget_bytes: int
    sink: AlertSink
    interval_s: float = 5.0
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    rng: random.Random = field(default_factory=random.Random)
    failures: int = 0
    paged: set[str] = field(default_factory=set)

    def retry_delay(self) -> float:
        """How long to wait after the `failures`-th failure in a row (full jitter)."""
        bound = min(LAST_RETRY_S, FIRST_RETRY_S * 2 ** (self.failures - 1))
        return self.rng.uniform(0, bound)

    def step(self) -> float:
        """One pass: ship what is closed, check the budget; returns the wait before the next."""
        try:
            report = ship_pending(self.store, self.outbox)
        except StoreUnavailable as err:
            self.failures += 1
            delay = self.retry_delay()
            log.warning("%s; retrying in %.1f s (failure %d)", err, delay, self.failures)
        else:
            self.failures = 0
            delay = self.interval_s
            for segment in report.shipped:
                log.info("shipped %s (%d bytes)", segment.key, segment.size)
        self.check_budget()
        return delay

    def check_budget(self) -> Alert | None:
        size = outbox_bytes(self.outbox)
        if size <= self.budget_bytes:
            return None
        alert = budget_alert(self.outbox, self.pool, size, self.budget_bytes, self.clock())
        if alert.dedup_key in self.paged:
            return None
        log.error("%s", alert.detail)
        try:
            self.sink.send(alert)
        except Exception as err:
            # The page is tried again on the next pass; the shipper itself goes on shipping.
            log.error("cannot page on-call about the outbox budget: %s", err)
            return None
        self.paged.add(alert.dedup_key)
        return alert

    def run(self, stop: threading.Event) -> None:
        """Pass after pass until `stop` is set (by SIGTERM or SIGINT in `stepledger ship`)."""
        while not stop.is_set():
            stop.wait(self.step())
