"""New step-log segments from the replicas' outboxes into the Parquet lake.

Layout: `<lake>/<table>/pool=<pool>/hour=<YYYY-MM-DDTHH>/<replica>.<seq>.<batch>.parquet` for the tables
`steps`, `slots` and `holders` (schemas.tables), a step placed in the UTC hour it started in.
Files are known by their content and their path relative to the data directory (the outbox's
parent, `outbox/<replica>/<name>`), so a data directory moved or restored from a backup is the
same data. Each segment is ingested once: a file whose bytes were seen before is recorded as a
duplicate delivery and contributes nothing; a file that repeats a segment id already ingested
contributes only the steps no earlier copy delivered (a torn or bit-flipped copy followed by an
intact one). A path that is not a readable regular file (a directory, a FIFO, a dangling
symlink) is recorded as `unreadable` damage and the rest of the outbox is ingested.

Damage is scoped to the sequence numbers it can hide, and once every one of them is held (a
later copy delivered them, or the next segment starts right where the damage begins) the
damage is settled as `recovered`: it hides nothing, so it holds no hour back.

A batch's lake files count only once the warehouse has committed the batch (`segment_files`):
readers take the committed batch ids (`committed_batches`) and skip other files. Before writing
them, an ingest leaves an intent (`<lake>/_ingest/<batch>.json`, the partitions it is about to
write); the next ingest removes the files of every intent whose batch never committed, so a
crash between the lake and the warehouse leaves nothing behind for long.
"""

from __future__ import annotations

import dataclasses
import fcntl
import glob
import hashlib
import json
import logging
import os
import stat
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.ahead import ordered_ahead
from pipeline.ingestion.decoder import DecodedLog, UnreadableSegment, open_segment, read_segments
from pipeline.ship.store import SegmentStore, pull_segments
from pipeline.storage.warehouse import insert_frame, query_frame, transaction
from schemas.tables import HOLDERS, SLOTS, STEPS
from schemas.units import HOUR_NS, NS_PER_SECOND, hour_at, hour_key, warehouse_now

LAKE_TABLES = {"steps": STEPS, "slots": SLOTS, "holders": HOLDERS}
STEP_KEY = ["pool", "replica", "seq"]
# What a lake file holds the rows of: a replica's steps of one hour (hours since the epoch).
PART_KEY = ["pool", "replica", "_hour"]
# Under the lake: the ingest lock and the intents of batches being written.
INTENTS_DIR = "_ingest"
# Segment bytes decoded per batch. Ingesting a day of a busy replica (2 GiB of segments) peaked
# at 2.4 GiB resident with 256 MiB batches and 3.8 GiB with 512 MiB (decoded Arrow tables, their
# polars frames and the split by hour); as one batch, in the 24-hour backfill benchmark, 17 GiB.
BATCH_BYTES = 256 << 20
# NTP slews offsets under 128 ms and steps larger ones; a clock drifting even 1% moves 3 s over
# a 5-minute segment. A shift a minute off the previous segment's is a step of the wall clock.
CLOCK_JUMP_TOLERANCE_NS = 60_000_000_000
_JUMP_COLUMNS = (
    "segment_id",
    "path",
    "pool",
    "replica",
    "first_seq",
    "previous_segment_id",
    "placed_shift_ns",
    "jump_ns",
    "first_start_utc_ns",
)
_JUMP_TYPES = (pl.String,) * 4 + (pl.Int64, pl.String) + (pl.Int64,) * 3

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


def _fingerprint(path: Path, name: str) -> tuple[int, str]:
    """(bytes, sha256) of the segment file at `path` (known as `name`). A path that cannot be
    read is keyed by its name and why, so it is reported once, and again only once it holds
    something else."""
    digest = hashlib.sha256()
    size = 0
    try:
        with open_segment(path) as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
                size += len(block)
    except UnreadableSegment as err:
        why = str(err)
    except OSError as err:
        why = f"cannot read: {err.strerror}"
    else:
        return size, digest.hexdigest()
    return 0, hashlib.sha256(f"{name} unreadable: {why}".encode()).hexdigest()


def _unchanged_since(path: Path, size: int, seen_at: datetime) -> bool:
    """Whether the regular file at `path` still has `size` bytes and its inode has not changed
    since `seen_at`: then it holds what was read then, and hashing it again (every ingest, for
    every segment an outbox retains) is skipped. A file renamed into place, written to,
    or restored from a backup has a later change time, which no one can set back."""
    try:
        status = path.stat()
    except OSError:
        return False
    return (
        stat.S_ISREG(status.st_mode)
        and status.st_size == size
        and status.st_ctime_ns < seen_at.timestamp() * NS_PER_SECOND
    )


