"""Options several `stepledger` commands share, so each means the same everywhere."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar, cast

import click

from schemas.errors import ConfigError
from schemas.units import hour_key, parse_range_bound

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


# The time relative periods are resolved against, when set: reproduces a report of
# `last-month` later, and fixes the clock for tests.
NOW_VARIABLE = "STEPLEDGER_NOW"
RELATIVE_PERIODS = ("today", "yesterday", "this-month", "last-month", "mtd")
RANGE_HELP = (
    "an hour YYYY-MM-DDTHH, a day YYYY-MM-DD, a month YYYY-MM, or "
    + ", ".join(RELATIVE_PERIODS)
    + " (UTC)"
)


def clock_now() -> datetime:
    """Now, or the instant $STEPLEDGER_NOW names (ISO 8601 with a zone)."""
    text = os.environ.get(NOW_VARIABLE)
    if not text:
        return datetime.now(UTC)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"${NOW_VARIABLE} {text!r} is not an ISO 8601 time") from None
    if moment.utcoffset() is None:
        raise ConfigError(f"${NOW_VARIABLE} {text!r} has no time zone; add one, e.g. +00:00")
    return moment.astimezone(UTC)


def _hour_of(moment: datetime) -> datetime:
    """The UTC hour `moment` falls in."""
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def _next_month(month: datetime) -> datetime:
    return (month + timedelta(days=32)).replace(day=1)


def period_bounds(text: str, now: datetime) -> tuple[datetime, datetime]:
    """[start, end) of the period `text` names: an hour, day or month, or a period relative
    to `now` (UTC). `mtd` runs from the month's first hour through the current hour."""
    hour = _hour_of(now)
    today = hour.replace(hour=0)
    month = today.replace(day=1)
    relative = {
        "today": (today, today + timedelta(days=1)),
        "yesterday": (today - timedelta(days=1), today),
        "this-month": (month, _next_month(month)),
        "last-month": ((month - timedelta(days=1)).replace(day=1), month),
        "mtd": (month, hour + timedelta(hours=1)),
    }
    if text in relative:
        return relative[text]
    try:
        return parse_range_bound(text, end=False), parse_range_bound(text, end=True)
    except ValueError as err:
        raise ValueError(f"{err}, nor one of {', '.join(RELATIVE_PERIODS)}") from None


@dataclass(frozen=True)
class TimeRange:
    """The hours [start, end), UTC, of --from and --to; None: unbounded on that side."""

    start: datetime | None
    end: datetime | None

    def closed(self) -> tuple[datetime, datetime]:
        """Both ends, an unbounded one before or after any hour the ledger can hold."""
        return (
            self.start or datetime(1970, 1, 1, tzinfo=UTC),
            self.end or datetime(9999, 1, 1, tzinfo=UTC),
        )

    def slug(self) -> str:
        """The range in a file name: its first and last hours."""
        first, after = self.closed()
        return f"{hour_key(first)}_{hour_key(after - timedelta(hours=1))}"

    def label(self) -> str:
        """The range as a title says it: its first and last days, or hours."""
        if self.start is None and self.end is None:
            return "all hours"
        first, after = self.closed()
        if first.hour == 0 and after.hour == 0:
            days = [f"{first:%Y-%m-%d}", f"{after - timedelta(days=1):%Y-%m-%d}"]
        else:
            days = [hour_key(first), hour_key(after - timedelta(hours=1))]
        if self.start is None:
            days[0] = "the first hour"
        if self.end is None:
            days[1] = "the last hour"
        return f"{days[0]} UTC" if days[0] == days[1] else f"{days[0]} to {days[1]} UTC"


def resolve_range(start: str | None, end: str | None, now: datetime | None = None) -> TimeRange:
    """--from and --to as [start, end): each names a period, and the range runs from the start
    of the --from period through the end of the --to period, so `--from 2026-11-01 --to
    2026-11-30` and `--from 2026-11 --to 2026-11` are all of November."""
    now = now or clock_now()
    bounds: list[datetime | None] = []
    for text, option, side in ((start, "--from", 0), (end, "--to", 1)):
        try:
            bounds.append(None if text is None else period_bounds(text, now)[side])
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint=option) from err
    first, after = bounds
    if first is not None and after is not None and after <= first:
        raise click.BadParameter(f"--to {end} is before --from {start}", param_hint="--to")
    return TimeRange(first, after)


def range_options(what: str) -> Callable[[Command], Command]:
    """--from WHEN and --to WHEN, both naming a period (RANGE_HELP) and both inclusive, given to
    the command as `period`, a `TimeRange`; `what` the hours are (e.g. "billed")."""

    def decorate(command: Command) -> Command:
        @functools.wraps(command)
        def with_range(*args: Any, start: str | None, end: str | None, **kwargs: Any) -> Any:
            return command(*args, period=resolve_range(start, end), **kwargs)

        with_end = click.option(
            "--to",
            "end",
            metavar="WHEN",
            help=f"last period of hours {what}, inclusive [default: the last]",
        )(with_range)
        return cast(
            Command,
            click.option(
                "--from",
                "start",
                metavar="WHEN",
                help=f"first period of hours {what}, inclusive: {RANGE_HELP} [default: the first]",
            )(with_end),
        )

    return decorate
