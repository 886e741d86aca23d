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

Every file is written under a temporary name and renamed into place, so a reader sees the
old file or the new one, never half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.attribution.ledger import STORED_TABLES, HourLedger, Invoice
from pipeline.ingestion.ingest import LAKE_TABLES, STEP_KEY, batch_of, partition_dir
from schemas.errors import DataError
from schemas.units import hour_key, hour_start_ns, utc_hour


@dataclass(frozen=True)
class HourInput:
    """The steps of one pool-hour with their slots and holders, as `load_hour` reads them."""

    steps: pl.DataFrame
    slots: pl.DataFrame
    holders: pl.DataFrame


class LakeFileChanged(DataError, RuntimeError):
    """A lake file's bytes differ from what was written, or it was added since."""


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def written_hashes(lake: Path, files: Iterable[Path]) -> dict[str, str]:
    """Path relative to the lake -> sha256 of files just written, for `verify` to check them
    against when they are read."""
    return {str(path.relative_to(lake)): sha256_of(path) for path in files}


def verify(lake: Path, files: list[Path], hashes: Mapping[str, str] | None) -> None:
    """Refuse `files` unless each one's sha256 is the one recorded when it was written
    (`hashes`: path relative to the lake -> sha256, e.g. the `lake_files` rows); None skips
    it. A lake written before hashes were recorded has none (an empty `hashes`) and is read
    unverified; once any is recorded, a file without one was added later and is refused."""
    if hashes is None:
        return
    for path in files:
        recorded = hashes.get(str(path.relative_to(lake)))
        if recorded is None and not hashes:
            continue
        if recorded is None:
            raise LakeFileChanged(
                f"{path}: no sha256 was recorded for this lake file when the lake was written: "
                "it was added since, so the hour is not billed from it (remove the file)"
            )
        found = sha256_of(path)
        if recorded != found:
            raise LakeFileChanged(
                f"{path}: sha256 {found}, but it was written as {recorded}: the lake file was "
                "changed after it was written, so the hour is not billed from it (run the hour "
                "again; for a step-log file, restore it or re-ingest the outbox into a fresh lake)"
            )


def _partition_files(
    lake: Path,
    table: str,
    pool: str,
    hour: datetime,
    batches: Collection[str] | None,
    hashes: Mapping[str, str] | None = None,
) -> list[Path]:
    files = _committed_files(partition_dir(lake, table, pool, hour_key(hour)), batches)
    verify(lake, files, hashes)
    return files


def _committed_files(directory: Path, batches: Collection[str] | None) -> list[Path]:
    files = sorted(directory.glob("*.parquet")) if directory.is_dir() else []
    return files if batches is None else [f for f in files if batch_of(f) in batches]


def _replica_of(part: Path) -> str:
    # pipeline.ingestion.ingest.part_name: <replica>.<first seq>.<batch>.parquet
    return part.name.rsplit(".", 3)[0]


def _frame(table: pa.Table) -> pl.DataFrame:
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)  # a Table, not an Array, becomes a DataFrame
    return frame


def _read(files: list[Path], table: str, columns: list[str] | None = None) -> pl.DataFrame:
    if not files:
        empty = _frame(LAKE_TABLES[table].empty_table())
        return empty if columns is None else empty.select(columns)
    # glob=False: a data directory's path may hold "[" or "*", which are not patterns here.
    return pl.read_parquet(files, columns=columns, glob=False)


def _read_partition(
    lake: Path,
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
        return _read(files, table, columns)
    scan = pl.scan_parquet(files, glob=False).filter(where)
    return (scan if columns is None else scan.select(columns)).collect()


def load_hour(
    lake: Path,
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
        earlier = _read([], table, keyed_columns)
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
                _read([f for f in current if _replica_of(f) == replica], table, table_columns),
            )
        ]
        return pl.concat(frames) if frames else _read([], table, table_columns)

    return HourInput(
        # LAKE_TABLES lists steps, slots and holders, in HourInput's order.
        *(ordered(table) if table in tables else _read([], table) for table in LAKE_TABLES)
    )


def last_seq_before(
    lake: Path, pool: str, hour: datetime, batches: Collection[str] | None = None
) -> dict[str, int]:
    """Each replica's last sequence number in the previous hour's partition (of `batches`, as
    in `load_hour`)."""
    previous = _read_partition(lake, "steps", pool, utc_hour(hour) - timedelta(hours=1), batches)
    last = previous.group_by("replica").agg(pl.col("seq").max())
    return dict(zip(last["replica"].to_list(), last["seq"].to_list(), strict=True))


