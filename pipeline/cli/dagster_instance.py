"""The Dagster instance the command line runs Dagster on, and pool-hours materialized there.

The instance (runs, event logs, check results, schedule and sensor state) is `DAGSTER_HOME`
when it is set, else `<data>/dagster`: a data directory keeps its own history, outside the
checkout. An instance directory without a `dagster.yaml` gets a copy of
`dagster_home/dagster.yaml` (queued runs, the DuckDB single-writer pool limit).

pipeline/ never imports the code location (assets/): it starts Dagster's commands, and
`python -m assets.runner`, as processes naming the module.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from pipeline.datadir import DATA_ENV
from schemas.errors import StateError
from schemas.units import hour_key

if TYPE_CHECKING:
    from rich.console import Console

# The code location (assets.definitions) reads the data directory from this variable.
CODE_LOCATION = "assets.definitions"
INSTANCE_TEMPLATE = Path(__file__).resolve().parents[2] / "dagster_home" / "dagster.yaml"
INSTANCE_DIR_NAME = "dagster"
RUNNER = "assets.runner"


def instance_dir(data_dir: Path, environ: dict[str, str]) -> Path:
    """DAGSTER_HOME if the user set it, else the data directory's own instance."""
    home = environ.get("DAGSTER_HOME")
    return Path(home).resolve() if home else (data_dir / INSTANCE_DIR_NAME).resolve()


def instance_unwritable(home: Path, reason: object) -> StateError:
    """The error for an instance directory that cannot be created or written: a full or
    read-only disk, a path that is no directory."""
    return StateError(
        f"{home}: the Dagster instance cannot be created or opened ({reason}); free space "
        "there, or set DAGSTER_HOME to a writable directory"
    )


def prepare_instance(home: Path) -> bool:
    """Create the instance directory, with the committed dagster.yaml when it has none.
    True when the configuration was copied."""
    config = home / "dagster.yaml"
    if config.exists():
        return False
    if not INSTANCE_TEMPLATE.is_file():
        raise click.ClickException(
            f"{config}: missing, and the template {INSTANCE_TEMPLATE} is not installed "
            "(write a dagster.yaml there, see docs/production.md)"
        )
    try:
        home.mkdir(parents=True, exist_ok=True)
        # Copied beside it and renamed: a copy a full disk cut short would otherwise stay as
        # the instance's configuration, and every later run would take it for one.
        partial = home / f".dagster.yaml.{os.getpid()}"
        try:
            shutil.copyfile(INSTANCE_TEMPLATE, partial)
            partial.replace(config)
        finally:
            partial.unlink(missing_ok=True)
    except OSError as err:
        raise instance_unwritable(home, err.strerror or err) from err
    return True


def materialize_pool_hours(
    data_dir: Path, hours: list[datetime], home: Path
) -> Iterator[dict[str, Any]]:
    """Every pool of every hour through the pool-hour job on the instance at `home`, in a
    process of its own; yields each outcome as the pool-hour finishes (its fields:
    assets/runner.py)."""
    env = {**os.environ, "DAGSTER_HOME": str(home), DATA_ENV: str(data_dir.resolve())}
    hour_args = [arg for hour in hours for arg in ("--hour", hour_key(hour))]
    command = [sys.executable, "-m", RUNNER, "--data", str(data_dir.resolve()), *hour_args]
    # Standard error to a file: Dagster may write more than a pipe holds while nobody reads it.
    with tempfile.TemporaryFile("w+") as errors:
        with subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=errors, text=True
        ) as process:
            assert process.stdout is not None
            for line in process.stdout:
                yield json.loads(line)
        if process.returncode != 0:
            errors.seek(0)
            raise click.ClickException(
                f"`{' '.join(command[:3])}` exited with {process.returncode}: {errors.read()[-2000:]}"
            )


def print_outcome(
    console: Console,
    hour: str,
    pool: str,
    *,
    held_back: bool,
    error: str | None,
    failed_checks: list[str],
) -> None:
    """One finished pool-hour, as `stepledger run` and `demo` show it: its standing (held back,
    published, published with WARN or ERROR findings) and each failed check in full, under the
    severity it failed with ("ERROR name: detail", "WARN name: detail"). Errors and findings
    quote input (file paths, names), so they print as text, never as markup."""
    from rich.text import Text

    severities = {finding.split(" ", 1)[0] for finding in failed_checks}
    worst = next((s for s in ("ERROR", "WARN") if s in severities), None)
    status = (
        Text("held back", "red")
        if held_back
        else Text.assemble(("published", "green"), f" with {worst}" if worst else "")
    )
    if error:
        status = Text.assemble(("failed", "red"), f": {error.splitlines()[0]}")
    console.print(Text.assemble(f"{hour} {pool}: ", status))
    for finding in failed_checks:
        severity, _, rest = finding.partition(" ")
        console.print(
            Text.assemble(
                "    ", (severity, "red" if severity == "ERROR" else "yellow"), f" {rest}"
            )
        )