def _frame(table: pa.Table) -> pl.DataFrame:
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    return frame


def partition_dir(lake: Path, table: str, pool: str, hour_key: str) -> Path:
    return lake / table / f"pool={pool}" / f"hour={hour_key}"


def part_name(replica: str, part: pa.Table, batch_id: str) -> str:
    """`<replica>.<first seq>.<batch>.parquet`: sorted by name, a partition's files list each
    replica's rows in sequence order, the order attribution works in."""
    first_seq = pc.min(part["seq"]).as_py()
    return f"{replica}.{first_seq:012d}.{batch_id}.parquet"


def batch_of(part: Path) -> str:
    """The batch id in a lake file's name (`part_name`)."""
    return part.name.removesuffix(".parquet").rsplit(".", 1)[-1]


def committed_batches(con: duckdb.DuckDBPyConnection) -> set[str]:
    """The batches the warehouse has recorded: the only ones whose lake files are data."""
    return {row[0] for row in con.execute("SELECT DISTINCT batch_id FROM segment_files").fetchall()}


def _parquet_options(schema: pa.Schema) -> dict[str, Any]:
    """How a lake table is encoded. Dictionary pages for its strings only (pool, replica and ids
    repeat); int64 columns (sequence numbers, nanosecond times) as deltas, as they rise by
    small steps; zstd. Measured on a busy replica-hour (2.4 M slot rows, 0.3 M steps) against
    pyarrow's defaults (snappy, every column a dictionary, statistics for all): writing takes
    0.26 CPU-s instead of 0.42, the files 11 MB instead of 23, reading them back with polars
    the same 0.09 CPU-s. Snappy with the same encodings writes 0.05 CPU-s faster, but 18 MB."""
    strings = [f.name for f in schema if f.type == pa.string()]
    return {
        "compression": "zstd",
        "use_dictionary": strings,
        "column_encoding": {f.name: "DELTA_BINARY_PACKED" for f in schema if f.type == pa.int64()},
        # Readers select by sequence number and time; strings' minima and maxima, which cost
        # a seventh of writing the slots, would skip nothing.
        "write_statistics": [f.name for f in schema if f.name not in strings],
    }


def _write_atomically(table: pa.Table, target: Path) -> str:
    """Write `table` to `target` through a temporary name; returns the file's sha256, hashed
    from the bytes written rather than read back."""
    import pyarrow.parquet as pq

    encoded = pa.BufferOutputStream()
    pq.write_table(table, encoded, **_parquet_options(table.schema))
    data = encoded.getvalue()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".parquet.partial")
    with partial.open("wb") as handle:
        handle.write(data)
    os.replace(partial, target)
    return hashlib.sha256(data).hexdigest()


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
    store: SegmentStore | None = None,
) -> IngestReport:
    """Ingest the segments not seen before, a replica at a time; return what was written.

    `store`: the object store the engines' segments are shipped to; those not yet in the
    outbox are pulled into it first (`pipeline.ship.store.pull_segments`).

    Each batch holds consecutive segments of one replica, up to BATCH_BYTES, so memory is
    bounded by the batch, not by how much waited in the outbox; the decoder bounds a torn
    segment by the next one, in the same batch or the next. Parquet files are named after the
    batch (a hash of its files' contents) and written before the warehouse records the batch;
    the files of a batch that never committed (the process died in between) are removed first,
    whatever arrived in the outbox since.
    """
    with _ingest_lock(lake) as intents:
        removed = remove_uncommitted(con, lake, intents)
        if store is not None:
            pull_segments(store, outbox, replicas)
        report = _ingest_new(con, outbox, lake, intents, replicas)
    return dataclasses.replace(report, uncommitted_removed=removed)


@dataclass
class _Batch:
    """Consecutive segment files of one replica: (bytes, sha256) of each, by path."""

    replica: str
    fresh: dict[Path, tuple[int, str]] = field(default_factory=dict)
    duplicates: dict[Path, tuple[int, str]] = field(default_factory=dict)
    size: int = 0  # bytes of the fresh files


