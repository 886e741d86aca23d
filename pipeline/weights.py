"""Which work weights a pool's attribution uses: the pricing kernel's, or (policy `fitted`)
the coefficients calibrated for the engine and driver version that logged most of the pool's
steps. The one place a pool's kernel is built."""

from __future__ import annotations

import functools
from pathlib import Path

from pipeline.attribution import CalibrationStore, FittedWeights, KernelWeights, WeightSource
from schemas.config import Pool


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
    calibrated coefficients (`pipeline.datadir.CALIBRATION_FILE`)."""
    if pool.policies.weights == "kernel":
        return kernel_weights(pool)
    if engine is None:
        raise ValueError(
            f"pool {pool.name!r}: no segments ingested, so no engine version to calibrate for"
        )
    store = CalibrationStore.load(calibration_file)
    return FittedWeights(store.require(pool.model, pool.gpu_type, *engine))
