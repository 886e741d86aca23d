"""One pool-hour end to end, as plain functions: the Dagster assets call these, so do the
benchmark and anyone scripting the pipeline without Dagster.

    load_hour      the hour's steps, slots and holders from the lake (plus steps that started
                   in the previous hour and ran into this one)
    gather_inputs  what the attribution needs from the warehouse (committed batches, the
                   context of the hour's requests, the engine version), saved to the lake
                   with save_inputs, so that charge_hour runs without the DuckDB file
    charge_hour    attribution -> the hour's charges (saved to the lake with save_charges)
    publish_hour   the charges into the warehouse, replacing the hour exactly
    reconcile_hour the hour's checks, recorded in the warehouse
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import duckdb
import polars as pl
import pyarrow.parquet as pq

from pipeline.context import context_for_requests
from pipeline.ingest import LAKE_TABLES, STEP_KEY, batch_of, committed_batches, partition_dir
from pipeline.warehouse import (
    HOUR_TABLES,
    hour_key,
    query_frame,
    record_checks,
    replace_hour,
    utc_hour,
)
from schemas.config import Pool, Settings


@dataclass(frozen=True)
class HourInput:
    steps: pl.DataFrame
    slots: pl.DataFrame
    holders: pl.DataFrame


@dataclass(frozen=True)
class HourCharges:
    """What one pool-hour costs, ready for the warehouse tables of the same names."""

    hour: datetime
    pool: str
    invoices: pl.DataFrame  # one row
    ledger_lines: pl.DataFrame
    request_costs: pl.DataFrame

    @property
    def amount_nano(self) -> int:
        return int(self.invoices["amount_nano"][0])


def _partition_files(
    lake: Path, table: str, pool: str, hour: datetime, batches: Collection[str] | None
) -> list[Path]:
    directory = partition_dir(lake, table, pool, hour_key(hour))
    files = sorted(directory.glob("*.parquet")) if directory.is_dir() else []
    return files if batches is None else [f for f in files if batch_of(f) in batches]


def _replica_of(part: Path) -> str:
    # pipeline.ingest.part_name: <replica>.<first seq>.<batch>.parquet
    return part.name.rsplit(".", 3)[0]


def _read(files: list[Path], table: str, columns: list[str] | None = None) -> pl.DataFrame:
    if not files:
        empty = pl.from_arrow(LAKE_TABLES[table].empty_table())
        return empty if columns is None else empty.select(columns)
    return pl.read_parquet(files, columns=columns)


def _read_partition(
    lake: Path,
    table: str,
    pool: str,
    hour: datetime,
    batches: Collection[str] | None,
    where: pl.Expr | None = None,
    columns: list[str] | None = None,
) -> pl.DataFrame:
    """A lake partition, or the rows of it matching `where` (Parquet row-group statistics let
    the scan skip the rest, so a few rows of a previous hour cost little)."""
    files = _partition_files(lake, table, pool, hour, batches)
    if where is None or not files:
        return _read(files, table, columns)
    scan = pl.scan_parquet(files).filter(where)
    return (scan if columns is None else scan.select(columns)).collect()


def load_hour(
    lake: Path,
    pool: str,
    hour: datetime,
    batches: Collection[str] | None = None,
    columns: list[str] | None = None,
) -> HourInput:
    """The steps of `pool` that ran during `hour`, with their slots and holders, ordered by
    replica and sequence number (so attribution need not sort tens of millions of rows).

    `batches`: the ingest batches to read (`pipeline.ingest.committed_batches`), so that the
    files of a batch still being ingested, or of one that died before its commit, are not
    read; None reads every file in the lake. `columns`: only these columns of each table (the
    ones it has; they must include the step key); None reads them all."""
    hour = utc_hour(hour)
    previous = hour - timedelta(hours=1)
    hour_start_ns = int(hour.timestamp()) * 1_000_000_000
    straddling_keys = _read_partition(
        lake, "steps", pool, previous, batches, pl.col("end_utc_ns") > hour_start_ns
    ).select(STEP_KEY)

    def ordered(table: str) -> pl.DataFrame:
        # Per replica: its rows of straddling steps, then its files of this hour. Rows of the
        # hour's own files all belong to its steps (ingest placed them with their step).
        table_columns = (
            None if columns is None else [c for c in columns if c in LAKE_TABLES[table].names]
        )
        earlier = _read([], table, table_columns)
        if straddling_keys.height:
            # Sequence numbers grow within a replica: the scan skips all but the last row groups
            # of the previous hour, and the join on the step keys makes the selection exact.
            after = pl.col("seq") >= straddling_keys["seq"].min()
            earlier = _read_partition(
                lake, table, pool, previous, batches, after, table_columns
            ).join(straddling_keys, on=STEP_KEY, how="semi")
        current = _partition_files(lake, table, pool, hour, batches)
        replicas = sorted({*earlier["replica"].unique().to_list(), *map(_replica_of, current)})
        frames = [
            frame
            for replica in replicas
            for frame in (
                earlier.filter(pl.col("replica") == replica),
                _read([f for f in current if _replica_of(f) == replica], table, table_columns),
            )
        ]
        return pl.concat(frames) if frames else _read([], table, table_columns)

    return HourInput(steps=ordered("steps"), slots=ordered("slots"), holders=ordered("holders"))


CALIBRATION_FILE = "calibration.yaml"


@functools.cache
def _kernel_weights(pool_json: str):
    # Keyed by the pool's JSON (Pool holds lists, so it is not hashable): building a kernel
    # costs more than attributing a quiet hour.
    from pipeline.attribution import KernelWeights

    return KernelWeights.for_pool(Pool.model_validate_json(pool_json))


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


def gather_inputs(
    con: duckdb.DuckDBPyConnection, lake: Path, pool: Pool, hour: datetime
) -> AttributionInputs:
    """The hour's attribution inputs, read from the warehouse and the lake."""
    hour = utc_hour(hour)
    batches = committed_batches(con)
    keys = [*STEP_KEY, "request_id"]
    requests = load_hour(lake, pool.name, hour, batches, columns=keys)
    request_ids = pl.concat([requests.slots["request_id"], requests.holders["request_id"]]).unique()
    # fetchall, not fetchone: a result left unfinished blocks the connection's next query.
    logged = con.execute(
        "SELECT engine_version, driver_version FROM segments WHERE pool = ? "
        "GROUP BY ALL ORDER BY sum(steps) DESC, engine_version, driver_version LIMIT 1",
        [pool.name],
    ).fetchall()
    return AttributionInputs(
        hour,
        pool.name,
        frozenset(batches),
        context_for_requests(con, request_ids),
        tuple(logged[0]) if logged else None,
    )


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