def _ingest_new(
    con: duckdb.DuckDBPyConnection,
    outbox: Path,
    lake: Path,
    intents: Path,
    replicas: Iterable[str] | None,
) -> IngestReport:
    root = outbox.parent
    known_files = set(con.execute("SELECT path, sha256 FROM segment_files").fetchall())
    last_seen = {
        path: (size, ingested_at.replace(tzinfo=UTC))
        for path, size, ingested_at in con.execute(
            "SELECT path, arg_max(bytes, ingested_at), max(ingested_at) FROM segment_files "
            "GROUP BY path"
        ).fetchall()
    }
    known_hashes = {
        row[0]
        for row in con.execute(
            "SELECT sha256 FROM segment_files WHERE status = 'ingested'"
        ).fetchall()
    }
    # Per replica, batches of consecutive segments of up to BATCH_BYTES (a bigger segment is a
    # batch alone): memory stays bounded however much waited in the outbox.
    batches: list[_Batch] = []
    changed = [
        (path, name)
        for path in segment_files(outbox, replicas)
        if not (
            (name := str(path.relative_to(root))) in last_seen
            and _unchanged_since(path, *last_seen[name])
        )
    ]
    # Reading and hashing release the GIL: the files are fingerprinted side by side.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as readers:
        fingerprints = list(readers.map(lambda file: _fingerprint(*file), changed))
    for (path, name), (size, digest) in zip(changed, fingerprints, strict=True):
        if (name, digest) in known_files:
            continue
        if (
            not batches
            or path.parent.name != batches[-1].replica
            or (batches[-1].size and batches[-1].size + size > BATCH_BYTES)
        ):
            batches.append(_Batch(path.parent.name))
        if digest in known_hashes:
            batches[-1].duplicates[path] = (size, digest)
        else:
            batches[-1].fresh[path] = (size, digest)
            batches[-1].size += size
            known_hashes.add(digest)
    # A torn tail at the end of a batch is bounded by the first segment of the replica's next batch.
    following = [
        list(after.fresh)[:1] if after.replica == batch.replica else []
        for batch, after in zip(batches, [*batches[1:], _Batch("")], strict=False)
    ]
    reports = [
        _ingest_batch(con, root, lake, intents, batch, decoded)
        for batch, decoded in ordered_ahead(_decode, zip(batches, following, strict=True))
    ]
    return IngestReport(
        batch_id=reports[-1].batch_id if reports else None,
        ingested_files=[p for r in reports for p in r.ingested_files],
        duplicate_files=[p for r in reports for p in r.duplicate_files],
        steps=sum(r.steps for r in reports),
        damage=sum(r.damage for r in reports),
        partitions={p for r in reports for p in r.partitions},
    )


def _held_seqs(
    con: duckdb.DuckDBPyConnection, lake: Path, replica: str, low: int, high: int
) -> pl.Series:
    """The distinct sequence numbers in [low, high] of `replica`'s steps in committed lake files.

    A file's name gives its first sequence number (`part_name`), so files that start after
    `high` are not opened, and Parquet statistics skip the row groups outside the range."""
    committed = committed_batches(con)
    files = [
        part
        for part in (lake / "steps").glob(f"pool=*/hour=*/{glob.escape(replica)}.*.parquet")
        if batch_of(part) in committed
        and int(part.name.removeprefix(f"{replica}.").split(".", 1)[0]) <= high
    ]
    if not files:
        return pl.Series("seq", [], pl.Int64)
    return (
        pl.scan_parquet(files, glob=False)
        .select("seq")
        .filter(pl.col("seq").is_between(low, high))
        .unique()
        .collect()["seq"]
    )


def _new_steps_of_known_segments(
    con: duckdb.DuckDBPyConnection, lake: Path, steps: pl.DataFrame, known_ids: set[str]
) -> pl.DataFrame:
    """Of the steps of segments already ingested, those no earlier copy delivered."""
    repeated = steps.filter(pl.col("segment_id").is_in(list(known_ids)))
    if not repeated.height:
        return repeated
    ranges = repeated.group_by("replica").agg(pl.col("seq").min().alias("low"), pl.col("seq").max())
    held = pl.concat(
        [
            _held_seqs(con, lake, replica, low, high)
            .to_frame()
            .with_columns(replica=pl.lit(replica))
            for replica, low, high in ranges.iter_rows()
        ]
    )
    return repeated.join(held, on=["replica", "seq"], how="anti")


