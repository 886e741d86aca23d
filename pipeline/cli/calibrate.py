"""`stepledger calibrate --data DIR`: fit c0, a, b from a calibration run and store them."""

from __future__ import annotations

import json
from pathlib import Path

import click

from pipeline.cli.options import data_dir_option, file_option
from schemas.errors import InputError

DEFAULT_STORE = Path("calibration.yaml")


@click.command("calibrate")
@data_dir_option(
    help="directory holding the calibration run's step-log segments (*.seg, searched recursively)",
    existing=True,
)
@file_option(
    "--store",
    "store_path",
    default=DEFAULT_STORE,
    help="calibration store to update (.yaml/.yml or .json)",
)
@click.option(
    "--min-r2",
    default=0.9,
    show_default=True,
    type=click.FloatRange(0.0, 1.0),
    help="fits with a lower R^2 are reported but not stored",
)
@click.option("--dry-run", is_flag=True, help="fit and report without writing the store")
@click.option("--json", "as_json", is_flag=True, help="print the fits as a JSON array")
def calibrate_command(
    data_dir: Path, store_path: Path, min_r2: float, dry_run: bool, as_json: bool
) -> None:
    """Fit the work model on the steps in DIR, one fit per model, GPU type, engine version and
    driver version found in the segment headers, and store the coefficients with a version."""
    from pipeline.attribution.calibration import CalibrationStore, fit_decoded_log

    segment_paths = sorted(data_dir.rglob("*.seg"))
    if not segment_paths:
        raise InputError(f"{data_dir}: no *.seg step-log segments found")
    try:
        from pipeline.ingestion.decoder import read_segments
    except ImportError as err:
        raise click.ClickException(
            f"the step-log decoder (pipeline.ingestion.decoder) is not available: {err}"
        ) from err
    log = read_segments(segment_paths)
    store = CalibrationStore.load(store_path)
    fits = fit_decoded_log(log.steps, log.slots, log.segments)

    report = []
    for (model, gpu_type, engine_version, driver_version), fit in fits.items():
        accepted = fit.r_squared >= min_r2
        version = (
            store.put(model, gpu_type, engine_version, driver_version, fit).version
            if accepted
            else None
        )
        report.append(
            {
                "model": model,
                "gpu_type": gpu_type,
                "engine_version": engine_version,
                "driver_version": driver_version,
                "c0_ms": fit.coefficients.c0_ms,
                "a_ms": fit.coefficients.a_ms,
                "b_ms": fit.coefficients.b_ms,
                "r_squared": fit.r_squared,
                "rmse_ms": fit.rmse_ms,
                "n_steps": fit.n_steps,
                "version": version,
                "stored": accepted and not dry_run,
            }
        )
    if not dry_run and any(r["stored"] for r in report):
        store.save(store_path)
    damaged = len(log.damage)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        for r in report:
            verdict = (
                f"stored as {r['version']} in {store_path}"
                if r["stored"]
                else "not stored (dry run)"
                if dry_run and r["version"]
                else f"REJECTED: R^2 below {min_r2}"
            )
            click.echo(
                f"{r['model']} on {r['gpu_type']}, engine {r['engine_version']}, driver {r['driver_version']}: "
                f"c0={r['c0_ms']:.4g} ms a={r['a_ms']:.4g} ms b={r['b_ms']:.4g} ms; "
                f"R^2={r['r_squared']:.4f}, rmse {r['rmse_ms']:.3f} ms over {r['n_steps']} steps; {verdict}"
            )
        if damaged:
            click.echo(
                f"note: {damaged} damaged region(s) in the segments; run `stepledger inspect` for details",
                err=True,
            )
    if any(r["version"] is None for r in report):
        raise SystemExit(1)