def load_inputs(lake: Path, pool: str, hour: datetime) -> AttributionInputs:
    hour = utc_hour(hour)
    path = inputs_path(lake, pool, hour)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no attribution inputs for pool {pool!r} hour {hour_key(hour)}; "
            "materialize its request_context first"
        )
    table = pq.read_table(path)
    described = json.loads(table.schema.metadata[_INPUTS_KEY])
    return AttributionInputs(
        hour,
        pool,
        frozenset(described["batches"]),
        pl.from_arrow(table),
        tuple(described["engine"]) if described["engine"] else None,
    )


def weight_source(pool: Pool, inputs: AttributionInputs, data_dir: Path):
    """The pool's work weights: the pricing kernel, or (policy `fitted`) the coefficients
    calibrated for the engine and driver version that logged most of the pool's steps, from
    `<data_dir>/calibration.yaml`."""
    if pool.policies.weights == "kernel":
        return _kernel_weights(pool.model_dump_json())
    from pipeline.attribution import CalibrationStore, FittedWeights

    if inputs.engine is None:
        raise ValueError(
            f"pool {pool.name!r}: no segments ingested, so no engine version to calibrate for"
        )
    store = CalibrationStore.load(data_dir / CALIBRATION_FILE)
    return FittedWeights(store.require(pool.model, pool.gpu_type, *inputs.engine))


def charge_hour(lake: Path, pool: Pool, inputs: AttributionInputs, weights) -> HourCharges:
    """Attribute one pool-hour: the hour's steps of the committed batches, their requests'
    context, the pool's policies. Reads only the lake."""
    from pipeline.attribution import attribute_hour

    if inputs.pool != pool.name:
        raise ValueError(f"attribution inputs of pool {inputs.pool!r} given for pool {pool.name!r}")
    data = load_hour(lake, pool.name, inputs.hour, inputs.batches)
    # Every row is of this pool: without the constant column the attribution's joins copy less.
    slots, holders = data.slots.drop("pool"), data.holders.drop("pool")
    ledger = attribute_hour(inputs.hour, pool, data.steps, slots, holders, inputs.context, weights)
    return charges_from_ledger(inputs.hour, pool.name, ledger)


