"""New step-log segments from the replicas' outboxes into the Parquet lake.

Layout: `<lake>/<table>/pool=<pool>/hour=<YYYY-MM-DDTHH>/<replica>.<seq>.<batch>.parquet` for the tables
`steps`, `slots` and `holders` (schemas.tables), a step placed in the UTC hour it started in.
Each segment is ingested once: a file whose bytes were seen before, or that repeats a segment
id already ingested, is recorded as a duplicate delivery and contributes nothing. What was
ingested, and the damage and drops the decoder found, are recorded in the warehouse.

A batch's lake files count only once the warehouse has committed the batch (`segment_files`):
readers take the committed batch ids (`committed_batches`) and skip other files. Before writing
them, an ingest leaves an intent (`<lake>/_ingest/<batch>.json`, the partitions it is about to
write); the next ingest removes the files of every intent whose batch never committed, so a
crash between the lake and the warehouse leaves nothing behind for long.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa

from pipeline.hours import hour_key
from pipeline.steplog import read_segments
from pipeline.warehouse import insert_frame, transaction
from schemas.tables import HOLDERS, SLOTS, STEPS

NS_PER_HOUR = 3_600_000_000_000
LAKE_TABLES = {"steps": STEPS, "slots": SLOTS, "holders": HOLDERS}
STEP_KEY = ["pool", "replica", "seq"]
# Under the lake: the ingest lock and the intents of batches being written.
INTENTS_DIR = "_ingest"
# Segment bytes decoded per batch. Ingesting a day of a busy replica (2 GiB of segments) peaked
# at 2.4 GiB resident with 256 MiB batches and 3.8 GiB with 512 MiB (decoded Arrow tables, their
# polars frames and the split by hour); as one batch, in the 24-hour backfill benchmark, 17 GiB.
BATCH_BYTES = 256 << 20

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IngestReport:
    batch_id: str | None  # the last batch written; None when nothing new arrived
    ingested_files: list[Path]
    duplicate_files: list[Path]
    steps: int
    damage: int
    # (pool, hour key) partitions that received steps: the hours to (re)attribute.
    partitions: set[tuple[str, str]] = field(default_factory=set)
    # Lake files of batches an earlier, interrupted ingest wrote but never committed.
    uncommitted_removed: list[Path] = field(default_factory=list)


def segment_files(outbox: Path, replicas: Iterable[str] | None = None) -> list[Path]:
    """Every shipped segment (`*.seg`) under `outbox/<replica>/`, in a stable order."""
    if not outbox.is_dir():
        return []
    dirs = (
        [outbox / r for r in replicas]
        if replicas is not None
        else [d for d in outbox.iterdir() if d.is_dir()]
    )
    return sorted(p for d in dirs if d.is_dir() for p in d.glob("*.seg"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def partition_dir(lake: Path, table: str, pool: str, hour_key: str) -> Path:
    return lake / table / f"pool={pool}" / f"hour={hour_key}"


def part_name(replica: str, part: pl.DataFrame, batch_id: str) -> str:
    """`<replica>.<first seq>.<batch>.parquet`: sorted by name, a partition's files list each
    replica's rows in sequence order, the order attribution works in."""
    first_seq = part.select(pl.col("seq").min()).item()
    return f"{replica}.{first_seq:012d}.{batch_id}.parquet"


def batch_of(part: Path) -> str:
    """The batch id in a lake file's name (`part_name`)."""
    return part.name.removesuffix(".parquet").rsplit(".", 1)[-1]


def committed_batches(con: duckdb.DuckDBPyConnection) -> set[str]:
    """The batches the warehouse has recorded: the only ones whose lake files are data."""
    return {row[0] for row in con.execute("SELECT DISTINCT batch_id FROM segment_files").fetchall()}


def _write_atomically(table: pa.Table, target: Path) -> None:
    import pyarrow.parquet as pq

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".parquet.partial")
    pq.write_table(table, partial)
    os.replace(partial, target)


