"""compat="go" against the Go kernel's own numbers on the shared reference grids.

Every case must match on all seven figures within 0.1% (1e-6 ms floor): `go_grid/cases.jsonl`
(its README: 2,229 steps over four models, four chips, TP 1-8, every CUDA-graph mode) and
`go_grid_features/cases.jsonl` (575 steps of expert parallelism with EPLB, attention data
parallelism, decode context parallelism, sparse MLA, recurrent mixers and an nvfp4 KV cache).
Each test prints its match rate per feature, whatever pytest captures.
"""

from __future__ import annotations

import json
from collections import Counter
from functools import cache
from typing import Any

import numpy as np
import pytest

from pricing import Deployment, Kernel, PricingError
from tests.pricing.shared_reference import read_reference_text, reference_file

FIGURES = ("sm", "hbm", "nvlink", "nic", "host", "overlap", "nooverlap")
# The Deployment fields a case states (the features grid adds the parallelism ones).
DEPLOYMENT_FIELDS = (
    "model",
    "chip",
    "tp",
    "dtype",
    "cache_dtype",
    "cudagraph_mode",
    "decode_threshold",
    "data_parallel",
    "expert_parallel",
    "eplb_redundant_experts",
    "all2all_backend",
    "decode_context_parallel",
)


@cache
def _kernel(fields: tuple[tuple[str, Any], ...]) -> Kernel:
    return Kernel.build(Deployment(**dict(fields), compat="go"))


def _within(got_ms: float, expected_ms: float) -> bool:
    return abs(got_ms - expected_ms) <= max(1e-3 * abs(expected_ms), 1e-6)


def _misses(case: dict[str, Any]) -> list[str]:
    """What of one case differs from the Go kernel's figures (nothing when it matches)."""
    fields = tuple((name, case[name]) for name in DEPLOYMENT_FIELDS if name in case)
    batch = np.asarray(case["batch"], dtype=np.int64)
    price = _kernel(fields).price(batch[:, 0], batch[:, 1], batch[:, 0] + batch[:, 1])
    got = {figure: getattr(price, f"{figure}_us") / 1000.0 for figure in FIGURES}
    misses = [
        f"{case['id']}: {figure} {got[figure]:.6f} ms, Go {case['expected_ms'][figure]} ms"
        for figure in FIGURES
        if not _within(got[figure], case["expected_ms"][figure])
    ]
    if price.nooverlap_us > 0 and case["bottleneck"] != price.bottleneck:
        misses.append(f"{case['id']}: bottleneck {price.bottleneck}, Go {case['bottleneck']}")
    return misses


def _check_grid(relative: str, expected_cases: int, capsys: pytest.CaptureFixture[str]) -> None:
    path = reference_file(relative)
    cases = [json.loads(line) for line in read_reference_text(path).splitlines() if line.strip()]
    assert len(cases) == expected_cases, f"{path}: expected the README's {expected_cases} cases"
    steps: Counter[str] = Counter()
    matched: Counter[str] = Counter()
    misses: list[str] = []
    for case in cases:
        feature = case.get("feature", "all")
        case_misses = _misses(case)
        steps[feature] += 1
        matched[feature] += not case_misses
        misses += case_misses
    with capsys.disabled():  # the rates are printed whatever pytest captures
        for feature in steps:
            print(f"\n{relative}: {feature}: {matched[feature]}/{steps[feature]} steps match")
    assert not misses, f"{len(misses)} mismatches, first: " + "; ".join(misses[:5])


def test_every_step_of_the_go_grid_matches_on_every_figure(capsys: pytest.CaptureFixture[str]):
    _check_grid("go_grid/cases.jsonl", 2229, capsys)


def test_every_step_of_the_features_grid_matches_on_every_figure(
    capsys: pytest.CaptureFixture[str],
):
    _check_grid("go_grid_features/cases.jsonl", 575, capsys)


def test_go_compat_refuses_an_nvfp4_latent_cache_on_plain_mla():
    # The Go kernel serves nvfp4_ds_mla on sparse MLA only; the default mode prices it.
    plain = dict(model="deepseek-v3", chip="b200", tp=8, cache_dtype="nvfp4_ds_mla")
    Kernel.build(Deployment(**plain))
    with pytest.raises(PricingError, match="nvfp4_ds_mla cache on sparse MLA only"):
        Kernel.build(Deployment(**plain, compat="go"))
    Kernel.build(Deployment(**{**plain, "model": "deepseek-v3.2-exp"}, compat="go"))
