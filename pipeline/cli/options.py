"""Options several `stepledger` commands share, so each means the same everywhere."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

Command = TypeVar("Command", bound=Callable[..., Any])

DEMO_DIR = Path("demo-run")


def _path_option(
    decls: tuple[str, ...],
    *,
    directory: bool,
    help: str | None,
    default: Path | None,
    required: bool,
    exists: bool,
) -> Callable[[Command], Command]:
    return click.option(
        *decls,
        type=click.Path(exists=exists, file_okay=not directory, dir_okay=directory, path_type=Path),
        default=default,
        show_default=default is not None,
        required=required,
        help=help,
    )


def directory_option(
    *decls: str,
    help: str,
    default: Path | None = None,
    required: bool = False,
    exists: bool = False,
) -> Callable[[Command], Command]:
    """A directory option (`decls` as for `click.option`), given as a `Path`; `exists`: it must."""
    return _path_option(
        decls, directory=True, help=help, default=default, required=required, exists=exists
    )


def file_option(
    *decls: str, help: str | None = None, default: Path | None = None, required: bool = False
) -> Callable[[Command], Command]:
    """A file option (`decls` as for `click.option`), given as a `Path`."""
    return _path_option(
        decls, directory=False, help=help, default=default, required=required, exists=False
    )


def data_dir_option(help: str, *, existing: bool = False) -> Callable[[Command], Command]:
    """`--data DIR` (parameter `data_dir`): defaulting to the demo's `demo-run` directory, or,
    `existing`, a directory that must be given and must exist."""
    if existing:
        return directory_option("--data", "data_dir", help=help, required=True, exists=True)
    return directory_option("--data", "data_dir", help=help, default=DEMO_DIR)


def workers_option(default: int, help: str) -> Callable[[Command], Command]:
    """`--workers N`: processes simulating replicas side by side (at least one)."""
    return click.option(
        "--workers", type=click.IntRange(min=1), default=default, show_default=True, help=help
    )