def charges_from_ledger(hour: datetime, pool: str, ledger) -> HourCharges:
    """The attribution's HourLedger as warehouse rows, each stamped with its hour and pool."""
    stamp = [
        pl.lit(hour.replace(tzinfo=None)).cast(pl.Datetime("us")).alias("hour"),
        pl.lit(pool).alias("pool"),
    ]
    invoice = pl.DataFrame([ledger.invoice]).with_columns(stamp)
    return HourCharges(
        hour=hour,
        pool=pool,
        invoices=invoice,
        ledger_lines=ledger.ledger_lines.with_columns(stamp),
        request_costs=ledger.request_costs.with_columns(stamp),
    )


def charges_dir(lake: Path, pool: str, hour: datetime) -> Path:
    return lake / "charges" / f"pool={pool}" / f"hour={hour_key(hour)}"


def save_charges(lake: Path, charges: HourCharges) -> Path:
    """Write an hour's charges to the lake (replacing an earlier attribution of the hour)."""
    directory = charges_dir(lake, charges.pool, charges.hour)
    directory.mkdir(parents=True, exist_ok=True)
    for name in HOUR_TABLES:
        partial = directory / f"{name}.parquet.partial"
        getattr(charges, name).write_parquet(partial)
        partial.replace(directory / f"{name}.parquet")
    return directory


def load_charges(lake: Path, pool: str, hour: datetime) -> HourCharges:
    hour = utc_hour(hour)
    directory = charges_dir(lake, pool, hour)
    missing = [n for n in HOUR_TABLES if not (directory / f"{n}.parquet").is_file()]
    if missing:
        raise FileNotFoundError(
            f"{directory}: no charges {missing} for pool {pool!r} hour {hour_key(hour)}"
        )
    frames = {name: pl.read_parquet(directory / f"{name}.parquet") for name in HOUR_TABLES}
    return HourCharges(hour=hour, pool=pool, **frames)


def publish_hour(con: duckdb.DuckDBPyConnection, charges: HourCharges) -> None:
    """Replace the hour's invoice, ledger lines and request costs in one transaction.

    Lines that do not add up to the invoice are still written: the money check then fails and
    holds the hour back from the finance views, with the difference in its detail.
    """
    replace_hour(
        con, charges.hour, charges.pool, {name: getattr(charges, name) for name in HOUR_TABLES}
    )


# The reconciliation checks run on every pool-hour (pipeline.reconcile says which block).
CHECKS = (
    "sequence",
    "time",
    "money",
    "plausibility",
    "unattributed",
    "calibration",
    "calibration_drift",
)


def _pool_rows(con: duckdb.DuckDBPyConnection, table: str, pool: Pool) -> pl.DataFrame:
    """A warehouse table's rows for the pool's replicas (damage by the replica outbox holding the file)."""
    if table == "damage":
        return query_frame(
            con,
            "SELECT * FROM damage WHERE list_contains(?, regexp_extract(path, '([^/]+)/[^/]*$', 1))",
            [[r.id for r in pool.replicas]],
        )
    return query_frame(con, f"SELECT * FROM {table} WHERE pool = ?", [pool.name])


def last_seq_before(
    lake: Path, pool: str, hour: datetime, batches: Collection[str] | None = None
) -> dict[str, int]:
    """Each replica's last sequence number in the previous hour's partition (of `batches`, as
    in `load_hour`)."""
    previous = _read_partition(lake, "steps", pool, utc_hour(hour) - timedelta(hours=1), batches)
    last = previous.group_by("replica").agg(pl.col("seq").max())
    return dict(zip(last["replica"].to_list(), last["seq"].to_list(), strict=True))


