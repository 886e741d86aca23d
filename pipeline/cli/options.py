"""Options several `stepledger` commands share, so each means the same everywhere."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

Command = TypeVar("Command", bound=Callable[..., Any])


def data_dir_option(help: str) -> Callable[[Command], Command]:
    """`--data DIR` (parameter `data_dir`), defaulting to the demo's `demo-run` directory."""
    return click.option(
        "--data",
        "data_dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=Path("demo-run"),
        show_default=True,
        help=help,
    )