def _place_by_monotonic_clock(
    con: duckdb.DuckDBPyConnection, segments: pl.DataFrame, steps: pl.DataFrame
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The steps placed in UTC by each replica's monotonic clock, and the new `clock_jumps` rows.

    A segment's header pairs a monotonic and a wall reading taken as it opened; the decoder
    places its steps at monotonic + (wall - monotonic). Within one boot the monotonic clock runs
    on while the wall clock may step (a bad NTP source, a hand-set clock), which would put the
    segment's steps hours away from when they ran, in hours never attributed. So a segment whose
    shift differs by more than CLOCK_JUMP_TOLERANCE_NS from the shift the replica's previous
    segment was placed by (earlier sequence numbers, earlier monotonic anchor) is placed by
    that shift instead, and the jump is recorded for reconciliation to report."""
    placed = query_frame(
        con,
        "SELECT s.segment_id, s.replica, s.mono_anchor_ns, s.last_seq, "
        "coalesce(j.placed_shift_ns, s.wall_anchor_ns - s.mono_anchor_ns) AS placed_shift_ns "
        "FROM segments s LEFT JOIN clock_jumps j USING (segment_id) "
        "WHERE list_contains(?, s.replica)",
        [segments["replica"].unique().to_list()],
    )
    corrections: dict[str, int] = {}
    chains: dict[str, list[tuple[int, int, int, str]]] = {}
    for segment_id, replica, mono, last, shift in placed.iter_rows():
        chains.setdefault(replica, []).append((last, mono, shift, segment_id))
    jumps = []
    # Grouping every step by its segment id costs more than the rest: only for a jump.
    first_starts: dict[str, int] | None = None
    for row in segments.sort("replica", "first_seq").iter_rows(named=True):
        shift = row["wall_anchor_ns"] - row["mono_anchor_ns"]
        earlier = [
            c
            for c in chains.get(row["replica"], [])
            if c[0] < row["first_seq"] and c[1] <= row["mono_anchor_ns"]
        ]
        placed_shift = shift
        if earlier:
            _, _, previous_shift, previous_id = max(earlier)
            if abs(shift - previous_shift) > CLOCK_JUMP_TOLERANCE_NS:
                placed_shift = previous_shift
                corrections[row["segment_id"]] = previous_shift - shift
                if first_starts is None:
                    first_starts = dict(
                        steps.group_by("segment_id").agg(pl.col("start_utc_ns").min()).iter_rows()
                    )
                jumps.append(
                    {
                        "segment_id": row["segment_id"],
                        "path": row["path"],
                        "pool": row["pool"],
                        "replica": row["replica"],
                        "first_seq": row["first_seq"],
                        "previous_segment_id": previous_id,
                        "placed_shift_ns": previous_shift,
                        "jump_ns": shift - previous_shift,
                        "first_start_utc_ns": first_starts.get(row["segment_id"], 0)
                        + previous_shift
                        - shift,
                    }
                )
        chains.setdefault(row["replica"], []).append(
            (row["last_seq"], row["mono_anchor_ns"], placed_shift, row["segment_id"])
        )
    jump_rows = pl.DataFrame(
        jumps, schema={n: t for n, t in zip(_JUMP_COLUMNS, _JUMP_TYPES, strict=True)}
    )
    return _shifted(steps, corrections), jump_rows


def _shifted(steps: pl.DataFrame, corrections: dict[str, int]) -> pl.DataFrame:
    """`steps` with each segment's UTC times moved by its correction (segment id -> ns)."""
    if not corrections:
        return steps
    correction = pl.col("segment_id").replace_strict(corrections, default=0, return_dtype=pl.Int64)
    return steps.with_columns(
        pl.col("start_utc_ns") + correction, pl.col("end_utc_ns") + correction
    )


_Run = tuple[tuple[str, str, int], int, int]


def _runs(keys: pl.DataFrame) -> list[_Run]:
    """The runs of equal (pool, replica, `_hour`) in `keys`: each key, its first row and rows."""
    runs = keys.select(pl.struct(PART_KEY).rle().alias("run")).unnest("run").unnest("value")
    lengths = runs["len"].to_numpy()
    starts = np.cumsum(lengths) - lengths
    return list(
        zip(runs.select(PART_KEY).iter_rows(), starts.tolist(), lengths.tolist(), strict=True)
    )


def _unique_in_order(seq: np.ndarray, step_runs: list[_Run]) -> bool:
    """Whether each (pool, replica)'s steps lie together, by rising seq: every step key once.
    `seq`: the steps' sequence numbers; `step_runs`: their runs (`_runs`)."""
    rising = np.diff(seq) > 0
    replicas: list[tuple[str, str]] = []
    for (pool, replica, _), start, _ in step_runs:
        if not replicas or replicas[-1] != (pool, replica):
            replicas.append((pool, replica))
            if start:
                rising[start - 1] = True  # another replica's sequence starts here
    return bool(rising.all()) and len(set(replicas)) == len(replicas)


def _runs_of_rows(step_runs: list[_Run], counts: np.ndarray) -> list[_Run]:
    """The runs of the rows of steps (`counts` per step) whose runs are `step_runs`, when each
    step's rows lie together in the order of the steps; runs without rows are left out."""
    bounds = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=bounds[1:])
    return [
        (key, start, end - start)
        for key, first, length in step_runs
        if (end := int(bounds[first + length])) > (start := int(bounds[first]))
    ]