def steps_of_other_hours(
    lake: Path, pool: str, attributed: Collection[str], batches: Collection[str] | None = None
) -> pl.DataFrame:
    """`replica`, `seq` and `hour` (its key) of the pool's steps in every hour partition whose
    key is not in `attributed` (of `batches`, as in `load_hour`). Once the hours are attributed
    in order this is only the partitions of hours still to come, so it reads little."""
    root = partition_dir(lake, "steps", pool, "").parent
    frames = [
        _read(files, "steps", ["replica", "seq"]).with_columns(hour=pl.lit(key))
        for directory in sorted(root.glob("hour=*"))
        if (key := directory.name.removeprefix("hour=")) not in attributed
        and (files := _committed_files(directory, batches))
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


def inputs_path(lake: Path, pool: str, hour: datetime) -> Path:
    return lake / "inputs" / f"pool={pool}" / f"hour={hour_key(hour)}" / "inputs.parquet"


_INPUTS_KEY = b"stepledger.inputs"


def save_inputs(lake: Path, inputs: AttributionInputs) -> Path:
    """One Parquet file (the context rows, the rest in its metadata), replaced atomically."""
    path = inputs_path(lake, inputs.pool, inputs.hour)
    path.parent.mkdir(parents=True, exist_ok=True)
    described = {
        "batches": sorted(inputs.batches),
        "engine": list(inputs.engine) if inputs.engine else None,
        "lake_hashes": dict(inputs.lake_hashes),
    }
    table = inputs.context.to_arrow()
    partial = path.with_suffix(".parquet.partial")
    pq.write_table(
        table.replace_schema_metadata(
            {**(table.schema.metadata or {}), _INPUTS_KEY: json.dumps(described)}
        ),
        partial,
    )
    os.replace(partial, path)
    return path


def load_inputs(
    lake: Path, pool: str, hour: datetime, hashes: Mapping[str, str] | None = None
) -> AttributionInputs:
    """The inputs `save_inputs` wrote, verified against `hashes` (`verify`) when given."""
    hour = utc_hour(hour)
    path = inputs_path(lake, pool, hour)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no attribution inputs for pool {pool!r} hour {hour_key(hour)}; "
            "materialize its request_context first"
        )
    verify(lake, [path], hashes)
    table = pq.read_table(path)
    described = json.loads(table.schema.metadata[_INPUTS_KEY])
    return AttributionInputs(
        hour,
        pool,
        frozenset(described["batches"]),
        _frame(table),
        tuple(described["engine"]) if described["engine"] else None,
        described["lake_hashes"],
    )


def ledger_dir(lake: Path, pool: str, hour: datetime) -> Path:
    return lake / "ledger" / f"pool={pool}" / f"hour={hour_key(hour)}"


def save_ledger(lake: Path, ledger: HourLedger) -> Path:
    """Write an hour's ledger to the lake (replacing an earlier attribution of the hour)."""
    directory = ledger_dir(lake, ledger.pool, ledger.hour)
    directory.mkdir(parents=True, exist_ok=True)
    for name in STORED_TABLES:
        partial = directory / f"{name}.parquet.partial"
        getattr(ledger, name).write_parquet(partial)
        partial.replace(directory / f"{name}.parquet")
    return directory


def ledger_files(lake: Path, pool: str, hour: datetime) -> list[Path]:
    directory = ledger_dir(lake, pool, utc_hour(hour))
    return [directory / f"{name}.parquet" for name in STORED_TABLES]


def load_ledger(
    lake: Path, pool: str, hour: datetime, hashes: Mapping[str, str] | None = None
) -> HourLedger:
    """The ledger `save_ledger` wrote, verified against `hashes` (`verify`) when given."""
    hour = utc_hour(hour)
    files = ledger_files(lake, pool, hour)
    missing = [f.stem for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(
            f"{ledger_dir(lake, pool, hour)}: no ledger tables {missing} for pool {pool!r} "
            f"hour {hour_key(hour)}"
        )
    verify(lake, files, hashes)
    frames = {f.stem: pl.read_parquet(f, glob=False) for f in files}
    invoice = Invoice.from_frame(frames.pop("invoices"))
    return HourLedger(hour=hour, pool=pool, invoice=invoice, **frames)
