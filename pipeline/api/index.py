"""Recent request costs held in memory, so a lookup answers without a warehouse query.

A query on the DuckLake reads its catalog first (milliseconds per table), which a gateway
asking for every request's cost cannot wait for. The index reloads the latest hours' request
costs (final and provisional, by `pipeline.finance.spend.recent_request_hours`) on its own
finance connection whenever the warehouse has a new snapshot, from that one snapshot with its
published files verified (`SnapshotReader`), and swaps them in whole; a request it does not
hold is looked up in the warehouse, as is every request while a reload fails.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import duckdb

import pipeline.finance
from pipeline.finance.spend import assemble_request_cost, recent_request_hours
from pipeline.storage.warehouse import WarehouseError, current_snapshot

log = logging.getLogger(__name__)

# The latest hours held: today's and yesterday's requests, what a gateway asks about.
INDEX_HOURS = 48
REFRESH_SECONDS = 0.5


class RequestIndex:
    """The recent request-hours of a data directory's warehouse, by request id."""

    def __init__(
        self, data_dir: Path, *, hours: int = INDEX_HOURS, refresh_s: float = REFRESH_SECONDS
    ) -> None:
        self._reader = pipeline.finance.snapshot_reader(data_dir)
        self._hours = hours
        self._refresh_s = refresh_s
        self._snapshot: int | None = None
        self._by_request: dict[str, list[dict[str, Any]]] = {}
        self._stop = threading.Event()
        self._reloading = threading.Lock()
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="request-index", daemon=True)
        self._thread.start()

    def refresh(self) -> bool:
        """Reload when the warehouse has a snapshot the index has not read; True if it did."""
        # A DuckDB connection runs one query at a time: the reloading thread's or a caller's.
        with self._reloading:
            if current_snapshot(self._reader.con) == self._snapshot:
                return False
            try:
                snapshot, by_request = self._reader.read(
                    lambda con: recent_request_hours(con, self._hours)
                )
            except Exception:
                # What the index held is no longer the latest: lookups go to the warehouse,
                # which answers from the latest snapshot or refuses as it does.
                self._by_request, self._snapshot = {}, None
                raise
            self._by_request, self._snapshot = by_request, snapshot
            return True

    def _run(self) -> None:
        while not self._stop.wait(self._refresh_s):
            try:
                self.refresh()
            except (duckdb.Error, WarehouseError):
                log.exception("reloading the request index failed; lookups read the warehouse")

    def find(self, request_id: str, tenant: str | None) -> tuple[bool, dict[str, Any] | None]:
        """Whether the index holds the request, and its cost if so (for `tenant`, only that
        tenant's): a request held but not found is not in the warehouse's recent hours."""
        hours = self._by_request.get(request_id)
        if hours is None:
            return False, None
        if tenant is not None:
            hours = [h for h in hours if h["tenant"] == tenant]
        return True, assemble_request_cost(request_id, hours) if hours else None

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._reader.close()
