"""compat="go" against the Go kernel's own numbers on the shared reference grid.

Every case in `go_grid/cases.jsonl` (its README: 2,229 steps over four models, four chips,
TP 1-8, every CUDA-graph mode) must match on all seven figures within 0.1% (1e-6 ms floor).
"""

from __future__ import annotations

import json
from collections import Counter
from functools import cache

import numpy as np

from pricing import Deployment, Kernel
from tests.pricing.shared_reference import read_reference_text, reference_file

FIGURES = ("sm", "hbm", "nvlink", "nic", "host", "overlap", "nooverlap")


@cache
def _kernel(
    model: str,
    chip: str,
    tp: int,
    dtype: str | None,
    cache_dtype: str | None,
    cudagraph_mode: str,
    decode_threshold: int,
) -> Kernel:
    return Kernel.build(
        Deployment(
            model=model,
            chip=chip,
            tp=tp,
            dtype=dtype,
            cache_dtype=cache_dtype,
            cudagraph_mode=cudagraph_mode,
            decode_threshold=decode_threshold,
            compat="go",
        )
    )


def _within(got_ms: float, expected_ms: float) -> bool:
    return abs(got_ms - expected_ms) <= max(1e-3 * abs(expected_ms), 1e-6)


def test_every_step_of_the_go_grid_matches_on_every_figure():
    path = reference_file("go_grid/cases.jsonl")
    cases = [json.loads(line) for line in read_reference_text(path).splitlines() if line.strip()]
    assert len(cases) == 2229, f"{path}: expected the README's 2,229 cases"
    matched: Counter[str] = Counter()
    misses: list[str] = []
    for case in cases:
        kernel = _kernel(
            case["model"],
            case["chip"],
            case["tp"],
            case["dtype"],
            case["cache_dtype"],
            case["cudagraph_mode"],
            case["decode_threshold"],
        )
        batch = np.asarray(case["batch"], dtype=np.int64)
        price = kernel.price(batch[:, 0], batch[:, 1], batch[:, 0] + batch[:, 1])
        got = {
            "sm": price.sm_us,
            "hbm": price.hbm_us,
            "nvlink": price.nvlink_us,
            "nic": price.nic_us,
            "host": price.host_us,
            "overlap": price.overlap_us,
            "nooverlap": price.nooverlap_us,
        }
        for figure in FIGURES:
            if _within(got[figure] / 1000.0, case["expected_ms"][figure]):
                matched[figure] += 1
            else:
                misses.append(
                    f"{case['id']}: {figure} {got[figure] / 1000.0:.6f} ms, "
                    f"Go {case['expected_ms'][figure]} ms"
                )
        if price.nooverlap_us > 0 and case["bottleneck"] != price.bottleneck:
            misses.append(f"{case['id']}: bottleneck {price.bottleneck}, Go {case['bottleneck']}")
    rates = ", ".join(f"{f} {matched[f] / len(cases):.2%}" for f in FIGURES)
    print(f"go grid: {len(cases)} steps; match rate per figure: {rates}")
    assert not misses, f"{len(misses)} mismatches, first: " + "; ".join(misses[:5])
