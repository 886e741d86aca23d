"""`stepledger explain REQUEST_ID`: why a request cost what it cost, step by step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from pipeline.cli.costs import print_wide
from pipeline.cli.options import data_dir_option
from schemas.units import nano_to_usd

if TYPE_CHECKING:  # imported when the command runs, to keep the command line quick to start
    import polars as pl
    from rich.text import Text

    from pipeline.finance.explain_request import Explanation, RequestHour


def _usd(nano: int) -> str:
    return f"{nano_to_usd(nano):.9f}"


def _facts(hour: RequestHour) -> list[tuple[str, str]]:
    """The hour's facts of the request, as (name, value) rows."""
    return [
        ("hour, pool", f"{hour.hour:%Y-%m-%dT%H} {hour.pool}"),
        ("published", "yes" if hour.published else "no (held back)"),
        ("tenant, feature", f"{hour.tenant or '-'} / {hour.feature or '-'}"),
        ("line, paid by", f"{hour.line_kind or '-'}, {hour.paid_by or '-'}"),
        (
            "charged",
            f"{hour.amount_nano:,} (compute {hour.compute_nano:,}, KV {hour.kv_nano:,})",
        ),
        ("weights", hour.weights_version),
        ("policies", f"{hour.policy_version}: {json.dumps(hour.policies, sort_keys=True)}"),
        ("alpha", f"{hour.alpha:.4f}"),
        ("retry", hour.retry_handling),
        (
            "prefix cache",
            f"{hour.prefix_cache}, {hour.cached_tokens:,} cached tokens, "
            f"read charge {hour.cache_read_nano:,}",
        ),
        (
            "resources",
            ", ".join(f"{r} {n:,}" for r, n in hour.resources.items()) or "no stored work",
        ),
        (
            "reproduced",
            "yes: the steps' shares and the cache read charge sum to the charge"
            if hour.reproduced
            else "NO: the lake no longer gives the published charge; re-run the hour",
        ),
    ]


# The summary's names of the parts of a charge.
PART_NAMES = {
    "compute": "compute on its steps",
    "kv_memory_time": "KV memory-time",
    "cache_read": "prefix-cache read",
}
_STEP_HEADINGS = {
    "replica": "replica",
    "seq": "seq",
    "role": "role",
    "cost_nano": "step cost",
    "share_nano": "share",
    "compute_nano": "compute",
    "kv_nano": "KV",
    "work": "work",
    "step_work": "step work",
    "kv_blocks": "KV blocks",
    "step_kv_blocks": "step KV blocks",
    "kv_block_seconds": "KV block-s",
}
_STEP_FORMATS = {"work": "{:.3f}", "step_work": "{:.3f}", "kv_blocks": "{:.1f}"}


def _step_cell(column: str, value: object) -> Text:
    from rich.text import Text

    if isinstance(value, int):
        return Text(f"{value:,}")
    if isinstance(value, float):
        return Text(_STEP_FORMATS.get(column, "{:.4f}").format(value))
    return Text(str(value))


def _steps_table(title: str, steps: pl.DataFrame) -> None:
    from rich.table import Table

    table = Table(title=title)
    columns = [c for c in steps.columns if c in _STEP_HEADINGS or c in ("hour", "pool")]
    for column in columns:
        numeric = column not in ("hour", "pool", "replica", "role")
        table.add_column(_STEP_HEADINGS.get(column, column), justify="right" if numeric else "left")
    for step in steps.iter_rows(named=True):
        table.add_row(*(_step_cell(c, step[c]) for c in columns))
    print_wide(table)


def print_summary(explanation: Explanation) -> None:
    """The charge, its parts (which add up to it), its compute by resource and its largest
    steps."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    summary = explanation.summary()
    hours = ", ".join(f"{h.hour:%Y-%m-%dT%H} {h.pool}" for h in explanation.hours)
    Console().print(
        Text(
            f"request {explanation.request_id}: {_usd(summary.amount_nano)} USD "
            f"({summary.amount_nano:,} nano-dollars), {summary.steps:,} steps in {hours}"
        )
    )
    parts = Table(title="what the charge is made of")
    for heading in ("part", "nano-dollars", "USD"):
        parts.add_column(heading, justify="left" if heading == "part" else "right")
    for name, nano in summary.parts.items():
        parts.add_row(PART_NAMES[name], f"{nano:,}", _usd(nano))
    total = sum(summary.parts.values())
    parts.add_row(Text("total"), f"{total:,}", _usd(total))
    for resource, nano in summary.resources.items():
        parts.add_row(Text(f"  compute and cache read on {resource}"), f"{nano:,}", _usd(nano))
    print_wide(parts)
    if summary.largest.height:
        shown = min(summary.largest.height, summary.steps)
        _steps_table(f"largest {shown} of {summary.steps:,} steps (--steps: all)", summary.largest)


def print_explanation(explanation: Explanation, *, every_step: bool) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    print_summary(explanation)
    console = Console()
    for hour in explanation.hours:
        facts = Table.grid(padding=(0, 2))
        facts.add_column()
        facts.add_column()
        for name, value in _facts(hour):
            facts.add_row(Text(name), Text(value))
        console.print(facts)
        if every_step:
            _steps_table(f"steps of {hour.pool} {hour.hour:%Y-%m-%dT%H}", hour.steps)


@click.command("explain")
@click.argument("request_id")
@data_dir_option(help="data directory whose warehouse and lake to read")
@click.option("--steps", "every_step", is_flag=True, help="print every step, not only the largest")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of tables")
def explain_command(request_id: str, data_dir: Path, every_step: bool, as_json: bool) -> None:
    """Why REQUEST_ID cost what it cost: first a summary (the charge, the parts it is made of,
    compute, KV memory-time and prefix-cache read, which add up to it exactly, the compute
    per resource, and the largest steps), then per hour the weights and policies in force
    and how a retry was handled; with --steps, every step with its share, work and KV
    memory-time. (explain-step splits a single hand-written step.)"""
    from pipeline.finance.explain_request import explain_request

    explanation = explain_request(data_dir, request_id)
    if as_json:
        click.echo(json.dumps(explanation.as_json(), indent=2))
    else:
        print_explanation(explanation, every_step=every_step)
