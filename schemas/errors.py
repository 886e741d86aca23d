"""The project's exceptions: one base, `StepledgerError`, and the few kinds below it that the
command line maps to its exit codes (docs/getting-started.md, "Exit codes"). Every error a
user can cause or fix is one of these kinds, and its message names the file, record or field;
any other exception is a bug.

The kinds also derive from the built-in exception their errors were before (`ValueError` for
a bad value, `RuntimeError` for a state that refuses an operation), so a caller catching the
built-in one still catches them. The module lives in `schemas/`, below both the pools file
(`schemas.config` raises `ConfigError`) and `pipeline/`, and imports nothing, so the engine's
hook may use it too.
"""

from __future__ import annotations

from typing import ClassVar


class StepledgerError(Exception):
    """An error the pipeline reports in one line rather than as a bug's traceback."""

    exit_code: ClassVar[int] = 1


class InputError(StepledgerError, ValueError):
    """What a user passed to a command is invalid: an argument, a file named on the command
    line, an output path, a setting to try."""

    exit_code = 3


class ConfigError(StepledgerError, ValueError):
    """A configuration file is unreadable or invalid; the message names file, line and field."""

    exit_code = 4


class DataError(StepledgerError, ValueError):
    """Data the pipeline reads is damaged or missing: a segment, a gateway or DCGM file, a lake
    file, the calibration, the inputs an hour's attribution saved."""

    exit_code = 5


class StateError(StepledgerError, RuntimeError):
    """The warehouse or the pipeline's state refuses the operation: of another layout, not
    yet built, migrated already, or holding nothing for what was asked; or the Dagster
    instance that keeps the runs' history cannot be created or written."""

    exit_code = 6


class ExternalError(StepledgerError, RuntimeError):
    """A service outside the pipeline failed: the alert sink, a webhook."""

    exit_code = 7