def _hour_parts(
    table: pa.Table,
    hours: pl.DataFrame,
    step_runs: list[_Run],
    counts: np.ndarray | None,
    in_order: bool,
) -> Iterator[tuple[tuple[str, str, int], pa.Table]]:
    """The rows of `table` (the steps, or their slot or holder rows, `counts` per step) of each
    (pool, replica, `_hour` of their step), in order of first appearance: what a left join of
    `hours` on the step key, then `group_by(..., maintain_order=True)`, gives.

    The decoder emits each step's rows together, in the order of the steps: when every step
    key is unique, that order holds (`in_order`) and the counts add up to the rows, the rows
    of a run of steps (`step_runs`) are a slice found from the counts, without hashing
    millions of string keys or leaving Arrow. Anything else (a re-delivered segment's
    recovered steps) is joined."""
    if in_order and (counts is None or int(counts.sum()) == table.num_rows):
        runs = step_runs if counts is None else _runs_of_rows(step_runs, counts)
    else:
        placed = _frame(table).join(hours, on=STEP_KEY, how="left", maintain_order="left")
        runs = _runs(placed)
        table = placed.drop("_hour").to_arrow()
    spans: dict[tuple[str, str, int], list[tuple[int, int]]] = {}
    for key, start, length in runs:
        spans.setdefault(key, []).append((start, length))
    for key, parts in spans.items():
        yield key, pa.concat_tables([table.slice(start, length) for start, length in parts])


def _write_part(part: pa.Table, schema: pa.Schema, target: Path) -> str:
    # One chunk, however the decoder's frames and the hours cut the table: Parquet's pages
    # follow the chunks, and the file's bytes (and sha256) must not depend on them.
    return _write_atomically(part.cast(schema).combine_chunks(), target)


def _decode(batch_and_following: tuple[_Batch, list[Path]]) -> tuple[_Batch, DecodedLog | None]:
    """The batch with its fresh files decoded (the following list: the replica's next segment,
    to bound a torn tail; not ingested with the batch); None when it has none. Batches decode
    in threads (compiled, without the GIL) while the caller writes and records the one before."""
    batch, following = batch_and_following
    return batch, read_segments(list(batch.fresh), following) if batch.fresh else None


@dataclass(frozen=True)
class _DecodedBatch:
    """What a batch's decoded files add: steps placed in UTC and their slot and holder rows
    (Arrow, as decoded: only a re-delivered segment needs them in polars), and the rows for the
    warehouse's segments, damage, drops and clock_jumps tables."""

    steps: pl.DataFrame
    slots: pa.Table
    holders: pa.Table
    segments: pl.DataFrame
    damage: pl.DataFrame
    drops: pl.DataFrame
    jumps: pl.DataFrame
    # Of segments already ingested: the steps only this copy holds, per segment (segment_id,
    # first_seq, last_seq, steps).
    recovered_segments: pl.DataFrame
    # Whether some segment was ingested before (the rows no longer follow the decoder's steps).
    repeated: bool


