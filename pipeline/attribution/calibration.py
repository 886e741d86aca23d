"""Calibration: fit c0, a, b by least squares on logged steps, and store them by version.

A calibration run logs steps over mixed prompt lengths and batch sizes; for each step

    step_ms ~ c0 + a x sum_i t_i + b x sum_i t_i (L_i + (t_i + 1) / 2)

is linear in (c0, a, b), so ordinary least squares over the steps recovers them. The fit is
for relative work, not latency: its residual says how well the model ranks slots, and R^2 is
reported so a poor calibration run is noticed before it reaches a bill.

Coefficients are stored per (model, GPU type, engine version, driver version): an engine or
driver upgrade changes kernel performance, so a log whose versions have no entry is reported
(`CalibrationMissing`, `calibration_coverage`) rather than silently priced with old numbers.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import yaml

from pipeline.attribution.workmodel import (
    Coefficients,
    FittedWeights,
    KernelWeights,
    WeightSource,
    attention_pairs,
)
from schemas.config import Pool
from schemas.errors import DataError
from schemas.units import NS_PER_MS

_KEY_FIELDS = ("model", "gpu_type", "engine_version", "driver_version")


class CalibrationError(DataError):
    """A calibration fit or store cannot be used; the message names the file, key or field."""


class CalibrationMissing(CalibrationError):
    """No stored coefficients for a log's model, GPU type, engine version and driver version."""


@dataclass(frozen=True)
class FitResult:
    """A least-squares fit of step time (ms) to the slots' work, with how well it fits."""

    coefficients: Coefficients
    r_squared: float
    rmse_ms: float  # root mean squared residual of step time
    n_steps: int
    mean_step_ms: float


def _step_features(steps: pl.DataFrame, slots: pl.DataFrame) -> pl.DataFrame:
    """Per step: measured ms, sum of new tokens, sum of attention pairs (steps with slots only)."""
    for frame, name, columns in (
        (steps, "steps", ("replica", "seq", "start_ns", "end_ns")),
        (slots, "slots", ("replica", "seq", "new_tokens", "context_tokens")),
    ):
        missing = [c for c in columns if c not in frame.columns]
        if missing:
            raise CalibrationError(f"{name} table lacks column(s) {missing}")
    per_slot = slots.select(
        "replica",
        "seq",
        pl.col("new_tokens").cast(pl.Float64).alias("tokens"),
        pl.Series(
            "pairs",
            attention_pairs(slots["new_tokens"].to_numpy(), slots["context_tokens"].to_numpy()),
        ),
    )
    per_step = per_slot.group_by("replica", "seq").agg(
        pl.col("tokens").sum(), pl.col("pairs").sum()
    )
    return steps.select(
        "replica",
        "seq",
        ((pl.col("end_ns") - pl.col("start_ns")).cast(pl.Float64) / NS_PER_MS).alias("step_ms"),
    ).join(per_step, on=["replica", "seq"], how="inner")


def fit_coefficients(steps: pl.DataFrame, slots: pl.DataFrame, *, version: str = "") -> FitResult:
    """Ordinary least squares of step time on (1, tokens, attention pairs) over the logged steps."""
    features = _step_features(steps, slots)
    n = features.height
    if n < 3:
        raise CalibrationError(f"need at least 3 steps with slots to fit 3 coefficients, got {n}")
    design = np.column_stack(
        [np.ones(n), features["tokens"].to_numpy(), features["pairs"].to_numpy()]
    )
    observed = features["step_ms"].to_numpy()
    if np.linalg.matrix_rank(design) < 3:
        raise CalibrationError(
            "calibration steps do not vary enough to separate c0, a and b: mix prompt lengths and batch sizes"
        )
    # Columns differ by orders of magnitude (1 vs 1e7 pairs); scaling keeps lstsq well conditioned.
    scale = np.abs(design).max(axis=0)
    solution, *_ = np.linalg.lstsq(design / scale, observed, rcond=None)
    c0_ms, a_ms, b_ms = solution / scale
    residual = observed - design @ (solution / scale)
    total_ss = float(((observed - observed.mean()) ** 2).sum())
    r_squared = 1.0 - float((residual**2).sum()) / total_ss if total_ss > 0 else 0.0
    negative = [
        name for name, value in (("c0_ms", c0_ms), ("a_ms", a_ms), ("b_ms", b_ms)) if value < 0
    ]
    if negative:
        raise CalibrationError(
            f"fit gave negative {negative} (c0={c0_ms:.6g}, a={a_ms:.6g}, b={b_ms:.6g} ms, R^2={r_squared:.3f}); "
            "the calibration run does not constrain the model: mix prompt lengths and batch sizes"
        )
    return FitResult(
        coefficients=Coefficients(float(c0_ms), float(a_ms), float(b_ms), version),
        r_squared=r_squared,
        rmse_ms=float(np.sqrt((residual**2).mean())),
        n_steps=n,
        mean_step_ms=float(observed.mean()),
    )


