"""The kernel's load response against measured TPOT sweeps: how step time grows with concurrency.

A measured sweep is one deployment's mean time per output token at several client
concurrencies (InferenceX, transcribed in `shared/reference/pricing/measured/`). Absolute TPOT
carries what a step price does not (client overheads, scheduler gaps), so the comparison is of
shape: each curve divided by its value at the sweep's lowest concurrency, as the Go kernel's
`cmd/shape` scores it.

Unlike `cmd/shape`, which prices a decode-only batch of `concurrency` requests, the steps priced
here are the steady state of the measured workload: with `c` requests resident, each producing
`osl` tokens after an `isl`-token prompt, every `osl` decode steps also carry `c` prompts. TPOT
averages over all of them, so a long prompt's interference is part of the measured curve. How
the prompts meet the decodes, and what the engine served, is each run's own (`engine_settings`,
from InferenceX's launch scripts): vLLM chunks prompts into the decodes' steps under its token
budget; SGLang runs a prefill batch on its own while the decodes wait; TensorRT-LLM puts a whole
prompt in one step beside the decodes, its experts spread whole over the ranks.
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
# SGLang's prefill budget in InferenceX's DeepSeek-R1 H200 launch (`--chunked-prefill-size 32768`).
SGLANG_PREFILL_TOKENS = 32768
# InferenceX's client draws each request's prompt and output lengths uniformly on
# [int(label * ratio), label] (kimbochen/bench_serving `sample_random_requests`), the ratio 0.8
# (`.github/workflows/benchmark-tmpl.yml` RANDOM_RANGE_RATIO): a 1024 label means 921.5 tokens.
RANDOM_RANGE_RATIO = 0.8
# Host time per emitted token, incremental detokenization and streaming, which lands on the
# inter-token latency rather than in the step (blis-registry cost-model-host-overheads.yaml
# `host_output_token`, 45.9 us, method assumed). A server streaming every `stream_interval`
# tokens pays it once per interval (vLLM's `--stream-interval`: "reduces host overhead").
HOST_OUTPUT_TOKEN_US = 45.9
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


def token_budget_of(chip: ChipSpec) -> int:
    """vLLM's default max_num_batched_tokens on this chip (the engine's per-step token budget)."""
    if chip.memory_gib >= HUGE_PART_GIB:
        return HUGE_PART_TOKEN_BUDGET
    large = chip.memory_gib >= LARGE_PART_GIB and not chip.name.startswith("a100")
    return LARGE_PART_TOKEN_BUDGET if large else SMALL_PART_TOKEN_BUDGET


def steady_state_tpot_us(
    kernel: Kernel,
    concurrency: int,
    isl: int,
    osl: int,
    *,
    token_budget: int | None = None,
    prefill_apart: bool = False,
    replicas: int = 1,
    output_token_us: float = 0.0,
) -> float:
    """Mean time per output token over `osl` steps with `concurrency` requests resident.

    Decoding requests carry the mean context of their decode phase, isl + osl / 2. Each of the
    `concurrency` prompts that arrive in that window is chunked under the token budget (vLLM's
    default for the chip unless given). By default (vLLM) each chunk shares a step with the
    other requests' decodes, which then count toward their tokens; with `prefill_apart`
    (SGLang) a chunk runs alone and every decode waits for it. Under attention data parallelism
    each of `replicas` replicas holds its share of the requests and the kernel prices one
    replica's step; every replica takes one of its prompts in the same step (TensorRT-LLM's
    balanced context batching), so a prompt step comes once per replica's prompt. Each token
    the server emits in a step (every replica's) adds `output_token_us` of host time to it.
    """
    if replicas < 1:
        raise PricingError(f"replicas must be at least 1, got {replicas}")
    context = isl + osl // 2
    resident = -(-concurrency // replicas)
    others = 0 if prefill_apart else resident - 1
    budget = token_budget or token_budget_of(kernel.chip)
    if others >= budget:
        raise PricingError(f"{resident} resident requests leave no room in a {budget}-token step")
    room = budget - others
    chunks = -(-isl // room)
    done = np.minimum(np.arange(chunks) * room, isl)
    chunk = np.minimum(room, isl - done)
    # step 0: pure decode of every resident request; steps 1..chunks: one prompt chunk each,
    # with the others' decodes unless the prefill runs apart
    beside = 1 + others
    n_rows = resident + chunks * beside
    step_index = np.concatenate(
        [np.zeros(resident, dtype=np.int64), np.repeat(np.arange(1, chunks + 1), beside)]
    )
    scheduled = np.ones(n_rows, dtype=np.int64)
    computed = np.full(n_rows, context - 1, dtype=np.int64)
    firsts = resident + np.arange(chunks) * beside
    scheduled[firsts], computed[firsts] = chunk, done
    steps = kernel.price_many(
        Slots(step_index, scheduled, computed, scheduled + computed), n_steps=chunks + 1
    ).nooverlap_us
    # a decode emits its token; a prompt emits its first one with its last chunk
    emitted = np.concatenate([[resident], np.full(chunks, others)])
    emitted[-1] += 1
    steps = steps + emitted * replicas * output_token_us
    prompt_steps = resident * chunks
    if prefill_apart:
        # the prompt steps produce no decode token: they lengthen the window instead
        return float((osl * steps[0] + resident * steps[1:].sum()) / osl)
    if prompt_steps > osl:
        raise PricingError(
            f"{resident} prompts of {isl} tokens need {prompt_steps} steps, more than the "
            f"{osl} decode steps they arrive in"
        )
    return float(((osl - prompt_steps) * steps[0] + resident * steps[1:].sum()) / osl)


@dataclass(frozen=True)
class EngineSettings:
    """How a measured run was served, as far as its step prices depend on it."""

    deployment: Deployment
    token_budget: int  # tokens one step may schedule
    prefill_apart: bool = False  # a prefill batch runs without the decodes
    replicas: int = 1  # attention data-parallel replicas the requests are dealt over
    stream_interval: int = 1  # tokens the server sends a client at once


# InferenceX's TensorRT-LLM DeepSeek-R1 fp8 H200 runs: experts spread whole over the TP group
# ("EP=TP", .github/configs/nvidia-master.yaml@0004cf5 `dsr1-fp8-h200-trt`), attention DP
# on 8k/1k above 32 concurrent requests ("If CONC > 32, then DP_ATTN=true"), on the other
# workloads above 64.
TRT_ATTENTION_DP_ABOVE = {8192: 32}
TRT_ATTENTION_DP_ABOVE_OTHERWISE = 64


def engine_settings(sweep: Sweep, concurrency: int, compat: str = "physics") -> EngineSettings:
    """The engine settings of a measured run, from InferenceX's launch scripts
    (github.com/SemiAnalysisAI/InferenceX `benchmarks/`, at the commits named):

    * vLLM (`70b_fp8_h100_slurm.sh`@2a205bb, `70b_fp8_h200_slurm.sh`@6ebc882 and @409e9a4,
      `70b_b200_slurm.sh`@2caa5e5): an fp8 KV cache, `max-num-batched-tokens 8192`,
      `max-num-seqs` the client concurrency; the image `vllm/vllm-openai:v0.10.2`
      (`.github/configs/master.json`@8d330cd), whose default CUDA graph mode was still
      PIECEWISE (FULL_AND_PIECEWISE became the default after it, vllm-project/vllm#25444);
      that version streams every token (`--stream-interval` came later).
    * SGLang (`dsr1_fp8_h200.sh`@1fc5d73; `.github/configs/nvidia-master.yaml`@0004cf5
      `dsr1-fp8-h200-sglang`: TP 8, no EP): `--chunked-prefill-size 32768` (a whole prompt in
      one prefill), the KV cache in the model's dtype; the scheduler's default
      `enable_mixed_chunk=False` runs a prefill batch apart from the decodes;
      `--stream-interval 10`.
    * TensorRT-LLM (`dsr1_fp8_h200_trt_slurm.sh`@2e46dba): an fp8 KV cache, `--ep_size` the TP
      width, `--max_num_tokens` (concurrency + isl + 64) rounded up to 64, so a prompt is never
      chunked and joins the decodes' step (in-flight batching); attention data parallelism over
      the TP ranks above the concurrency `TRT_ATTENTION_DP_ABOVE` names; `stream_interval: 10`.
    """
    served = {"model": sweep.model, "chip": sweep.chip, "dtype": sweep.dtype, "compat": compat}
    if sweep.framework == "vllm":
        return EngineSettings(
            Deployment(
                **served,
                tp=sweep.tp,
                cache_dtype="fp8",
                max_num_seqs=concurrency,
                cudagraph_mode="PIECEWISE",
            ),
            token_budget=LARGE_PART_TOKEN_BUDGET,
        )
    if sweep.framework == "sglang":
        return EngineSettings(
            Deployment(**served, tp=sweep.tp),
            token_budget=SGLANG_PREFILL_TOKENS,
            prefill_apart=True,
            stream_interval=10,
        )
    if sweep.framework == "trt":
        budget = -(-(concurrency + sweep.isl + 64) // 64) * 64
        above = TRT_ATTENTION_DP_ABOVE.get(sweep.isl, TRT_ATTENTION_DP_ABOVE_OTHERWISE)
        if concurrency > above:
            return EngineSettings(
                Deployment(
                    **served,
                    tp=1,
                    data_parallel=sweep.tp,
                    expert_parallel=True,
                    cache_dtype="fp8",
                ),
                token_budget=budget,
                replicas=sweep.tp,
                stream_interval=10,
            )
        return EngineSettings(
            Deployment(**served, tp=sweep.tp, expert_parallel=True, cache_dtype="fp8"),
            token_budget=budget,
            stream_interval=10,
        )
    raise PricingError(f"no launch record for framework {sweep.framework!r}")


def mean_length(label: int) -> int:
    """The mean of the lengths InferenceX's client draws for a labelled length."""
    return (int(label * RANDOM_RANGE_RATIO) + label) // 2


def shape_error(sweeps: list[Sweep], compat: str = "physics") -> ShapeError:
    """Each sweep's priced curve against its measured one, both relative to the lowest
    concurrency. The client measured mean time per output token: the steps' time and the host
    time of the tokens they emit, over requests of the workload's mean lengths."""
    kernels: dict[Deployment, Kernel] = {}
    errors = []
    for sweep in sweeps:
        isl, osl = mean_length(sweep.isl), mean_length(sweep.osl)
        priced = []
        for concurrency in sweep.concurrency:
            settings = engine_settings(sweep, concurrency, compat)
            if settings.deployment not in kernels:
                kernels[settings.deployment] = Kernel.build(settings.deployment)
            priced.append(
                steady_state_tpot_us(
                    kernels[settings.deployment],
                    concurrency,
                    isl,
                    osl,
                    token_budget=settings.token_budget,
                    prefill_apart=settings.prefill_apart,
                    replicas=settings.replicas,
                    output_token_us=HOST_OUTPUT_TOKEN_US / settings.stream_interval,
                )
            )
        measured = np.array(sweep.tpot_us)
        relative = (np.array(priced) / priced[0]) / (measured / measured[0])
        errors.append(tuple(float(e) for e in np.abs(relative - 1.0) * 100.0))
    return ShapeError(sweeps=tuple(sweeps), errors_pct=tuple(errors))