@contextmanager
def _ingest_lock(lake: Path) -> Iterator[Path]:
    """Hold the lake's ingest lock; yields the intents directory.

    Removing an uncommitted batch's files is only safe while no other ingest is between
    writing its files and committing them; the lock (released by the kernel, should the
    holder die) makes ingests of one lake take turns."""
    intents = lake / INTENTS_DIR
    intents.mkdir(parents=True, exist_ok=True)
    with (intents / "lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield intents


def _write_intent(lake: Path, intents: Path, batch_id: str, directories: set[Path]) -> None:
    target = intents / f"{batch_id}.json"
    partial = target.with_suffix(".json.partial")
    partial.write_text(json.dumps(sorted(str(d.relative_to(lake)) for d in directories)))
    os.replace(partial, target)


def remove_uncommitted(con: duckdb.DuckDBPyConnection, lake: Path, intents: Path) -> list[Path]:
    """Settle the intents left by earlier ingests: delete the lake files of each batch the
    warehouse never committed, then the intent. Returns the files removed."""
    committed = committed_batches(con)
    removed: list[Path] = []
    # A torn intent was never followed by lake writes.
    for torn in intents.glob("*.json.partial"):
        torn.unlink()
    for intent in sorted(intents.glob("*.json")):
        batch_id = intent.stem
        if batch_id not in committed:
            parts = [
                part
                for directory in json.loads(intent.read_text())
                for part in sorted((lake / directory).glob(f"*.{batch_id}.parquet*"))
            ]
            for part in parts:
                part.unlink()
            log.warning(
                "batch %s was written to the lake but never committed to the warehouse; removed %d file(s): %s",
                batch_id,
                len(parts),
                ", ".join(map(str, parts)) or "none",
            )
            removed.extend(parts)
        intent.unlink()
    return removed


def ingest_outbox(
    con: duckdb.DuckDBPyConnection,
    outbox: Path,
    lake: Path,
    *,
    replicas: Iterable[str] | None = None,
) -> IngestReport:
    """Ingest the segments not seen before, a replica at a time; return what was written.

    Each batch holds consecutive segments of one replica, up to BATCH_BYTES, so memory is
    bounded by the batch, not by how much waited in the outbox; the decoder bounds a torn
    segment by the next one, in the same batch or the next. Parquet files are named after the
    batch (a hash of its files' contents) and written before the warehouse records the batch;
    the files of a batch that never committed (the process died in between) are removed first,
    whatever arrived in the outbox since.
    """
    with _ingest_lock(lake) as intents:
        removed = remove_uncommitted(con, lake, intents)
        report = _ingest_new(con, outbox, lake, intents, replicas)
    return dataclasses.replace(report, uncommitted_removed=removed)


def _ingest_new(
    con: duckdb.DuckDBPyConnection,
    outbox: Path,
    lake: Path,
    intents: Path,
    replicas: Iterable[str] | None,
) -> IngestReport:
    known_paths = {row[0] for row in con.execute("SELECT path FROM segment_files").fetchall()}
    known_hashes = {
        row[0]
        for row in con.execute(
            "SELECT sha256 FROM segment_files WHERE status = 'ingested'"
        ).fetchall()
    }
    # Per replica, batches of consecutive segments of up to BATCH_BYTES (a bigger segment is a
    # batch alone): memory stays bounded however much waited in the outbox.
    batches: list[tuple[str, dict[Path, str], dict[Path, str]]] = []
    replica, batch_bytes = None, 0
    for path in segment_files(outbox, replicas):
        if str(path) in known_paths:
            continue
        size = path.stat().st_size
        if path.parent.name != replica or (batch_bytes and batch_bytes + size > BATCH_BYTES):
            replica, batch_bytes = path.parent.name, 0
            batches.append((replica, {}, {}))
        _, fresh, duplicates = batches[-1]
        digest = _sha256(path)
        if digest in known_hashes:
            duplicates[path] = digest
        else:
            fresh[path] = digest
            batch_bytes += size
            known_hashes.add(digest)
    # A torn tail at the end of a batch is bounded by the first segment of the replica's next batch.
    following = [
        list(next_fresh)[:1] if next_replica == batch_replica else []
        for (batch_replica, _, _), (next_replica, next_fresh, _) in zip(
            batches, [*batches[1:], (None, {}, {})], strict=False
        )
    ]
    reports = [
        _ingest_batch(con, lake, intents, fresh, duplicates, after)
        for (_, fresh, duplicates), after in zip(batches, following, strict=True)
    ]
    return IngestReport(
        batch_id=reports[-1].batch_id if reports else None,
        ingested_files=[p for r in reports for p in r.ingested_files],
        duplicate_files=[p for r in reports for p in r.duplicate_files],
        steps=sum(r.steps for r in reports),
        damage=sum(r.damage for r in reports),
        partitions={p for r in reports for p in r.partitions},
    )


def _hour_key(hour_index: int) -> str:
    """The hour key of an hour counted from the epoch."""
    return hour_key(datetime.fromtimestamp(hour_index * 3600, tz=UTC))


def _ingest_batch(
    con: duckdb.DuckDBPyConnection,
    lake: Path,
    intents: Path,
    fresh: dict[Path, str],
    duplicates: dict[Path, str],
    following: list[Path],
) -> IngestReport:
    """Decode `fresh` files into the lake and record them and `duplicates` in the warehouse
    (`following`: the replica's next segment, to bound a torn tail; not ingested here)."""
    batch_id = hashlib.sha256(
        "".join(sorted({*fresh.values(), *duplicates.values()})).encode()
    ).hexdigest()[:16]
    steps = slots = holders = None
    decoded_segments = damage = drops = None
    if fresh:
        decoded = read_segments(list(fresh), following)
        steps, slots, holders = (
            pl.DataFrame(t) for t in (decoded.steps, decoded.slots, decoded.holders)
        )
        decoded_segments = pl.DataFrame(decoded.segments)
        damage = pl.DataFrame(decoded.damage)
        drops = pl.DataFrame(decoded.drops)
        # A segment id already ingested (a re-delivery with different bytes) is a duplicate.
        known_ids = {row[0] for row in con.execute("SELECT segment_id FROM segments").fetchall()}
        repeated = decoded_segments.filter(pl.col("segment_id").is_in(list(known_ids)))
        if repeated.height:
            for path in repeated["path"].to_list():
                duplicates[Path(path)] = fresh.pop(Path(path))
            decoded_segments = decoded_segments.filter(~pl.col("segment_id").is_in(list(known_ids)))
            steps = steps.filter(~pl.col("segment_id").is_in(list(known_ids)))
            kept = steps.select(STEP_KEY)
            slots = slots.join(kept, on=STEP_KEY, how="semi")
            holders = holders.join(kept, on=STEP_KEY, how="semi")

    partitions: set[tuple[str, str]] = set()
    if steps is not None and steps.height:
        # The hour as an integer (hours since the epoch): a slot row carries 8 bytes, not a string.
        hours = steps.select(*STEP_KEY, (pl.col("start_utc_ns") // NS_PER_HOUR).alias("_hour"))
        partitions = {
            (pool, _hour_key(hour_index))
            for pool, hour_index in hours.select("pool", "_hour").unique().iter_rows()
        }
        directories = {
            partition_dir(lake, name, *partition)
            for name in LAKE_TABLES
            for partition in partitions
        }
        _write_intent(lake, intents, batch_id, directories)
        assert slots is not None and holders is not None  # decoded with the steps
        for name, frame in (("steps", steps), ("slots", slots), ("holders", holders)):
            placed = frame.join(hours, on=STEP_KEY, how="left")
            for (pool, replica, hour_index), part in placed.group_by(
                ["pool", "replica", "_hour"], maintain_order=True
            ):
                table = part.drop("_hour").to_arrow().cast(LAKE_TABLES[name])
                directory = partition_dir(lake, name, pool, _hour_key(hour_index))
                _write_atomically(table, directory / part_name(replica, part, batch_id))
            del placed

    now = datetime.now(UTC).replace(tzinfo=None)
    file_rows = pl.DataFrame(
        {
            "path": [str(p) for p in (*fresh, *duplicates)],
            "sha256": [*fresh.values(), *duplicates.values()],
            "bytes": [p.stat().st_size for p in (*fresh, *duplicates)],
            "status": ["ingested"] * len(fresh) + ["duplicate"] * len(duplicates),
            "batch_id": batch_id,
            "ingested_at": now,
        },
        schema_overrides={"bytes": pl.Int64, "ingested_at": pl.Datetime("us")},
    )
    with transaction(con):
        insert_frame(con, "segment_files", file_rows)
        if decoded_segments is not None and decoded_segments.height:
            hashes = pl.DataFrame({"path": [str(p) for p in fresh], "sha256": list(fresh.values())})
            insert_frame(
                con,
                "segments",
                decoded_segments.join(hashes, on="path", how="left").with_columns(
                    batch_id=pl.lit(batch_id)
                ),
            )
        for name, found in (("damage", damage), ("drops", drops)):
            if found is not None and found.height:
                insert_frame(con, name, found.with_columns(batch_id=pl.lit(batch_id)))
    # Committed: the intent is settled (should the process die first, the next ingest finds
    # the batch committed and drops the intent alone).
    (intents / f"{batch_id}.json").unlink(missing_ok=True)
    return IngestReport(
        batch_id=batch_id,
        ingested_files=list(fresh),
        duplicate_files=list(duplicates),
        steps=0 if steps is None else steps.height,
        damage=0 if damage is None else damage.height,
        partitions=partitions,
    )