def relative_drift(stored: Coefficients, fresh: Coefficients) -> dict[str, float]:
    """|fresh - stored| / stored per coefficient (inf when a stored zero became non-zero)."""
    drift = {}
    for name in ("c0_ms", "a_ms", "b_ms"):
        before, after = getattr(stored, name), getattr(fresh, name)
        drift[name] = (
            abs(after - before) / before if before else (0.0 if after == before else float("inf"))
        )
    return drift


@dataclass(frozen=True)
class CalibrationEntry:
    """One stored fit: its key, coefficients (ms), version id and fit statistics."""

    model: str
    gpu_type: str
    engine_version: str
    driver_version: str
    c0_ms: float
    a_ms: float
    b_ms: float
    version: str
    fitted_at: str
    r_squared: float
    rmse_ms: float
    n_steps: int

    @property
    def key(self) -> tuple[str, str, str, str]:
        """(model, GPU type, engine version, driver version), the store's key."""
        return (self.model, self.gpu_type, self.engine_version, self.driver_version)

    @property
    def coefficients(self) -> Coefficients:
        """The stored coefficients, under their version id."""
        return Coefficients(self.c0_ms, self.a_ms, self.b_ms, self.version)


class CalibrationStore:
    """Coefficients keyed by (model, GPU type, engine version, driver version), in a JSON or YAML file.

    The file is `{"entries": [{model, gpu_type, engine_version, driver_version, c0_ms, a_ms,
    b_ms, version, fitted_at, r_squared, rmse_ms, n_steps}, ...]}`; `.json` is written as
    JSON, `.yaml`/`.yml` as YAML. A new fit for an existing key replaces it (the version id
    changes with the coefficients, so old ledger rows still name what they used).
    """

    def __init__(self, entries: list[CalibrationEntry] | None = None) -> None:
        self._entries: dict[tuple[str, str, str, str], CalibrationEntry] = {}
        for entry in entries or []:
            self._entries[entry.key] = entry

    @property
    def entries(self) -> list[CalibrationEntry]:
        """Every entry, sorted by key."""
        return sorted(self._entries.values(), key=lambda e: e.key)

    @classmethod
    def load(cls, path: str | Path) -> CalibrationStore:
        """The store in `path`; empty if the file is missing or empty."""
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return cls()
        except OSError as err:
            raise CalibrationError(
                f"{path}: cannot read calibration store: {err.strerror}"
            ) from err
        try:
            raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as err:
            raise CalibrationError(
                f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {err}"
            ) from err
        if raw is None:
            return cls()
        if not isinstance(raw, dict) or not isinstance(raw.get("entries"), list):
            raise CalibrationError(f"{path}: expected a mapping with an 'entries' list")
        entries = []
        fields = CalibrationEntry.__dataclass_fields__
        for index, item in enumerate(raw["entries"]):
            if not isinstance(item, dict):
                raise CalibrationError(f"{path}: entries[{index}] is not a mapping")
            missing = [name for name in fields if name not in item]
            unknown = [name for name in item if name not in fields]
            if missing or unknown:
                raise CalibrationError(
                    f"{path}: entries[{index}]: missing {missing}, unknown {unknown}"
                )
            try:
                entry = CalibrationEntry(**item)
                _ = entry.coefficients  # the property validates the numbers
            except (TypeError, ValueError) as err:
                raise CalibrationError(f"{path}: entries[{index}]: {err}") from err
            entries.append(entry)
        return cls(entries)

    def save(self, path: str | Path) -> None:
        """Write atomically (temporary file, fsync, rename)."""
        path = Path(path)
        document = {"entries": [asdict(entry) for entry in self.entries]}
        text = (
            json.dumps(document, indent=2) + "\n"
            if path.suffix == ".json"
            else yaml.safe_dump(document, sort_keys=False)
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(handle, "w") as out:
                out.write(text)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    def put(
        self, model: str, gpu_type: str, engine_version: str, driver_version: str, fit: FitResult
    ) -> CalibrationEntry:
        """Store a fit; its version id is derived from the key and the coefficients."""
        key = (model, gpu_type, engine_version, driver_version)
        fitted = fit.coefficients
        version = (
            Coefficients(fitted.c0_ms, fitted.a_ms, fitted.b_ms, "").version
            + "-"
            + _key_digest(key)
        )
        entry = CalibrationEntry(
            *key,
            c0_ms=fitted.c0_ms,
            a_ms=fitted.a_ms,
            b_ms=fitted.b_ms,
            version=version,
            fitted_at=datetime.now(UTC).isoformat(timespec="seconds"),
            r_squared=fit.r_squared,
            rmse_ms=fit.rmse_ms,
            n_steps=fit.n_steps,
        )
        self._entries[key] = entry
        return entry

    def lookup(
        self, model: str, gpu_type: str, engine_version: str, driver_version: str
    ) -> Coefficients | None:
        """The coefficients stored for the key, or None."""
        entry = self._entries.get((model, gpu_type, engine_version, driver_version))
        return entry.coefficients if entry else None

    def require(
        self, model: str, gpu_type: str, engine_version: str, driver_version: str
    ) -> Coefficients:
        """The coefficients for the key, or CalibrationMissing saying what exists for this model and GPU."""
        found = self.lookup(model, gpu_type, engine_version, driver_version)
        if found is not None:
            return found
        known = [
            f"engine {e.engine_version} / driver {e.driver_version}"
            for e in self.entries
            if e.key[:2] == (model, gpu_type)
        ]
        raise CalibrationMissing(
            f"no calibration for model {model!r} on {gpu_type!r} with engine {engine_version!r} and driver "
            f"{driver_version!r}; stored for this model and GPU: {', '.join(known) or 'none'}. "
            "Run `stepledger calibrate` on a calibration run of this engine and driver."
        )


def _key_digest(key: tuple[str, ...]) -> str:
    return hashlib.sha256("\x1f".join(key).encode()).hexdigest()[:6]


def calibration_coverage(
    store: CalibrationStore, model: str, gpu_type: str, segments: pl.DataFrame
) -> pl.DataFrame:
    """One row per (engine_version, driver_version) in the log's segments: steps, and the
    stored coefficients' version or null with a message saying what is missing."""
    missing_columns = [
        c for c in ("engine_version", "driver_version", "steps") if c not in segments.columns
    ]
    if missing_columns:
        raise CalibrationError(f"segments table lacks column(s) {missing_columns}")
    versions = (
        segments.group_by("engine_version", "driver_version")
        .agg(pl.col("steps").sum())
        .sort("engine_version", "driver_version")
    )
    rows = []
    for engine_version, driver_version, steps in versions.iter_rows():
        found = store.lookup(model, gpu_type, engine_version, driver_version)
        rows.append(
            {
                "engine_version": engine_version,
                "driver_version": driver_version,
                "steps": steps,
                "coefficients_version": found.version if found else None,
                "detail": "ok"
                if found
                else f"no coefficients for {model} on {gpu_type} with engine {engine_version} and driver {driver_version}",
            }
        )
    schema = {
        "engine_version": pl.String,
        "driver_version": pl.String,
        "steps": pl.Int64,
        "coefficients_version": pl.String,
        "detail": pl.String,
    }
    return pl.DataFrame(rows, schema=schema)


CalibrationKey = tuple[str, str, str, str]


def fit_decoded_log(
    steps: pa.Table, slots: pa.Table, segments: pa.Table
) -> dict[CalibrationKey, FitResult]:
    """fit_by_version over the decoder's Arrow tables (pipeline.ingestion.decoder.read_segments)."""
    frames = []
    for name, table in (("steps", steps), ("slots", slots), ("segments", segments)):
        frame = pl.from_arrow(table)
        if not isinstance(frame, pl.DataFrame):
            raise CalibrationError(f"the decoded log's {name} is not a table")
        frames.append(frame)
    return fit_by_version(*frames)


def fit_by_version(
    steps: pl.DataFrame, slots: pl.DataFrame, segments: pl.DataFrame
) -> dict[CalibrationKey, FitResult]:
    """One fit per (model, GPU type, engine version, driver version) found in the segments.

    Steps are matched to their segment's header through `segment_id`; slots to steps through
    (replica, seq).
    """
    missing = [c for c in ("segment_id", *_KEY_FIELDS) if c not in segments.columns]
    if missing:
        raise CalibrationError(f"segments table lacks column(s) {missing}")
    if "segment_id" not in steps.columns:
        raise CalibrationError("steps table lacks column 'segment_id'")
    headers = segments.select("segment_id", *_KEY_FIELDS).unique()
    keyed = steps.join(headers, on="segment_id", how="left")
    orphans = keyed.filter(pl.col("model").is_null())
    if orphans.height:
        raise CalibrationError(
            f"{orphans.height} step(s) name a segment_id with no segment header, e.g. {orphans['segment_id'][0]!r}"
        )
    fits = {}
    for key, group in keyed.group_by(*_KEY_FIELDS, maintain_order=True):
        group_slots = slots.join(group.select("replica", "seq"), on=["replica", "seq"], how="semi")
        try:
            fits[tuple(key)] = fit_coefficients(group, group_slots)
        except CalibrationError as err:
            raise CalibrationError(
                f"model {key[0]} on {key[1]}, engine {key[2]}, driver {key[3]}: {err}"
            ) from err
    return fits


def weights_for_log(
    pool: Pool,
    segments: pl.DataFrame,
    store: CalibrationStore | None,
    kernel: KernelWeights | None = None,
) -> tuple[WeightSource, list[str]]:
    """The weight source to attribute a pool's log with, and findings for the calibration check.

    Policy `kernel`: the kernel. Policy `fitted`: the stored coefficients when every (engine,
    driver) version in the log's segments has the same entry; otherwise the kernel (built for
    the pool unless given), with one finding per version that lacks coefficients or per
    mixture of differing ones, so the hour is still billed and the gap is reported.
    """
    if pool.policies.weights == "kernel":
        return kernel or KernelWeights.for_pool(pool), []
    store = store or CalibrationStore()
    coverage = calibration_coverage(store, pool.model, pool.gpu_type, segments)
    findings = [
        f"pool {pool.name}: {detail} ({steps} steps); kernel weights used instead"
        for detail, steps in zip(coverage["detail"], coverage["steps"], strict=False)
        if detail != "ok"
    ]
    versions = coverage["coefficients_version"].drop_nulls().unique().to_list()
    if len(versions) > 1 and not findings:
        findings.append(
            f"pool {pool.name}: the log mixes engine/driver versions with different coefficients "
            f"({', '.join(sorted(versions))}); kernel weights used for the hour"
        )
    if findings or not versions:
        return kernel or KernelWeights.for_pool(pool), findings
    engine_version, driver_version = coverage.row(0)[:2]
    return FittedWeights(
        store.require(pool.model, pool.gpu_type, engine_version, driver_version)
    ), []
