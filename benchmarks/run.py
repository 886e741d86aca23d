"""Run every benchmark module and write `benchmarks/results.json`.

Each `benchmarks/bench_*.py` exposes `figures(quick: bool) -> list[Figure]`. Figures are
measured side by side in one process, so ratios between them are fair on a noisy machine.
"""

from __future__ import annotations

import argparse
import importlib
import json
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
        print(f"  ({name}: {time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)
        figures.extend(produced)

    args.out.write_text(
        json.dumps({"quick": args.quick, "figures": [f.as_dict() for f in figures]}, indent=2)
        + "\n"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
