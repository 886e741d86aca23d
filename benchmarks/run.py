"""Run every benchmark module and write `benchmarks/results.json`.

Each `benchmarks/bench_*.py` exposes `figures(quick: bool) -> list[Figure]`. Figures are
measured side by side in one process, so ratios between them are fair on a noisy machine.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import sys
import time
from pathlib import Path

import benchmarks
from benchmarks.figure import Figure

RESULTS = Path(__file__).resolve().parent / "results.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="reduced sizes (under two minutes)")
    parser.add_argument("--only", help="run only benchmark modules whose name contains this")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    figures: list[Figure] = []
    run_started = time.perf_counter()
    seconds_by_module: dict[str, float] = {}
    names = sorted(
        m.name for m in pkgutil.iter_modules(benchmarks.__path__) if m.name.startswith("bench_")
    )
    for name in names:
        if args.only and args.only not in name:
            continue
        started = time.perf_counter()
        module = importlib.import_module(f"benchmarks.{name}")
        produced = module.figures(quick=args.quick)
        for figure in produced:
            print(figure.line(), flush=True)
        seconds_by_module[name] = time.perf_counter() - started
        print(f"  ({name}: {seconds_by_module[name]:.1f} s)", file=sys.stderr, flush=True)
        figures.extend(produced)
    # QUICK's budget is the whole run's wall time: what each module took, slowest first.
    print(
        f"wall time {time.perf_counter() - run_started:.1f} s (load average"
        f" {os.getloadavg()[0]:.2f}):",
        file=sys.stderr,
    )
    for name, seconds in sorted(seconds_by_module.items(), key=lambda item: -item[1]):
        print(f"  {name:24s} {seconds:6.1f} s", file=sys.stderr)

    args.out.write_text(
        json.dumps({"quick": args.quick, "figures": [f.as_dict() for f in figures]}, indent=2)
        + "\n"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
