"""`stepledger inspect`: what a set of segment files holds, and what is wrong with it."""

from __future__ import annotations

import itertools
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from pipeline.ingestion.decoder import read_segments, segment_paths
from schemas.units import NS_PER_SECOND

# Ranges printed per cell before the rest are summarised; --json always lists them all.
_SHOWN_RANGES = 6


def seq_runs(seqs: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs of consecutive sequence numbers, as (first, last)."""
    if len(seqs) == 0:
        return []
    ordered = np.unique(seqs)
    breaks = np.flatnonzero(np.diff(ordered) != 1)
    firsts = np.concatenate(([ordered[0]], ordered[breaks + 1]))
    lasts = np.concatenate((ordered[breaks], [ordered[-1]]))
    return [(int(a), int(b)) for a, b in zip(firsts, lasts, strict=False)]


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for first, last in sorted(ranges):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return merged


def _gaps(covered: list[tuple[int, int]], damage: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sequence numbers missing between covered ranges, with the damage that explains them."""
    gaps = []
    for (_, before), (after, _) in itertools.pairwise(covered):
        first, last = before + 1, after - 1
        causes = sorted(
            {
                row["kind"]
                for row in damage
                if (row["first_seq"] is None or row["first_seq"] <= last)
                and (row["last_seq"] is None or row["last_seq"] >= first)
                and (row["first_seq"] is not None or row["last_seq"] is not None)
            }
        )
        gaps.append(
            {
                "first_seq": first,
                "last_seq": last,
                "steps": last - first + 1,
                "explained_by": causes,
            }
        )
    return gaps


def build_report(paths: list[Path]) -> dict[str, Any]:
    """The inspection of `paths` as plain data (what --json prints)."""
    log = read_segments(paths)
    segments = log.segments.to_pylist()
    damage = log.damage.to_pylist()
    drops = log.drops.to_pylist()
    step_seq = log.steps.column("seq").to_numpy()
    # The decoder emits steps segment by segment, in the order of its segments table, and
    # segments sorted by pool and replica: each segment and each replica is one slice.
    bounds = np.concatenate(([0], np.cumsum([s["steps"] for s in segments], dtype=np.int64)))
    for segment, start, end in zip(segments, bounds[:-1], bounds[1:], strict=False):
        segment["seq_ranges"] = seq_runs(step_seq[start:end])
        segment["wall_anchor_utc"] = _utc(segment["wall_anchor_ns"])

    kept_paths = {s["path"] for s in segments}
    unattached_damage = [row for row in damage if row["path"] not in kept_paths]
    replicas = []
    for pool, replica in dict.fromkeys((s["pool"], s["replica"]) for s in segments):
        own = [i for i, s in enumerate(segments) if (s["pool"], s["replica"]) == (pool, replica)]
        own_paths = {segments[i]["path"] for i in own}
        own_drops = [
            (d["first_seq"], d["last_seq"])
            for d in drops
            if (d["pool"], d["replica"]) == (pool, replica)
        ]
        seqs = step_seq[bounds[own[0]] : bounds[own[-1] + 1]]
        runs = seq_runs(seqs)
        own_damage = [row for row in damage if row["path"] in own_paths] + unattached_damage
        replicas.append(
            {
                "pool": pool,
                "replica": replica,
                "segments": len(own),
                "steps": len(seqs),
                "seq_ranges": runs,
                "drops": own_drops,
                "dropped_steps": sum(b - a + 1 for a, b in own_drops),
                "gaps": _gaps(_merge(runs + own_drops), own_damage),
            }
        )
    missing = [gap for replica in replicas for gap in replica["gaps"] if not gap["explained_by"]]
    return {
        "files": len(paths),
        "segments": segments,
        "replicas": replicas,
        "damage": damage,
        "ok": not damage and not missing,
    }


def _utc(ns: int) -> str:
    return (
        datetime.fromtimestamp(ns / NS_PER_SECOND, UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


def _ranges(ranges: list[tuple[int, int]]) -> str:
    shown = [f"{a}" if a == b else f"{a}-{b}" for a, b in ranges[:_SHOWN_RANGES]]
    more = len(ranges) - _SHOWN_RANGES
    return ", ".join(shown) + (f" (+{more} more)" if more > 0 else "") if ranges else "-"


def _add_row(table: Table, *cells: str) -> None:
    # Text, not markup: file names, pools and the header's strings come from the segments.
    table.add_row(*map(Text, cells))


def _print(report: dict[str, Any], console: Console) -> None:
    if not report["segments"]:
        console.print(f"no readable segment among {report['files']} files")
    else:
        _print_segments(report, console)
    if report["damage"]:
        _print_damage(report, console)
    console.print(
        "[green]no damage[/green]"
        if report["ok"]
        else "[bold red]damage or missing steps found[/bold red]"
    )


def _print_segments(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"Segments ({len(report['segments'])} of {report['files']} files)")
    for column in (
        "file",
        "pool / replica",
        "engine",
        "model",
        "opened (UTC)",
        "steps",
        "seq ranges",
        "dropped",
    ):
        table.add_column(column, overflow="fold")
    for s in report["segments"]:
        _add_row(
            table,
            Path(s["path"]).name,
            f"{s['pool']} / {s['replica']}",
            f"{s['engine_name']} {s['engine_version']}, driver {s['driver_version']}, format v{s['format_version']}",
            f"{s['model']} on {s['gpus_per_replica']} x {s['gpu_type']}, KV block {s['kv_block_size']}",
            s["wall_anchor_utc"],
            str(s["steps"]),
            _ranges(s["seq_ranges"]),
            str(s["dropped_steps"]),
        )
    console.print(table)

    table = Table(title="Replicas")
    for column in ("pool / replica", "segments", "steps", "seq ranges", "drops", "gaps"):
        table.add_column(column, overflow="fold")
    for r in report["replicas"]:
        gaps = [
            f"{g['first_seq']}-{g['last_seq']} ({g['steps']}, {'/'.join(g['explained_by']) or 'MISSING'})"
            for g in r["gaps"]
        ]
        _add_row(
            table,
            f"{r['pool']} / {r['replica']}",
            str(r["segments"]),
            str(r["steps"]),
            _ranges(r["seq_ranges"]),
            f"{r['dropped_steps']} in {_ranges(r['drops'])}" if r["drops"] else "0",
            "; ".join(gaps) or "none",
        )
    console.print(table)


def _print_damage(report: dict[str, Any], console: Console) -> None:
    table = Table(title="Damage", style="red")
    for column in ("file", "kind", "byte offset", "bytes", "seq", "detail"):
        table.add_column(column, overflow="fold")
    for d in report["damage"]:
        seqs = f"{'?' if d['first_seq'] is None else d['first_seq']}-{'?' if d['last_seq'] is None else d['last_seq']}"
        _add_row(
            table,
            d["path"],
            d["kind"],
            str(d["byte_offset"]),
            str(d["byte_length"]),
            seqs,
            d["detail"],
        )
    console.print(table)


@click.command("inspect")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def inspect_command(paths: tuple[Path, ...], as_json: bool) -> None:
    """Show the segments in PATHS (files, or directories searched for *.seg): headers, step
    counts, sequence ranges, gaps, drops and damage. Exits 1 when damage or unexplained gaps
    are found."""
    files = segment_paths(paths)
    if not files:
        raise click.UsageError(f"no *.seg files under {', '.join(map(str, paths))}")
    report = build_report(files)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        _print(report, Console())
    sys.exit(0 if report["ok"] else 1)