def check_calibration_of_hour(
    con: duckdb.DuckDBPyConnection,
    pool: Pool,
    hour: datetime,
    data: HourInput,
    settings: Settings,
    store,
) -> list:
    """The calibration check of one pool-hour: the engine and driver versions of the segments
    the hour's steps came from, against the calibration `store` (a CalibrationStore) and the
    engine release the pricing kernel's chip coefficients were measured on.

    A kernel-weights pool passes for the kernel's own release and for any version with a
    stored sweep; another version is a WARN (its charges stand, the kernel was not measured
    on it). A fitted-weights pool needs stored coefficients for every version (ERROR
    otherwise), and the hour's own steps are fitted afresh and compared with the stored fit
    of the version that logged most of them (`calibration_drift`). Kernel-weights pools get
    no drift row: their charges do not use the fit, and a linear fit's coefficients move with
    the workload's batch mix (a few minutes' sweep against a busy hour differ by over 10%),
    which would only warn about traffic."""
    from pipeline import reconcile
    from pipeline.attribution import CalibrationError, fit_coefficients
    from pricing import load_chip

    segment_ids = data.steps["segment_id"].unique()
    segments = _pool_rows(con, "segments", pool).filter(
        pl.col("segment_id").is_in(segment_ids.implode())
    )
    key_columns = ["model", "gpu_type", "engine_version", "driver_version"]
    versions = (
        segments.group_by(key_columns)
        .agg(pl.col("steps").sum(), pl.col("segment_id"))
        .sort("steps", *key_columns, descending=[True, False, False, False, False])
    )
    stored_fit = fresh_fit = None
    # Fit only the steps of the version that logged most of the hour among those with a
    # stored fit: other versions' steps would blur the fresh fit.
    calibrated = pool.policies.weights == "fitted" and next(
        (
            (version, stored)
            for version in versions.iter_rows(named=True)
            if (stored := store.lookup(*(version[c] for c in key_columns))) is not None
        ),
        None,
    )
    if calibrated:
        version, stored = calibrated
        steps = data.steps.filter(pl.col("segment_id").is_in(version["segment_id"]))
        slots = data.slots.join(steps.select("replica", "seq"), on=["replica", "seq"], how="semi")
        try:
            fresh = fit_coefficients(steps, slots).coefficients
        except CalibrationError:
            pass  # too few or too uniform steps in the hour to fit: no drift to measure
        else:
            stored_fit, fresh_fit = (
                {n: getattr(c, n) for n in ("c0_ms", "a_ms", "b_ms")} for c in (stored, fresh)
            )
    return reconcile.check_calibration(
        hour,
        pool,
        segments,
        [entry.key for entry in store.entries],
        settings,
        kernel_engine_version=load_chip(pool.gpu_type).measured_engine.version,
        stored_fit=stored_fit,
        fresh_fit=fresh_fit,
    )


def reconcile_hour(
    con: duckdb.DuckDBPyConnection,
    lake: Path,
    dcgm_dir: Path,
    pool: Pool,
    hour: datetime,
    settings: Settings,
    *,
    calibration_file: Path | None = None,
) -> list:
    """Run the CHECKS on one published pool-hour and record them (with alerts) in the warehouse.

    `calibration_file`: the calibration store (`<data dir>/calibration.yaml`); without one no
    engine version has been calibrated."""
    from pipeline import reconcile
    from pipeline.attribution import CalibrationStore
    from pipeline.dcgm import read_dcgm_hour

    hour = utc_hour(hour)
    batches = committed_batches(con)
    data = load_hour(lake, pool.name, hour, batches)
    steps = data.steps
    store = (
        CalibrationStore.load(calibration_file)
        if calibration_file is not None
        else CalibrationStore()
    )
    at_hour = [hour.replace(tzinfo=None), pool.name]
    invoices = query_frame(con, "SELECT * FROM invoices WHERE hour = ? AND pool = ?", at_hour)
    lines = query_frame(con, "SELECT * FROM ledger_lines WHERE hour = ? AND pool = ?", at_hour)
    results = [
        *reconcile.check_sequence(
            hour,
            pool,
            steps,
            _pool_rows(con, "drops", pool),
            _pool_rows(con, "damage", pool),
            _pool_rows(con, "segments", pool),
            last_seq_before=last_seq_before(lake, pool.name, hour, batches),
        ),
        *reconcile.check_time(hour, pool, steps, settings),
        *reconcile.check_money(hour, pool, invoices, lines),
        *reconcile.check_plausibility(hour, pool, steps, read_dcgm_hour(dcgm_dir, hour), settings),
        *reconcile.check_unattributed(hour, pool, lines),
        *check_calibration_of_hour(con, pool, hour, data, settings, store),
    ]
    record_checks(con, hour, pool.name, list(CHECKS), results)
    return results


def failed_checks(con: duckdb.DuckDBPyConnection, pool: str, hour: datetime) -> list:
    """The hour's failed reconciliation results, as pipeline.reconcile.CheckResult."""
    from pipeline.reconcile import CheckResult

    rows = query_frame(
        con,
        "SELECT hour, pool, replica, check_name, passed, expected, observed, detail, severity, blocking, finding "
        "FROM reconciliation WHERE hour = ? AND pool = ? AND NOT passed ORDER BY check_name, replica",
        [utc_hour(hour).replace(tzinfo=None), pool],
    )
    return [
        CheckResult(**{**row, "hour": row["hour"].replace(tzinfo=UTC)})
        for row in rows.iter_rows(named=True)
    ]
