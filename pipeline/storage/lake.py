"""The Parquet lake: its layout, every read of it, and the writes of an hour's inputs and
ledger (`pipeline.ingestion.ingest` writes the step log).

    steps|slots|holders/pool=<pool>/hour=<YYYY-MM-DDTHH>/<replica>.<first seq>.<batch>.parquet
        the decoded step log, as `pipeline.ingestion.ingest` places it (each step in the hour it starts)
    inputs/pool=<pool>/hour=<hour>/inputs.parquet
        what attributing the hour read from the warehouse (`AttributionInputs`), so that the
        attribution runs without the DuckDB file
    ledger/pool=<pool>/hour=<hour>/<table>.parquet
        the hour's ledger (`pipeline.attribution.ledger.HourLedger`) before it is published

Ingest records each step-log file's sha256 (`lake_files`); the pool-hour's steps record the
sha256 of the inputs and ledger files they write (assets.pool_hour). Each file is verified
against its hash where it is read to bill the hour, so a file rewritten or added since it was
written fails the hour instead of billing it.

Every file is written under a temporary name and renamed into place (on an object store, in
one PUT), so a reader sees the old file or the new one, never half of one. The files are read
and written through `Lake`, over a `pyarrow.fs` file system: a local directory (a `Path`, as
every caller passes today) or an object store's prefix (`s3://bucket/prefix`, credentials from
the environment or the instance role only).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import polars as pl
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.attribution.ledger import STORED_TABLES, HourLedger, Invoice
from pipeline.ingestion.ingest import LAKE_TABLES, STEP_KEY, batch_of, partition_dir
from schemas.errors import ConfigError, DataError
from schemas.units import hour_key, hour_start_ns, utc_hour


@dataclass(frozen=True)
class HourInput:
    """The steps of one pool-hour with their slots and holders, as `load_hour` reads them."""

    steps: pl.DataFrame
    slots: pl.DataFrame
    holders: pl.DataFrame


@dataclass(frozen=True)
class Lake:
    """The lake's root on a `pyarrow.fs` file system. A lake file is named by its path in that
    file system, as a `Path` (a real one for a local lake), so the functions below take and
    return the same values for a local lake and a store's."""

    filesystem: pafs.FileSystem
    root: Path

    @classmethod
    def at(cls, location: LakeLocation) -> Lake:
        """The lake at a directory, at `s3://bucket/prefix` (or any URI pyarrow opens), or
        `location` itself when it is a `Lake`."""
        if isinstance(location, Lake):
            return location
        if isinstance(location, Path) or "://" not in location:
            return cls(pafs.LocalFileSystem(), Path(location))
        parts = urlsplit(location)
        if parts.username or parts.password or "key=" in parts.query or "token=" in parts.query:
            raise ConfigError(
                f"lake {parts.scheme}://{parts.hostname}{parts.path}: the URI carries "
                "credentials; give them through the environment or the instance role"
            )
        try:
            filesystem, root = pafs.FileSystem.from_uri(location)
        except (OSError, ValueError) as err:
            raise ConfigError(f"lake {location}: not a location pyarrow can open: {err}") from err
        return cls(filesystem, Path(root))

    @property
    def local(self) -> bool:
        return isinstance(self.filesystem, pafs.LocalFileSystem)

    def is_file(self, path: Path) -> bool:
        if self.local:
            return path.is_file()
        return bool(self.filesystem.get_file_info(str(path)).type == pafs.FileType.File)

    def files(self, directory: Path, suffix: str = ".parquet") -> list[Path]:
        """The files of `directory` whose names end in `suffix`, by name; none when it is
        not there."""
        if self.local:
            return sorted(directory.glob(f"*{suffix}")) if directory.is_dir() else []
        return sorted(
            Path(info.path)
            for info in self._listing(directory)
            if info.type == pafs.FileType.File and info.path.endswith(suffix)
        )

    def directories(self, directory: Path, prefix: str) -> list[Path]:
        """The subdirectories of `directory` whose names start with `prefix`, by name."""
        if self.local:
            return sorted(d for d in directory.glob(f"{prefix}*") if d.is_dir())
        return sorted(
            Path(info.path)
            for info in self._listing(directory)
            if info.type == pafs.FileType.Directory and info.base_name.startswith(prefix)
        )

    def _listing(self, directory: Path) -> list[pafs.FileInfo]:
        selector = pafs.FileSelector(str(directory), allow_not_found=True)
        return list(self.filesystem.get_file_info(selector))

    def read_bytes(self, path: Path) -> bytes:
        if self.local:
            return path.read_bytes()
        with self.filesystem.open_input_stream(str(path)) as stream:
            return bytes(stream.read())

    def write_bytes(self, path: Path, data: bytes) -> None:
        """Publish `data` at `path` whole: a local file through a temporary name and a rename,
        an object in one PUT (a reader never lists a half-written object)."""
        if not self.local:
            with self.filesystem.open_output_stream(str(path)) as stream:
                stream.write(data)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_bytes(data)
        os.replace(partial, path)

    def sha256(self, path: Path) -> str:
        return sha256_of(path) if self.local else hashlib.sha256(self.read_bytes(path)).hexdigest()

    def relative(self, path: Path) -> str:
        return str(PurePosixPath(path).relative_to(PurePosixPath(self.root)))

    def read_parquet(self, files: list[Path], columns: list[str] | None = None) -> pl.DataFrame:
        """Files of one table, concatenated in order."""
        if self.local:
            # glob=False: a data directory's path may hold "[" or "*", not patterns here.
            return pl.read_parquet(files, columns=columns, glob=False)
        frames = [
            pl.read_parquet(io.BytesIO(self.read_bytes(path)), columns=columns) for path in files
        ]
        return pl.concat(frames)


