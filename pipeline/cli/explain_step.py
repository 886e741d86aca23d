"""`stepledger explain-step FILE.json`: how one step (or many) is split, and why."""

from __future__ import annotations

import json
from pathlib import Path

import click

from schemas.errors import InputError


@click.command("explain-step")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="print JSON: one object, or an array for an array of steps",
)
def explain_step_command(file: Path, as_json: bool) -> None:
    """Split the step(s) in FILE among their slots and explain each share.

    FILE holds one step or a JSON array of steps, e.g. {"step_ms": 50, "gpus": 1,
    "usd_per_gpu_hour": 3.6, "unit": "micro", "alpha": 0.8, "coefficients": {"c0_ms": 12,
    "a_ms": 0.05, "b_ms": 0.00005}, "slots": [{"request_id": "A", "new_tokens": 512,
    "context": 0, "kv_blocks": 32}, ...]}. Use "weights": "kernel" with a "deployment"
    (model, chip, tp, ...) instead of "coefficients" to weigh work with the pricing kernel.
    """
    from pipeline.attribution.explain_step import explain_steps, parse_steps

    try:
        document = json.loads(file.read_text())
    except OSError as err:
        raise InputError(f"{file}: cannot read: {err.strerror}") from err
    except json.JSONDecodeError as err:
        raise InputError(f"{file}:{err.lineno}:{err.colno}: not valid JSON: {err.msg}") from err
    try:
        steps, was_array = parse_steps(document, str(file))
        explained = explain_steps(steps)
    except ImportError as err:
        raise click.ClickException(
            f"{file}: kernel weights need the pricing package: {err}"
        ) from err

    if as_json:
        payload = [step.as_dict() for step in explained]
        click.echo(json.dumps(payload if was_array else payload[0], indent=2))
        return

    from rich.console import Console
    from rich.table import Table

    console = Console()
    for number, step in enumerate(explained):
        title = f"step {number}: " if was_array else ""
        table = Table(
            title=f"{title}{step.total} {step.unit}-dollars, alpha {step.alpha:g}, weights {step.weights}",
            title_justify="left",
        )
        for column in (
            "request",
            "tokens",
            "context",
            "KV blocks",
            f"work {step.work_unit}",
            "compute",
            "KV",
            "weight",
            "exact",
            "share",
        ):
            table.add_column(column, justify="left" if column == "request" else "right")
        for slot in step.slots:
            table.add_row(
                slot.request_id,
                str(slot.new_tokens),
                str(slot.context),
                f"{slot.kv_blocks:g}",
                f"{slot.fixed_work + slot.own_work:.3f}",
                f"{slot.compute_share:.1%}",
                f"{slot.kv_share:.1%}",
                f"{slot.weight:.4f}",
                f"{slot.exact:.3f}",
                f"{slot.share}" + ("*" if slot.rounded_up else ""),
            )
        console.print(table)
        for slot in step.slots:
            console.print(
                f"  {slot.request_id}: {step.reason(slot)}", highlight=False, soft_wrap=True
            )
        console.print(
            "  * rounded up: the step's leftover units go to the largest remainders, earliest slot first"
        )
