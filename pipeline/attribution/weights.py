"""Which work weights a pool's attribution uses: the pricing kernel's, or (policy `fitted`)
the coefficients calibrated for the engine and driver version that logged most of the pool's
steps. The attribution builds each pool's kernel here, once per process (`kernel_weights`)."""

from __future__ import annotations

import functools
from datetime import datetime
from pathlib import Path

from pipeline.attribution.calibration import CalibrationStore
from pipeline.attribution.workmodel import FittedWeights, KernelWeights, WeightSource
from pipeline.datadir import DataDir
from pipeline.storage.lake import AttributionInputs, load_inputs
from schemas.config import Pool
from schemas.errors import DataError
from schemas.units import hour_key


def kernel_weights(pool: Pool) -> KernelWeights:
    """The pool's kernel weights, built once per process: building a kernel costs more than
    attributing a quiet hour."""
    # Keyed by the pool's JSON: a Pool holds lists, so it is not hashable.
    return _kernel_weights(pool.model_dump_json())


@functools.cache
def _kernel_weights(pool_json: str) -> KernelWeights:
    return KernelWeights.for_pool(Pool.model_validate_json(pool_json))


def weight_source(
    pool: Pool, engine: tuple[str, str] | None, calibration_file: Path
) -> WeightSource:
    """The pool's work weights. `engine`: the (engine_version, driver_version) that logged
    most of the pool's steps, None before any segment; `calibration_file`: the store of the
    calibrated coefficients (`pipeline.datadir.DataDir.calibration_file`)."""
    if pool.policies.weights == "kernel":
        return kernel_weights(pool)
    if engine is None:
        raise ValueError(
            f"pool {pool.name!r}: no segments ingested, so no engine version to calibrate for"
        )
    store = CalibrationStore.load(calibration_file)
    return FittedWeights(store.require(pool.model, pool.gpu_type, *engine))


class SavedInputsMissing(DataError, LookupError):
    """A pool-hour's saved attribution inputs, or the calibration its weights need, are gone;
    the message names which."""


def saved_inputs(
    data_dir: Path, pool: Pool, hour: datetime
) -> tuple[AttributionInputs, WeightSource]:
    """What the pool-hour is attributed again from: the inputs its attribution saved to the
    data directory's lake, and the pool's weights for them."""
    layout = DataDir(data_dir)
    try:
        inputs = load_inputs(layout.lake, pool.name, hour)
    except FileNotFoundError as err:
        raise SavedInputsMissing(str(err)) from err
    try:
        weights = weight_source(pool, inputs.engine, layout.calibration_file)
    except ValueError as err:  # the fitted weights' calibration is gone
        raise SavedInputsMissing(f"{hour_key(hour)} {pool.name}: {err}") from err
    return inputs, weights