# A lake's location: its local directory, an object store URI, or the lake itself.
LakeLocation = Path | str | Lake


class LakeFileChanged(DataError, RuntimeError):
    """A lake file's bytes differ from what was written, or it was added since."""


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def written_hashes(lake: LakeLocation, files: Iterable[Path]) -> dict[str, str]:
    """Path relative to the lake -> sha256 of files just written, for `verify` to check them
    against when they are read."""
    store = Lake.at(lake)
    return {store.relative(path): store.sha256(path) for path in files}


def verify(lake: LakeLocation, files: list[Path], hashes: Mapping[str, str] | None) -> None:
    """Refuse `files` unless each one's sha256 is the one recorded when it was written
    (`hashes`: path relative to the lake -> sha256, e.g. the `lake_files` rows); None skips
    it. A lake written before hashes were recorded has none (an empty `hashes`) and is read
    unverified; once any is recorded, a file without one was added later and is refused."""
    if hashes is None:
        return
    store = Lake.at(lake)
    for path in files:
        recorded = hashes.get(store.relative(path))
        if recorded is None and not hashes:
            continue
        if recorded is None:
            raise LakeFileChanged(
                f"{path}: no sha256 was recorded for this lake file when the lake was written: "
                "it was added since, so the hour is not billed from it (remove the file)"
            )
        found = store.sha256(path)
        if recorded != found:
            raise LakeFileChanged(
                f"{path}: sha256 {found}, but it was written as {recorded}: the lake file was "
                "changed after it was written, so the hour is not billed from it (run the hour "
                "again; for a step-log file, restore it or re-ingest the outbox into a fresh lake)"
            )


def _partition_files(
    lake: Lake,
    table: str,
    pool: str,
    hour: datetime,
    batches: Collection[str] | None,
    hashes: Mapping[str, str] | None = None,
) -> list[Path]:
    files = _committed_files(lake, partition_dir(lake.root, table, pool, hour_key(hour)), batches)
    verify(lake, files, hashes)
    return files


def _committed_files(lake: Lake, directory: Path, batches: Collection[str] | None) -> list[Path]:
    files = lake.files(directory)
    return files if batches is None else [f for f in files if batch_of(f) in batches]


def _replica_of(part: Path) -> str:
    # pipeline.ingestion.ingest.part_name: <replica>.<first seq>.<batch>.parquet
    return part.name.rsplit(".", 3)[0]


def _frame(table: pa.Table) -> pl.DataFrame:
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)  # a Table, not an Array, becomes a DataFrame
    return frame


def _read(
    lake: Lake, files: list[Path], table: str, columns: list[str] | None = None
) -> pl.DataFrame:
    if not files:
        empty = _frame(LAKE_TABLES[table].empty_table())
        return empty if columns is None else empty.select(columns)
    return lake.read_parquet(files, columns)


def _read_partition(
    lake: Lake,
    table: str,
    pool: str,
    hour: datetime,
    batches: Collection[str] | None,
    where: pl.Expr | None = None,
    columns: list[str] | None = None,
    hashes: Mapping[str, str] | None = None,
) -> pl.DataFrame:
    """A lake partition, or the rows of it matching `where` (Parquet row-group statistics let
    the scan skip the rest, so a few rows of a previous hour cost little)."""
    files = _partition_files(lake, table, pool, hour, batches, hashes)
    if where is None or not files:
        return _read(lake, files, table, columns)
    # On a store the files are read whole: the filter keeps the same rows in the same order.
    scan = (
        pl.scan_parquet(files, glob=False) if lake.local else lake.read_parquet(files).lazy()
    ).filter(where)
    return (scan if columns is None else scan.select(columns)).collect()


