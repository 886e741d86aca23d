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
    from pipeline.finance.explain_request import RequestHour


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


def print_explanation(explanation: object) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from pipeline.finance.explain_request import Explanation

    assert isinstance(explanation, Explanation)
    console = Console()
    console.print(
        Text(
            f"request {explanation.request_id}: {explanation.amount_nano:,} nano-dollars "
            f"(${nano_to_usd(explanation.amount_nano):.9f})"
        )
    )
    for hour in explanation.hours:
        facts = Table.grid(padding=(0, 2))
        facts.add_column()
        facts.add_column()
        for name, value in _facts(hour):
            facts.add_row(Text(name), Text(value))
        console.print(facts)
        table = Table(title=f"steps of {hour.pool} {hour.hour:%Y-%m-%dT%H}")
        headings = (
            "replica",
            "seq",
            "role",
            "step cost",
            "share",
            "compute",
            "KV",
            "work",
            "step work",
            "KV blocks",
            "step KV blocks",
            "KV block-s",
        )
        for heading in headings:
            table.add_column(heading, justify="left" if heading in ("replica", "role") else "right")
        for step in hour.steps.iter_rows(named=True):
            table.add_row(
                Text(step["replica"]),
                f"{step['seq']}",
                Text(step["role"]),
                f"{step['cost_nano']:,}",
                f"{step['share_nano']:,}",
                f"{step['compute_nano']:,}",
                f"{step['kv_nano']:,}",
                f"{step['work']:.3f}",
                f"{step['step_work']:.3f}",
                f"{step['kv_blocks']:.1f}",
                f"{step['step_kv_blocks']:.1f}",
                f"{step['kv_block_seconds']:.4f}",
            )
        print_wide(table)


@click.command("explain")
@click.argument("request_id")
@data_dir_option(help="data directory whose warehouse and lake to read")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of tables")
def explain_command(request_id: str, data_dir: Path, as_json: bool) -> None:
    """Why REQUEST_ID cost what it cost: its steps from the lake, its share of each with the
    slot's work and KV memory-time, the weights and policies in force, the prefix-cache
    charge, how a retry was handled and the compute charge per resource. (explain-step
    splits a single hand-written step.)"""
    from pipeline.finance.explain_request import explain_request

    explanation = explain_request(data_dir, request_id)
    if as_json:
        click.echo(json.dumps(explanation.as_json(), indent=2))
    else:
        print_explanation(explanation)
