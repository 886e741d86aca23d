"""The live path: price every newly closed segment, publish provisional figures, exactly once.

A cycle lists the closed segments (`*.seg`) of the data directory's outbox that
`live_segments` does not name, decodes them, joins the gateway context there is, prices them
(`pipeline.live.price`) and commits, in one warehouse transaction, their provisional figures
together with the segments they came from. A cycle that fails or is killed commits nothing,
so the next one (after a restart too) prices the same segments once; a segment committed is
never priced again. The live path only reads the outbox and gateway files: the hourly
ingestion finds them as they were.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa

from pipeline.attribution.weights import weight_source
from pipeline.datadir import DataDir
from pipeline.ingestion.decoder import read_segments
from pipeline.ingestion.gateway import (
    CONTEXT_COLUMNS,
    gateway_files_for_hour,
    key_salt,
    read_gateway_file,
)
from pipeline.ingestion.ingest import segment_files
from pipeline.live.price import ProvisionalPrices, hours_touched, price_steps
from pipeline.storage import warehouse
from schemas.config import PoolsFile
from schemas.errors import DataError
from schemas.units import warehouse_now

log = logging.getLogger(__name__)

# How often the service looks for closed segments: with the recorder's 15 s rotation a
# request's cost is readable within about 20 s of its last step.
DEFAULT_INTERVAL_S = 5.0


class UnknownPoolSegment(DataError):
    """A segment names a pool the pools file does not have."""


@dataclass(frozen=True)
class CycleReport:
    """What one cycle priced: segments, steps, request rows, money and hours."""

    batch_id: str
    segments: int
    steps: int
    requests: int
    amount_nano: int
    hours: list[datetime]


@dataclass
class _GatewayCache:
    """Gateway files read so far, by path, with the size they had: a file is read again only
    when it grew or changed."""

    frames: dict[Path, tuple[int, int, pl.DataFrame]] = field(default_factory=dict)

    def context(self, gateway_dir: Path, hours: list[datetime], salt: bytes) -> pl.DataFrame:
        paths = sorted({p for hour in hours for p in gateway_files_for_hour(gateway_dir, hour)})
        frames = []
        for path in paths:
            stat = path.stat()
            known = self.frames.get(path)
            if known is None or known[:2] != (stat.st_size, stat.st_mtime_ns):
                known = (stat.st_size, stat.st_mtime_ns, read_gateway_file(path, salt))
                self.frames[path] = known
            frames.append(known[2].select(CONTEXT_COLUMNS))
        if not frames:
            return pl.DataFrame(schema={c: pl.String for c in CONTEXT_COLUMNS})
        return pl.concat(frames).unique("request_id", keep="first", maintain_order=True)


@dataclass
class LivePricer:
    """Prices a data directory's new segments into its warehouse, one cycle at a time."""

    data_dir: Path
    pools: PoolsFile
    salt: bytes = field(default_factory=key_salt)
    _gateway: _GatewayCache = field(default_factory=_GatewayCache)

    @property
    def layout(self) -> DataDir:
        return DataDir(self.data_dir)

    def open_warehouse(self) -> duckdb.DuckDBPyConnection:
        """The warehouse writer, the warehouse created first if this data directory has none."""
        directory = self.layout.warehouse
        if not (directory / warehouse.CATALOG_FILE).is_file():
            with warehouse.connect(self.layout.state_file):
                pass
        con = warehouse.ledger_writer(directory)
        con.execute(warehouse.SCHEMA_SQL.read_text())
        return con

    def new_segments(self, con: duckdb.DuckDBPyConnection) -> list[Path]:
        """Closed segments of the outbox not priced yet, by their path in the data directory."""
        priced = {row[0] for row in con.execute("SELECT path FROM live_segments").fetchall()}
        return [path for path in segment_files(self.layout.outbox) if self._key(path) not in priced]

    def _key(self, path: Path) -> str:
        return path.relative_to(self.data_dir).as_posix()

    def cycle(self, con: duckdb.DuckDBPyConnection) -> CycleReport | None:
        """Price the new segments and commit them with their figures; None when there were none."""
        paths = self.new_segments(con)
        if not paths:
            return None
        decoded = read_segments(paths)
        segments = pl.from_arrow(decoded.segments)
        assert isinstance(segments, pl.DataFrame)
        known_ids = {
            row[0]
            for row in con.execute(
                "SELECT segment_id FROM live_segments WHERE list_contains(?, segment_id)",
                [segments["segment_id"].to_list()],
            ).fetchall()
        }
        # The same segment delivered again under another name is priced once.
        steps = _frame(decoded.steps).filter(~pl.col("segment_id").is_in(known_ids))
        keys = steps.select("replica", "seq")
        slots, holders = (
            _frame(table).join(keys, on=["replica", "seq"], how="semi")
            for table in (decoded.slots, decoded.holders)
        )
        prices = self._price(segments, steps, slots, holders)
        batch_id = uuid.uuid4().hex
        self._commit(con, batch_id, paths, segments, prices)
        return CycleReport(
            batch_id=batch_id,
            segments=len(paths),
            steps=steps.height,
            requests=prices.request_costs.height,
            amount_nano=prices.amount_nano,
            hours=hours_touched(steps),
        )

    def _price(
        self,
        segments: pl.DataFrame,
        steps: pl.DataFrame,
        slots: pl.DataFrame,
        holders: pl.DataFrame,
    ) -> ProvisionalPrices:
        by_name = {pool.name: pool for pool in self.pools.pools}
        unknown = segments.filter(~pl.col("pool").is_in(list(by_name)))
        if unknown.height:
            raise UnknownPoolSegment(
                f"{unknown['path'][0]}: pool {unknown['pool'][0]!r} is not in "
                f"{self.layout.pools_file} ({sorted(by_name)})"
            )
        context = self._gateway.context(self.layout.gateway, hours_touched(steps), self.salt)
        parts = []
        for name in sorted(set(steps["pool"].to_list())):
            pool = by_name[name]
            engine = (
                segments.filter(pl.col("pool") == name)
                .group_by("engine_version", "driver_version")
                .agg(pl.col("steps").sum())
                .sort("steps", "engine_version", "driver_version", descending=[True, False, False])
                .row(0)
            )
            parts.append(
                price_steps(
                    pool,
                    steps.filter(pl.col("pool") == name),
                    slots.filter(pl.col("pool") == name).drop("pool"),
                    holders.filter(pl.col("pool") == name).drop("pool"),
                    context,
                    weight_source(pool, (engine[0], engine[1]), self.layout.calibration_file),
                )
            )
        parts = [p for p in parts if p.request_costs.height or p.lines.height]
        if not parts:
            return ProvisionalPrices(pl.DataFrame(), pl.DataFrame())
        return ProvisionalPrices(
            pl.concat([p.request_costs for p in parts]), pl.concat([p.lines for p in parts])
        )

    def _commit(
        self,
        con: duckdb.DuckDBPyConnection,
        batch_id: str,
        paths: list[Path],
        segments: pl.DataFrame,
        prices: ProvisionalPrices,
    ) -> None:
        priced_at = warehouse_now()
        stamp = (pl.lit(batch_id).alias("batch_id"), pl.lit(priced_at).alias("priced_at"))
        by_path = dict(zip(segments["path"].to_list(), segments.iter_rows(named=True), strict=True))
        consumed = pl.DataFrame(
            [
                {
                    "path": self._key(path),
                    # A file with no readable header still counts as seen, under its name.
                    "segment_id": by_path.get(str(path), {}).get("segment_id", path.name),
                    "pool": by_path.get(str(path), {}).get("pool", ""),
                    "replica": by_path.get(str(path), {}).get("replica", path.parent.name),
                    "steps": by_path.get(str(path), {}).get("steps", 0),
                }
                for path in paths
            ]
        ).with_columns(*stamp)
        with warehouse.transaction(con):
            if prices.request_costs.height:
                warehouse.insert_frame(
                    con, "provisional_request_costs", prices.request_costs.with_columns(*stamp)
                )
            if prices.lines.height:
                warehouse.insert_frame(con, "provisional_lines", prices.lines.with_columns(*stamp))
            warehouse.insert_frame(con, "live_segments", consumed)
            warehouse.commit_message(
                con, f"provisional {batch_id}", segments=len(paths), batch=batch_id
            )


def _frame(table: pa.Table) -> pl.DataFrame:
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    return frame


def serve_forever(
    pricer: LivePricer,
    stop: threading.Event,
    *,
    interval_s: float = DEFAULT_INTERVAL_S,
    on_cycle: Callable[[CycleReport], None] = lambda report: None,
) -> None:
    """Run cycles until `stop` is set, waiting `interval_s` after a cycle that found nothing.
    A cycle that fails is logged and retried (it committed nothing)."""
    con = pricer.open_warehouse()
    try:
        while not stop.is_set():
            try:
                report = pricer.cycle(con)
            except (DataError, duckdb.Error, OSError):
                log.exception("live pricing cycle failed; retrying in %.1f s", interval_s)
                report = None
            if report is None:
                stop.wait(interval_s)
            else:
                on_cycle(report)
    finally:
        con.close()