def load_hour(
    lake: LakeLocation,
    pool: str,
    hour: datetime,
    batches: Collection[str] | None = None,
    columns: list[str] | None = None,
    hashes: Mapping[str, str] | None = None,
    tables: Collection[str] = tuple(LAKE_TABLES),
) -> HourInput:
    """The steps of `pool` that ran during `hour`, with their slots and holders, ordered by
    replica and sequence number (so attribution need not sort tens of millions of rows).

    `batches`: the ingest batches to read (`pipeline.ingestion.ingest.committed_batches`), so that the
    files of a batch still being ingested, or of one that died before its commit, are not
    read; None reads every file in the lake. `columns`: only these columns of each table (the
    ones it has; the step key is read where the selection needs it, and kept only if asked
    for); None reads them all. `hashes`: each file read is verified against them (`verify`).
    `tables`: the tables to read; the others are returned empty."""
    lake = Lake.at(lake)
    hour = utc_hour(hour)
    previous = hour - timedelta(hours=1)
    straddling_keys = _read_partition(
        lake,
        "steps",
        pool,
        previous,
        batches,
        pl.col("end_utc_ns") > hour_start_ns(hour),
        hashes=hashes,
    ).select(STEP_KEY)

    def ordered(table: str) -> pl.DataFrame:
        # Per replica: its rows of straddling steps, then its files of this hour. Rows of the
        # hour's own files all belong to its steps (ingest placed them with their step).
        table_columns = (
            None if columns is None else [c for c in columns if c in LAKE_TABLES[table].names]
        )
        keyed_columns = (
            None if table_columns is None else list(dict.fromkeys([*STEP_KEY, *table_columns]))
        )
        earlier = _read(lake, [], table, keyed_columns)
        if straddling_keys.height:
            # Sequence numbers grow within a replica: the scan skips all but the last row groups
            # of the previous hour, and the join on the step keys makes the selection exact.
            after = pl.col("seq") >= straddling_keys["seq"].min()
            earlier = _read_partition(
                lake, table, pool, previous, batches, after, keyed_columns, hashes
            ).join(straddling_keys, on=STEP_KEY, how="semi")
        current = _partition_files(lake, table, pool, hour, batches, hashes)
        replicas = sorted({*earlier["replica"].unique().to_list(), *map(_replica_of, current)})
        frames = [
            frame
            for replica in replicas
            for frame in (
                earlier.filter(pl.col("replica") == replica).select(
                    earlier.columns if table_columns is None else table_columns
                ),
                _read(
                    lake, [f for f in current if _replica_of(f) == replica], table, table_columns
                ),
            )
        ]
        return pl.concat(frames) if frames else _read(lake, [], table, table_columns)

    return HourInput(
        # LAKE_TABLES lists steps, slots and holders, in HourInput's order.
        *(ordered(table) if table in tables else _read(lake, [], table) for table in LAKE_TABLES)
    )


def last_seq_before(
    lake: LakeLocation, pool: str, hour: datetime, batches: Collection[str] | None = None
) -> dict[str, int]:
    """Each replica's last sequence number in the previous hour's partition (of `batches`, as
    in `load_hour`)."""
    previous = _read_partition(
        Lake.at(lake), "steps", pool, utc_hour(hour) - timedelta(hours=1), batches
    )
    last = previous.group_by("replica").agg(pl.col("seq").max())
    return dict(zip(last["replica"].to_list(), last["seq"].to_list(), strict=True))


def steps_of_other_hours(
    lake: LakeLocation,
    pool: str,
    attributed: Collection[str],
    batches: Collection[str] | None = None,
) -> pl.DataFrame:
    """`replica`, `seq` and `hour` (its key) of the pool's steps in every hour partition whose
    key is not in `attributed` (of `batches`, as in `load_hour`). Once the hours are attributed
    in order this is only the partitions of hours still to come, so it reads little."""
    store = Lake.at(lake)
    root = partition_dir(store.root, "steps", pool, "").parent
    frames = [
        _read(store, files, "steps", ["replica", "seq"]).with_columns(hour=pl.lit(key))
        for directory in store.directories(root, "hour=")
        if (key := directory.name.removeprefix("hour=")) not in attributed
        and (files := _committed_files(store, directory, batches))
    ]
    if not frames:
        return pl.DataFrame(schema={"replica": pl.String, "seq": pl.Int64, "hour": pl.String})
    return pl.concat(frames)