def _decoded_batch(
    con: duckdb.DuckDBPyConnection,
    root: Path,
    lake: Path,
    decoded: DecodedLog,
    relative: dict[str, str],
    fresh: dict[Path, tuple[int, str]],
    duplicates: dict[Path, tuple[int, str]],
) -> _DecodedBatch:
    """The rows `decoded` adds to the lake and the warehouse; a fresh file whose segment was
    ingested before and holds no new step moves from `fresh` to `duplicates`."""
    steps, slots, holders = _frame(decoded.steps), decoded.slots, decoded.holders
    segments, damage, drops = (
        _frame(t).with_columns(pl.col("path").replace(relative))
        if "path" in t.column_names
        else _frame(t)
        for t in (decoded.segments, decoded.damage, decoded.drops)
    )
    # A segment with no intact step or drop frame has nothing to record (its damage says
    # which steps it held).
    segments = segments.filter(pl.col("first_seq").is_not_null())
    known_ids = {row[0] for row in con.execute("SELECT segment_id FROM segments").fetchall()}
    # Another copy of a segment placed by the monotonic clock is placed the same way.
    steps = _shifted(
        steps, dict(con.execute("SELECT segment_id, -jump_ns FROM clock_jumps").fetchall())
    )
    repeated = segments.filter(pl.col("segment_id").is_in(list(known_ids)))
    recovered_segments = pl.DataFrame()
    if repeated.height:
        # Another copy of a segment already ingested: only the steps it alone holds count.
        recovered = _new_steps_of_known_segments(con, lake, steps, known_ids)
        recovered_segments = recovered.group_by("segment_id").agg(
            pl.col("seq").min().alias("first_seq"),
            pl.col("seq").max().alias("last_seq"),
            pl.len().alias("steps"),
        )
        for segment_id, path in repeated.select("segment_id", "path").iter_rows():
            if segment_id not in recovered_segments["segment_id"]:
                absolute = root / path
                duplicates[absolute] = fresh.pop(absolute)
        segments = segments.filter(~pl.col("segment_id").is_in(list(known_ids)))
        steps = pl.concat([steps.filter(~pl.col("segment_id").is_in(list(known_ids))), recovered])
        kept = steps.select(STEP_KEY)
        slots, holders = (
            _frame(rows).join(kept, on=STEP_KEY, how="semi").to_arrow() for rows in (slots, holders)
        )
        known_drops = query_frame(con, "SELECT pool, replica, first_seq, last_seq FROM drops")
        drops = drops.join(known_drops, on=["pool", "replica", "first_seq", "last_seq"], how="anti")
    steps, jumps = _place_by_monotonic_clock(con, segments, steps)
    return _DecodedBatch(
        steps,
        slots,
        holders,
        segments,
        damage,
        drops,
        jumps,
        recovered_segments,
        bool(repeated.height),
    )


