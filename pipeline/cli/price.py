"""`stepledger price`: price one step of a deployment, or sweep the batch size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import numpy as np
from pydantic import ValidationError

from pipeline.cli.options import file_option
from pricing import GRAPH_MODES, RESOURCES, Deployment, Kernel, PricingError, Slots, StepPrice

SWEEP_BATCHES = np.arange(1, 257)


def _batch(
    decode: int, context: int, prefill: tuple[int, ...], spec_tokens: int
) -> tuple[np.ndarray, ...]:
    """`decode` requests each generating 1 + spec tokens against `context` tokens in total
    (context - 1 already computed), plus one fresh prompt per --prefill."""
    decode_tokens = 1 + spec_tokens
    scheduled = np.concatenate(
        [np.full(decode, decode_tokens), np.asarray(prefill, dtype=np.int64)]
    )
    computed = np.concatenate(
        [np.full(decode, max(context - decode_tokens, 0)), np.zeros(len(prefill))]
    )
    prompt_len = np.concatenate(
        [np.full(decode, max(context - decode_tokens, 0)), np.asarray(prefill)]
    )
    return scheduled.astype(np.int64), computed.astype(np.int64), prompt_len.astype(np.int64)


def _as_json(
    deployment: Deployment, decode: int, context: int, prefill: tuple[int, ...], price: StepPrice
) -> dict[str, Any]:
    return {
        "deployment": deployment.model_dump(),
        "batch": {
            "decode_requests": decode,
            "context_tokens": context,
            "prefill_tokens": list(prefill),
        },
        **{f"{r}_ms": getattr(price, f"{r}_us") / 1e3 for r in RESOURCES},
        "overlap_ms": price.overlap_us / 1e3,
        "nooverlap_ms": price.nooverlap_us / 1e3,
        "bottleneck": price.bottleneck,
        "per_kind_us": price.per_kind,
    }


def _print_table(
    deployment: Deployment, decode: int, context: int, prefill: tuple[int, ...], price: StepPrice
) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (
        f"{deployment.model} on {deployment.tp}x {deployment.chip} ({deployment.compat}): "
        f"{decode} decode @ {context} ctx" + (f", prefill {list(prefill)}" if prefill else "")
    )
    resources = Table(title=title)
    resources.add_column("resource")
    resources.add_column("ms", justify="right")
    resources.add_column("share of NoOverlap", justify="right")
    for resource in RESOURCES:
        value = getattr(price, f"{resource}_us")
        marker = "  <- bottleneck" if resource == price.bottleneck else ""
        resources.add_row(
            resource, f"{value / 1e3:.3f}", f"{value / price.nooverlap_us:.1%}{marker}"
        )
    resources.add_row("Overlap", f"{price.overlap_us / 1e3:.3f}", "")
    resources.add_row("NoOverlap", f"{price.nooverlap_us / 1e3:.3f}", "100.0%")
    layers = Table(title="one layer of each kind (us)")
    layers.add_column("term")
    for name in price.per_kind:
        layers.add_column(name, justify="right")
    for key in (
        "repeat",
        "sm_us",
        "hbm_us",
        "nvlink_us",
        "nic_us",
        "expert_sm_us",
        "expert_hbm_us",
        "stage_us",
    ):
        cells = [times.get(key) for times in price.per_kind.values()]
        text = ["" if v is None else str(v) if key == "repeat" else f"{v:.2f}" for v in cells]
        layers.add_row(key.removesuffix("_us"), *text)
    console = Console()
    console.print(resources)
    console.print(layers)


def _sweep(
    kernel: Kernel, context: int, prefill: tuple[int, ...], spec_tokens: int, out: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [_batch(int(b), context, prefill, spec_tokens) for b in SWEEP_BATCHES]
    step_index = np.concatenate([np.full(len(p[0]), i) for i, p in enumerate(parts)])
    scheduled, computed, prompt_len = (np.concatenate([p[j] for p in parts]) for j in range(3))
    prices = kernel.price_many(
        Slots(step_index, scheduled, computed, prompt_len), n_steps=len(parts)
    )
    d = kernel.deployment
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    colours = {
        "sm": "tab:blue",
        "hbm": "tab:orange",
        "nvlink": "tab:green",
        "nic": "tab:purple",
        "host": "tab:red",
    }
    for resource in RESOURCES:
        values = getattr(prices, f"{resource}_us") / 1e3
        if values.any():  # a fabric no collective uses is not drawn
            left.plot(SWEEP_BATCHES, values, label=resource, color=colours[resource])
    right.plot(SWEEP_BATCHES, prices.nooverlap_us / 1e3, label="NoOverlap", color="black")
    right.plot(
        SWEEP_BATCHES, prices.overlap_us / 1e3, label="Overlap", color="grey", linestyle="--"
    )
    for axis, title in ((left, "time per resource"), (right, "step estimates")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("requests in the batch")
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
        axis.legend()
    left.set_ylabel("ms per step")
    changes = np.flatnonzero(np.diff(prices.bottleneck)) + 1
    bottlenecks = ", ".join(
        f"{RESOURCES[prices.bottleneck[start]]} {SWEEP_BATCHES[start]}-{SWEEP_BATCHES[end - 1]}"
        for start, end in zip(np.r_[0, changes], np.r_[changes, len(SWEEP_BATCHES)], strict=True)
    )
    figure.suptitle(
        f"{d.model} {d.dtype or kernel.model.weight_dtype} on {d.tp}x {d.chip}, TP{d.tp}, {d.cudagraph_mode}, "
        f"decode at {context} context ({d.compat}); bottleneck: {bottlenecks}",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)
    click.echo(f"wrote {out} (batch 1..{SWEEP_BATCHES[-1]}; bottleneck: {bottlenecks})")


@click.command("price")
@click.option("--model", required=True, help="model file name under pricing/models/")
@click.option("--gpu", "chip", required=True, help="chip file name under pricing/chips/")
@click.option("--tp", type=int, default=1, show_default=True, help="tensor-parallel width")
@click.option("--nodes", type=int, default=1, show_default=True, help="nodes the TP group spans")
@click.option("--dtype", default=None, help="served weight dtype (default: the checkpoint's)")
@click.option("--cache-dtype", default=None, help="KV cache dtype (default: auto = bf16)")
@click.option(
    "--cudagraph",
    type=click.Choice(list(GRAPH_MODES), case_sensitive=False),
    default="FULL_AND_PIECEWISE",
    show_default=True,
)
@click.option(
    "--max-num-seqs", type=int, default=None, help="engine max_num_seqs (sets the capture ceiling)"
)
@click.option("--decode-threshold", type=int, default=1, show_default=True)
@click.option(
    "--spec-tokens",
    type=int,
    default=0,
    show_default=True,
    help="speculative tokens per decode step",
)
@click.option(
    "--compat",
    type=click.Choice(["physics", "go"]),
    default="physics",
    show_default=True,
    help="go: reproduce the Go kernel (routed FLOPs not divided by TP, swa reads not window-bounded)",
)
@click.option(
    "--decode", type=int, default=0, show_default=True, help="decode requests in the batch"
)
@click.option(
    "--context",
    type=int,
    default=1,
    show_default=True,
    help="context tokens of each decode request",
)
@click.option(
    "--prefill", type=int, multiple=True, help="a fresh prompt of this many tokens (repeatable)"
)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option(
    "--sweep", is_flag=True, help="price decode batches 1..256 and write the figure to --out"
)
@file_option("--out", help="PNG path for --sweep")
def price_command(
    model: str,
    chip: str,
    tp: int,
    nodes: int,
    dtype: str | None,
    cache_dtype: str | None,
    cudagraph: str,
    max_num_seqs: int | None,
    decode_threshold: int,
    spec_tokens: int,
    compat: str,
    decode: int,
    context: int,
    prefill: tuple[int, ...],
    as_json: bool,
    sweep: bool,
    out: Path | None,
) -> None:
    """Price one step on SM, HBM, NVLink, NIC and host, with both estimates and the bottleneck."""
    ctx = click.get_current_context()
    try:
        for name, value in (
            ("--decode", decode),
            ("--context", context),
            ("--spec-tokens", spec_tokens),
        ):
            if value < 0:
                raise PricingError(f"{name} is negative ({value})")
        if any(tokens <= 0 for tokens in prefill):
            raise PricingError(f"--prefill needs a positive token count, got {list(prefill)}")
        if sweep and out is None:
            raise PricingError("--sweep needs --out FILE.png")
        deployment = Deployment(
            model=model,
            chip=chip,
            tp=tp,
            nodes=nodes,
            dtype=dtype,
            cache_dtype=cache_dtype,
            cudagraph_mode=cudagraph,
            max_num_seqs=max_num_seqs,
            decode_threshold=decode_threshold,
            num_spec_tokens=spec_tokens,
            compat=compat,
        )
        kernel = Kernel.build(deployment)
        if sweep and out is not None:
            _sweep(kernel, context, prefill, spec_tokens, out)
            return
        price = kernel.price(*_batch(decode, context, prefill, spec_tokens))
    except ValidationError as err:
        first = err.errors()[0]
        click.echo(f"Error: {'.'.join(map(str, first['loc']))}: {first['msg']}", err=True)
        ctx.exit(2)
    except PricingError as err:
        click.echo(f"Error: {err}", err=True)
        ctx.exit(2)
    if as_json:
        click.echo(json.dumps(_as_json(deployment, decode, context, prefill, price)))
    else:
        _print_table(deployment, decode, context, prefill, price)
