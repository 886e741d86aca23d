"""The kernel's load response against measured TPOT sweeps: how step time grows with concurrency.

A measured sweep is one deployment's mean time per output token at several client
concurrencies (InferenceX, transcribed in `shared/reference/pricing/measured/`). Absolute TPOT
carries what a step price does not (client overheads, scheduler gaps), so the comparison is of
shape: each curve divided by its value at the sweep's lowest concurrency, as the Go kernel's
`cmd/shape` scores it.

Unlike `cmd/shape`, which prices a decode-only batch of `concurrency` requests, the steps priced
here are the steady state of the measured workload: with `c` requests resident, each producing
`osl` tokens after an `isl`-token prompt, every `osl` decode steps also carry `c` prompts, which
the engine chunks into the same steps (vLLM's chunked prefill, a token budget per step). TPOT
averages over all of them, so a long prompt's interference is part of the measured curve.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pricing.deployment import Deployment
from pricing.kernel import Kernel, Slots
from pricing.plan import LARGE_PART_GIB
from pricing.spec import ChipSpec, PricingError

# vLLM's default max_num_batched_tokens for the OpenAI server: 16384 on parts with at least
# 160 GiB, 8192 on parts with at least 70 GiB except A100s, else 2048 (the Go kernel's
# default_max_num_batched_tokens, from vllm/engine/arg_utils.py).
HUGE_PART_GIB = 160
HUGE_PART_TOKEN_BUDGET = 16384
LARGE_PART_TOKEN_BUDGET = 8192
SMALL_PART_TOKEN_BUDGET = 2048
COLUMNS = ("model", "gpu", "framework", "precision", "tp", "isl", "osl", "concurrency", "tpot_us")


@dataclass(frozen=True)
class Sweep:
    """One measured TPOT sweep: a deployment's time per output token at rising concurrency."""

    model: str
    chip: str
    framework: str
    dtype: str
    tp: int
    isl: int
    osl: int
    concurrency: tuple[int, ...]  # ascending
    tpot_us: tuple[float, ...]


@dataclass(frozen=True)
class ShapeError:
    """Per point: |predicted relative / measured relative - 1| in percent; anchors score 0."""

    sweeps: tuple[Sweep, ...]
    errors_pct: tuple[tuple[float, ...], ...]  # per sweep, per point

    @property
    def mae_pct(self) -> float:
        """Mean over every point, each sweep's anchor included (as `cmd/shape` averages)."""
        return float(np.mean([e for sweep in self.errors_pct for e in sweep]))

    @property
    def mae_beyond_anchor_pct(self) -> float:
        """Mean over the points other than each sweep's anchor."""
        return float(np.mean([e for sweep in self.errors_pct for e in sweep[1:]]))

    @property
    def points(self) -> int:
        """Measured points over every sweep."""
        return sum(len(sweep) for sweep in self.errors_pct)


def load_sweeps(path: Path) -> list[Sweep]:
    """The measured sweeps of a TPOT CSV (columns COLUMNS), one per deployment and workload."""
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = sorted(set(COLUMNS) - set(reader.fieldnames or ()))
        if missing:
            raise PricingError(f"{path}: missing column(s) {missing}")
        points: dict[tuple[str, str, str, str, int, int, int], list[tuple[int, float]]]
        points = defaultdict(list)
        for line, row in enumerate(reader, start=2):
            try:
                key = (
                    row["model"],
                    row["gpu"],
                    row["framework"],
                    row["precision"],
                    int(row["tp"]),
                    int(row["isl"]),
                    int(row["osl"]),
                )
                concurrency, tpot = int(row["concurrency"]), float(row["tpot_us"])
            except ValueError as err:
                raise PricingError(f"{path}:{line}: {err}") from err
            if concurrency < 1 or not tpot > 0 or key[4] < 1 or key[5] < 1 or key[6] < 2:
                raise PricingError(
                    f"{path}:{line}: needs tp, isl >= 1, osl >= 2, concurrency >= 1 and a "
                    f"positive tpot_us"
                )
            points[key].append((concurrency, tpot))
    sweeps = []
    for (model, chip, framework, dtype, tp, isl, osl), sweep in sorted(points.items()):
        sweep.sort()
        sweeps.append(
            Sweep(
                model=model,
                chip=chip,
                framework=framework,
                dtype=dtype,
                tp=tp,
                isl=isl,
                osl=osl,
                concurrency=tuple(c for c, _ in sweep),
                tpot_us=tuple(t for _, t in sweep),
            )
        )
    return sweeps


def token_budget(chip: ChipSpec) -> int:
    """vLLM's default max_num_batched_tokens on this chip (the engine's per-step token budget)."""
    if chip.memory_gib >= HUGE_PART_GIB:
        return HUGE_PART_TOKEN_BUDGET
    large = chip.memory_gib >= LARGE_PART_GIB and not chip.name.startswith("a100")
    return LARGE_PART_TOKEN_BUDGET if large else SMALL_PART_TOKEN_BUDGET


def steady_state_tpot_us(kernel: Kernel, concurrency: int, isl: int, osl: int) -> float:
    """Mean step time over `osl` steps with `concurrency` requests resident.

    Decoding requests carry the mean context of their decode phase, isl + osl / 2. Each of the
    `concurrency` prompts that arrive in that window is chunked into steps alongside the other
    requests' decodes, up to the token budget; the remaining steps are pure decode.
    """
    context = isl + osl // 2
    others = concurrency - 1
    budget = token_budget(kernel.chip)
    if others >= budget:
        raise PricingError(
            f"{concurrency} resident requests leave no room in a {budget}-token step"
        )
    chunks = -(-isl // (budget - others))
    done = np.minimum(np.arange(chunks) * (budget - others), isl)
    chunk = np.minimum(budget - others, isl - done)
    # step 0: pure decode of every resident request; steps 1..chunks: one prompt chunk each
    n_rows = concurrency + chunks * concurrency
    step_index = np.concatenate(
        [np.zeros(concurrency, dtype=np.int64), np.repeat(np.arange(1, chunks + 1), concurrency)]
    )
    scheduled = np.ones(n_rows, dtype=np.int64)
    computed = np.full(n_rows, context - 1, dtype=np.int64)
    firsts = concurrency + np.arange(chunks) * concurrency
    scheduled[firsts], computed[firsts] = chunk, done
    steps = kernel.price_many(
        Slots(step_index, scheduled, computed, scheduled + computed), n_steps=chunks + 1
    ).nooverlap_us
    prompt_steps = concurrency * chunks
    if prompt_steps > osl:
        raise PricingError(
            f"{concurrency} prompts of {isl} tokens need {prompt_steps} steps, more than the "
            f"{osl} decode steps they arrive in"
        )
    return float(((osl - prompt_steps) * steps[0] + concurrency * steps[1:].sum()) / osl)


def shape_error(sweeps: list[Sweep], compat: str = "physics") -> ShapeError:
    """Each sweep's priced curve against its measured one, both relative to the lowest
    concurrency."""
    errors = []
    for sweep in sweeps:
        kernel = Kernel.build(
            Deployment(
                model=sweep.model, chip=sweep.chip, tp=sweep.tp, dtype=sweep.dtype, compat=compat
            )
        )
        priced = np.array(
            [steady_state_tpot_us(kernel, c, sweep.isl, sweep.osl) for c in sweep.concurrency]
        )
        measured = np.array(sweep.tpot_us)
        relative = (priced / priced[0]) / (measured / measured[0])
        errors.append(tuple(float(e) for e in np.abs(relative - 1.0) * 100.0))
    return ShapeError(sweeps=tuple(sweeps), errors_pct=tuple(errors))