def _write_lake(
    lake: Path, intents: Path, batch_id: str, batch: _DecodedBatch
) -> tuple[set[tuple[str, str]], dict[str, str]]:
    """Write the batch's steps, slots and holders into the lake's partitions, after the intent
    that names their directories: the (pool, hour key) partitions and each file's sha256 by its
    path in the lake."""
    steps = batch.steps
    # The hour as an integer (hours since the epoch): a slot row carries 8 bytes, not a string.
    hours = steps.select(*STEP_KEY, (pl.col("start_utc_ns") // HOUR_NS).alias("_hour"))
    step_runs = _runs(hours.select(PART_KEY))
    partitions = {
        (pool, hour_key(hour_at(hour_index))) for (pool, _, hour_index), _, _ in step_runs
    }
    directories = {
        partition_dir(lake, name, *partition) for name in LAKE_TABLES for partition in partitions
    }
    _write_intent(lake, intents, batch_id, directories)
    # The rows of slots and holders follow the decoder's steps unless steps were recovered.
    in_order = not batch.repeated and _unique_in_order(steps["seq"].to_numpy(), step_runs)
    written: dict[str, str] = {}
    # pyarrow writes and hashlib hashes without the GIL: the partition files are written
    # side by side.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as writers:
        targets, digests = [], []
        for name, table, count in (
            ("steps", steps.to_arrow(), None),
            ("slots", batch.slots, "num_slots"),
            ("holders", batch.holders, "num_holders"),
        ):
            counts = None if count is None else steps[count].to_numpy()
            for (pool, replica, hour_index), part in _hour_parts(
                table, hours, step_runs, counts, in_order
            ):
                directory = partition_dir(lake, name, pool, hour_key(hour_at(hour_index)))
                targets.append(directory / part_name(replica, part, batch_id))
                digests.append(writers.submit(_write_part, part, LAKE_TABLES[name], targets[-1]))
        for target, digest in zip(targets, digests, strict=True):
            written[str(target.relative_to(lake))] = digest.result()
    return partitions, written


def _file_rows(
    batch_id: str,
    relative: dict[str, str],
    fresh: dict[Path, tuple[int, str]],
    duplicates: dict[Path, tuple[int, str]],
) -> pl.DataFrame:
    """The batch's `segment_files` rows: its fresh files ingested, the others duplicates."""
    files = {**fresh, **duplicates}
    return pl.DataFrame(
        {
            "path": [relative[str(p)] for p in files],
            "sha256": [digest for _, digest in files.values()],
            "bytes": [size for size, _ in files.values()],
            "status": ["ingested"] * len(fresh) + ["duplicate"] * len(duplicates),
            "batch_id": batch_id,
            "ingested_at": warehouse_now(),
        },
        schema_overrides={"bytes": pl.Int64, "ingested_at": pl.Datetime("us")},
    )


def _record_decoded(
    con: duckdb.DuckDBPyConnection,
    batch_id: str,
    relative: dict[str, str],
    fresh: dict[Path, tuple[int, str]],
    decoded: _DecodedBatch,
    written: dict[str, str],
) -> None:
    """Record in the warehouse, within the caller's transaction, the decoded batch's segments,
    the lake files written for it, and its damage, drops and clock jumps."""
    if decoded.segments.height:
        hashes = pl.DataFrame(
            {"path": [relative[str(p)] for p in fresh], "sha256": [d for _, d in fresh.values()]}
        )
        insert_frame(
            con,
            "segments",
            decoded.segments.join(hashes, on="path", how="left").with_columns(
                batch_id=pl.lit(batch_id)
            ),
        )
    for segment_id, first, last, count in decoded.recovered_segments.iter_rows():
        con.execute(
            "UPDATE segments SET first_seq = least(first_seq, ?), last_seq = greatest(last_seq, ?), "
            "steps = steps + ? WHERE segment_id = ?",
            [first, last, count, segment_id],
        )
    if written:
        insert_frame(
            con,
            "lake_files",
            pl.DataFrame(
                {"path": list(written), "sha256": list(written.values()), "batch_id": batch_id}
            ),
        )
    for name, found in (
        ("damage", decoded.damage),
        ("drops", decoded.drops),
        ("clock_jumps", decoded.jumps),
    ):
        if found.height:
            insert_frame(con, name, found.with_columns(batch_id=pl.lit(batch_id)))


def _ingest_batch(
    con: duckdb.DuckDBPyConnection,
    root: Path,
    lake: Path,
    intents: Path,
    batch: _Batch,
    decoded: DecodedLog | None,
) -> IngestReport:
    """Write the batch's decoded fresh files into the lake and record them and its duplicates
    in the warehouse."""
    fresh, duplicates = dict(batch.fresh), dict(batch.duplicates)
    batch_id = hashlib.sha256(
        "".join(sorted({d for _, d in (*fresh.values(), *duplicates.values())})).encode()
    ).hexdigest()[:16]
    relative = {str(p): str(p.relative_to(root)) for p in (*fresh, *duplicates)}
    added = (
        None
        if decoded is None
        else _decoded_batch(con, root, lake, decoded, relative, fresh, duplicates)
    )
    partitions: set[tuple[str, str]] = set()
    written: dict[str, str] = {}
    if added is not None and added.steps.height:
        partitions, written = _write_lake(lake, intents, batch_id, added)

    file_rows = _file_rows(batch_id, relative, fresh, duplicates)
    with transaction(con):
        insert_frame(con, "segment_files", file_rows)
        if added is not None:
            _record_decoded(con, batch_id, relative, fresh, added, written)
        _settle_damage(
            con,
            lake,
            batch.replica,
            batch_id,
            pl.Series("seq", [], pl.Int64) if added is None else added.steps["seq"],
            [] if added is None else list(added.drops.select("first_seq", "last_seq").iter_rows()),
        )
    # Committed: the intent is settled (should the process die first, the next ingest finds
    # the batch committed and drops the intent alone).
    (intents / f"{batch_id}.json").unlink(missing_ok=True)
    return IngestReport(
        batch_id=batch_id,
        ingested_files=list(fresh),
        duplicate_files=list(duplicates),
        steps=0 if added is None else added.steps.height,
        damage=0 if added is None else added.damage.height,
        partitions=partitions,
    )


def _dropped_within(dropped: list[tuple[int, int]], first: int, last: int) -> int:
    """How many sequence numbers in [first, last] the (possibly overlapping) drop ranges count."""
    count, reached = 0, first - 1
    for a, b in sorted(
        (max(a, first), min(b, last)) for a, b in dropped if a <= last and b >= first
    ):
        if b > reached:
            count += b - max(a, reached + 1) + 1
            reached = b
    return count


# Damage that may hide steps; `duplicate_segment` and `recovered` hide none.
HIDING_DAMAGE = ("torn_tail", "corrupt_frame", "bad_header", "unknown_version", "unreadable")


# A damage row is named by all its columns (PostgreSQL's tables, where the state may live,
# have no row ids): rows alike in every column are one finding recorded twice, settled alike.
DAMAGE_FIELDS = (
    "path",
    "kind",
    "byte_offset",
    "byte_length",
    "first_seq",
    "last_seq",
    "detail",
    "batch_id",
)
DAMAGE_COLUMNS = len(DAMAGE_FIELDS)
DAMAGE_ROW = ", ".join(DAMAGE_FIELDS)
DAMAGE_ROW_IS = " AND ".join(f"{field} IS NOT DISTINCT FROM ?" for field in DAMAGE_FIELDS)


def _settle_damage(
    con: duckdb.DuckDBPyConnection,
    lake: Path,
    replica: str,
    batch_id: str,
    new_seqs: pl.Series,
    new_drops: list[tuple[int, int]],
) -> None:
    """Scope and settle the replica's damage now that batch `batch_id` has delivered the steps
    `new_seqs` and the counted drops `new_drops`.

    A range left open (the file was the replica's last) ends before the first segment that
    starts at or after it, or where a segment that runs into it ends (another copy of the
    torn segment, which holds those steps or reports its own torn tail); a range whose every
    sequence number is held (by a committed step, or counted as dropped) hides nothing and
    becomes `recovered`, its original kind and detail kept in the detail. Only damage this
    batch could change is looked at: its own, what it bounded, what its steps fall in."""
    open_rows = con.execute(
        f"SELECT {', '.join('d.' + field for field in DAMAGE_FIELDS)}, "
        "(SELECT min(s.first_seq) - 1 FROM segments s WHERE s.replica = $replica "
        " AND s.first_seq >= d.first_seq), "
        "(SELECT max(s.last_seq) FROM segments s WHERE s.replica = $replica "
        " AND s.first_seq < d.first_seq AND s.last_seq >= d.first_seq) "
        "FROM damage d WHERE d.last_seq IS NULL AND d.first_seq IS NOT NULL "
        "AND regexp_extract(d.path, '([^/]+)/[^/]*$', 1) = $replica",
        {"replica": replica},
    ).fetchall()
    bounded = set()
    for row in open_rows:
        damage, bounds = row[:DAMAGE_COLUMNS], row[DAMAGE_COLUMNS:]
        known = [bound for bound in bounds if bound is not None]
        if known:
            con.execute(
                f"UPDATE damage SET last_seq = ? WHERE {DAMAGE_ROW_IS}", [min(known), *damage]
            )
            bounded.add((*damage[:5], min(known), *damage[6:]))
    hiding = con.execute(
        f"SELECT {DAMAGE_ROW} FROM damage "
        "WHERE list_contains(?, kind) AND first_seq IS NOT NULL AND last_seq IS NOT NULL "
        "AND regexp_extract(path, '([^/]+)/[^/]*$', 1) = ?",
        [list(HIDING_DAMAGE), replica],
    ).fetchall()
    dropped: list[tuple[int, int]] | None = None
    for damage in hiding:
        kind, first, last, detail, found_by = damage[1], *damage[4:]
        if last < first:
            why = (
                f"it can hide no step: a segment held starts at seq {first}, where its range begins"
            )
        elif (
            found_by == batch_id
            or damage in bounded
            or new_seqs.is_between(first, last).any()
            or _dropped_within(new_drops, first, last)
        ):
            if dropped is None:
                dropped = con.execute(
                    "SELECT first_seq, last_seq FROM drops WHERE replica = ?", [replica]
                ).fetchall()
            # Steps and counted drops never share a sequence number, so their counts add up.
            held = _held_seqs(con, lake, replica, first, last).len()
            if held + _dropped_within(dropped, first, last) < last - first + 1:
                continue
            why = f"every step it could hide (seq {first}-{last}) is held"
        else:
            continue
        con.execute(
            f"UPDATE damage SET kind = 'recovered', detail = ? WHERE {DAMAGE_ROW_IS}",
            [f"{kind} ({detail}); {why}", *damage],
        )