@dataclass(frozen=True)
class AttributionInputs:
    """What attributing a pool-hour reads from the warehouse, taken in one short step that holds
    the DuckDB file, so the attribution itself runs without it (and pool-hours in parallel)."""

    hour: datetime
    pool: str
    batches: frozenset[str]  # the ingest batches committed when the inputs were taken
    context: pl.DataFrame  # request_context rows of the hour's requests
    # (engine_version, driver_version) that logged most of the pool's steps; None before any segment
    engine: tuple[str, str] | None
    # sha256 of every lake file of the hour and the one before, as ingest wrote them
    lake_hashes: Mapping[str, str] = field(default_factory=dict)


def inputs_path(lake: LakeLocation, pool: str, hour: datetime) -> Path:
    return (
        Lake.at(lake).root / "inputs" / f"pool={pool}" / f"hour={hour_key(hour)}" / "inputs.parquet"
    )


_INPUTS_KEY = b"stepledger.inputs"


def save_inputs(lake: LakeLocation, inputs: AttributionInputs) -> Path:
    """One Parquet file (the context rows, the rest in its metadata), replaced atomically."""
    path = inputs_path(lake, inputs.pool, inputs.hour)
    described = {
        "batches": sorted(inputs.batches),
        "engine": list(inputs.engine) if inputs.engine else None,
        "lake_hashes": dict(inputs.lake_hashes),
    }
    table = inputs.context.to_arrow()
    encoded = pa.BufferOutputStream()
    pq.write_table(
        table.replace_schema_metadata(
            {**(table.schema.metadata or {}), _INPUTS_KEY: json.dumps(described)}
        ),
        encoded,
    )
    Lake.at(lake).write_bytes(path, encoded.getvalue().to_pybytes())
    return path


def load_inputs(
    lake: LakeLocation, pool: str, hour: datetime, hashes: Mapping[str, str] | None = None
) -> AttributionInputs:
    """The inputs `save_inputs` wrote, verified against `hashes` (`verify`) when given."""
    hour = utc_hour(hour)
    store = Lake.at(lake)
    path = inputs_path(store, pool, hour)
    if not store.is_file(path):
        raise FileNotFoundError(
            f"{path}: no attribution inputs for pool {pool!r} hour {hour_key(hour)}; "
            "materialize its request_context first"
        )
    verify(store, [path], hashes)
    table = pq.read_table(pa.BufferReader(store.read_bytes(path)))
    described = json.loads(table.schema.metadata[_INPUTS_KEY])
    return AttributionInputs(
        hour,
        pool,
        frozenset(described["batches"]),
        _frame(table),
        tuple(described["engine"]) if described["engine"] else None,
        described["lake_hashes"],
    )


def ledger_dir(lake: LakeLocation, pool: str, hour: datetime) -> Path:
    return Lake.at(lake).root / "ledger" / f"pool={pool}" / f"hour={hour_key(hour)}"


def save_ledger(lake: LakeLocation, ledger: HourLedger) -> Path:
    """Write an hour's ledger to the lake (replacing an earlier attribution of the hour)."""
    store = Lake.at(lake)
    directory = ledger_dir(store, ledger.pool, ledger.hour)
    for name in STORED_TABLES:
        encoded = io.BytesIO()
        getattr(ledger, name).write_parquet(encoded)
        store.write_bytes(directory / f"{name}.parquet", encoded.getvalue())
    return directory


def ledger_files(lake: LakeLocation, pool: str, hour: datetime) -> list[Path]:
    directory = ledger_dir(lake, pool, utc_hour(hour))
    return [directory / f"{name}.parquet" for name in STORED_TABLES]


def load_ledger(
    lake: LakeLocation, pool: str, hour: datetime, hashes: Mapping[str, str] | None = None
) -> HourLedger:
    """The ledger `save_ledger` wrote, verified against `hashes` (`verify`) when given."""
    hour = utc_hour(hour)
    store = Lake.at(lake)
    files = ledger_files(store, pool, hour)
    missing = [f.stem for f in files if not store.is_file(f)]
    if missing:
        raise FileNotFoundError(
            f"{ledger_dir(store, pool, hour)}: no ledger tables {missing} for pool {pool!r} "
            f"hour {hour_key(hour)}"
        )
    verify(store, files, hashes)
    frames = {f.stem: store.read_parquet([f]) for f in files}
    invoice = Invoice.from_frame(frames.pop("invoices"))
    return HourLedger(hour=hour, pool=pool, invoice=invoice, **frames)
