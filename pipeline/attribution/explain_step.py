"""Explain how steps are split: the `stepledger explain-step` input format and its answer.

A step is a JSON object:
    {"step_ms": 50, "gpus": 1, "usd_per_gpu_hour": 3.6, "unit": "micro", "alpha": 0.8,
     "fixed_cost": "per_slot",
     "coefficients": {"c0_ms": 12, "a_ms": 0.05, "b_ms": 0.00005},
     "slots": [{"request_id": "A", "new_tokens": 512, "context": 0, "kv_blocks": 32}, ...]}
`unit` is "micro" or "nano" (default micro); `alpha` defaults to 0.8, `fixed_cost` to per_slot,
`gpus` to 1. Instead of `coefficients`, `"weights": "kernel"` with a `"deployment"` object
(pricing.Deployment fields) prices work with the kernel; slots may then give `prompt_tokens`
(default: context + new_tokens). A file holds one step or an array of steps; all steps are
split in one vectorised call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeline.attribution.allocator import blend_and_allocate, step_total_units
from pipeline.attribution.workmodel import (
    Coefficients,
    KernelWeights,
    SlotBatch,
    attention_pairs,
    kernel_work_us,
    split_fixed,
)
from pricing import Deployment
from schemas.errors import InputError
from schemas.units import MICRO_PER_USD, NANO_PER_USD

UNITS = {"micro": MICRO_PER_USD, "nano": NANO_PER_USD}


class ExplainError(InputError):
    """A step or a request cannot be explained: a step file is invalid (the message names the
    file, step and field) or a request's hour is not there to read (the message says what is
    missing and where)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SlotSpec(_Strict):
    """One slot of a step file: its request, the tokens it adds, its context and KV blocks."""

    request_id: str = Field(min_length=1)
    new_tokens: int = Field(ge=0)
    context: int = Field(ge=0)
    kv_blocks: float = Field(ge=0)
    prompt_tokens: int | None = Field(default=None, ge=0)


class CoefficientSpec(_Strict):
    """Fitted coefficients of a step file, in milliseconds."""

    c0_ms: float = Field(ge=0)
    a_ms: float = Field(ge=0)
    b_ms: float = Field(ge=0)


class StepSpec(_Strict):
    """One step of a step file: its measured time, price and split policy."""

    step_ms: float = Field(gt=0)
    gpus: int = Field(default=1, gt=0)
    usd_per_gpu_hour: float = Field(gt=0)
    unit: Literal["micro", "nano"] = "micro"
    alpha: float = Field(default=0.8, ge=0, le=1)
    fixed_cost: Literal["per_slot", "per_token"] = "per_slot"
    coefficients: CoefficientSpec | None = None
    weights: Literal["fitted", "kernel"] = "fitted"
    deployment: dict[str, Any] | None = None
    slots: list[SlotSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_weight_source(self) -> StepSpec:
        if self.weights == "kernel":
            if self.deployment is None or self.coefficients is not None:
                raise ValueError('"weights": "kernel" needs a "deployment" and no "coefficients"')
        elif self.coefficients is None or self.deployment is not None:
            raise ValueError(
                'give "coefficients" (c0_ms, a_ms, b_ms), or "weights": "kernel" with a "deployment"'
            )
        ids = [s.request_id for s in self.slots]
        if len(set(ids)) != len(ids):
            raise ValueError(
                f"request ids repeat within the step: {sorted(i for i in set(ids) if ids.count(i) > 1)}"
            )
        return self


@dataclass(frozen=True)
class ExplainedSlot:
    """One slot of an explained step: its work, shares, blended weight and whole-unit share."""

    request_id: str
    new_tokens: int
    context: int
    kv_blocks: float
    fixed_work: float
    own_work: float
    compute_share: float
    kv_share: float
    weight: float
    exact: float
    share: int

    @property
    def rounded_up(self) -> bool:
        """Whether the largest-remainder rounding gave the slot a unit above its exact share."""
        return self.share > int(self.exact)


@dataclass(frozen=True)
class ExplainedStep:
    """A step's total in whole units and how it was split among its slots."""

    total: int
    unit: str
    alpha: float
    work_unit: str  # "ms" for fitted coefficients, "us" for the kernel
    weights: str
    slots: list[ExplainedSlot]

    def reason(self, slot: ExplainedSlot) -> str:
        """One line saying how the slot's share follows from its work and KV blocks."""
        kind = "prefill chunk" if slot.new_tokens > 1 else "decode"
        text = (
            f"{kind} of {slot.new_tokens} token(s) at context {slot.context}: work "
            f"{slot.fixed_work:.3f} fixed + {slot.own_work:.3f} own {self.work_unit} = {slot.compute_share:.1%} of compute; "
            f"{slot.kv_blocks:g} KV blocks = {slot.kv_share:.1%} of memory; "
            f"weight {self.alpha:g} x {slot.compute_share:.4f} + {1 - self.alpha:g} x {slot.kv_share:.4f} = {slot.weight:.4f}; "
            f"exact {slot.exact:.4f} {self.unit}-dollars"
        )
        return text + (" rounded up (largest remainder)" if slot.rounded_up else " rounded down")

    def as_dict(self) -> dict[str, Any]:
        """The step's total, unit, policy and shares by request, as JSON-ready values."""
        return {
            "total": self.total,
            "unit": self.unit,
            "alpha": self.alpha,
            "weights": self.weights,
            "shares": {s.request_id: s.share for s in self.slots},
            "slots": [
                {
                    "request_id": s.request_id,
                    "new_tokens": s.new_tokens,
                    "context": s.context,
                    "kv_blocks": s.kv_blocks,
                    f"fixed_work_{self.work_unit}": s.fixed_work,
                    f"own_work_{self.work_unit}": s.own_work,
                    "compute_share": s.compute_share,
                    "kv_share": s.kv_share,
                    "weight": s.weight,
                    "exact": s.exact,
                    "share": s.share,
                    "reason": self.reason(s),
                }
                for s in self.slots
            ],
        }


def parse_steps(document: Any, source: str) -> tuple[list[StepSpec], bool]:
    """(steps, was_array) from a decoded JSON document; errors name `source`, the step and field."""
    was_array = isinstance(document, list)
    items = document if was_array else [document]
    if was_array and not items:
        raise ExplainError(f"{source}: an empty array holds no steps")
    steps = []
    for index, item in enumerate(items):
        where = f"{source}: step[{index}]" if was_array else f"{source}"
        try:
            steps.append(StepSpec.model_validate(item))
        except ValidationError as err:
            first = err.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "(step)"
            raise ExplainError(f"{where}: field {field}: {first['msg']}") from err
    return steps, was_array


def _kernel_work(
    steps: list[StepSpec], batch: SlotBatch, step_index: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(fixed, own) kernel work per slot (us) for the kernel-weighted steps, one kernel per deployment."""
    fixed = np.zeros(step_index.shape[0])
    own = np.zeros(step_index.shape[0])
    by_deployment: dict[str, list[int]] = {}
    for number, step in enumerate(steps):
        if step.weights == "kernel" and step.deployment is not None:
            by_deployment.setdefault(repr(sorted(step.deployment.items())), []).append(number)
    for numbers in by_deployment.values():
        deployment = Deployment.model_validate(steps[numbers[0]].deployment)
        source = KernelWeights.from_deployment(deployment)
        rows = np.flatnonzero(np.isin(step_index, numbers))
        local_steps = np.searchsorted(np.array(numbers), step_index[rows])
        sub = SlotBatch(
            local_steps,
            len(numbers),
            batch.new_tokens[rows],
            batch.context_tokens[rows],
            batch.prompt_tokens[rows],
        )
        fixed_us, slot_us = source.kernel.slot_work_many(sub.kernel_slots, sub.n_steps)
        fixed_cost = steps[numbers[0]].fixed_cost
        if any(steps[n].fixed_cost != fixed_cost for n in numbers):
            raise ExplainError(
                "kernel-weighted steps of one deployment must share a fixed_cost policy"
            )
        own[rows] = np.asarray(slot_us).sum(axis=1)
        fixed[rows] = kernel_work_us(fixed_us, slot_us, sub, fixed_cost) - own[rows]
    return fixed, own


def explain_steps(steps: list[StepSpec]) -> list[ExplainedStep]:
    """Split every step (vectorised over all of them) and keep each slot's reasoning."""
    sizes = np.array([len(s.slots) for s in steps])
    step_index = np.repeat(np.arange(len(steps)), sizes)
    slots = [slot for step in steps for slot in step.slots]
    new_tokens = np.array([s.new_tokens for s in slots], dtype=np.int64)
    context = np.array([s.context for s in slots], dtype=np.int64)
    prompt = np.array(
        [s.context + s.new_tokens if s.prompt_tokens is None else s.prompt_tokens for s in slots],
        dtype=np.int64,
    )
    kv_blocks = np.array([s.kv_blocks for s in slots], dtype=np.float64)
    batch = SlotBatch(step_index, len(steps), new_tokens, context, prompt)

    fitted = np.array([s.weights == "fitted" for s in steps])
    coefficient_rows = [s.coefficients or CoefficientSpec(c0_ms=0, a_ms=0, b_ms=0) for s in steps]
    c0, a, b = (
        np.array([getattr(c, name) for c in coefficient_rows]) for name in ("c0_ms", "a_ms", "b_ms")
    )
    per_token = np.array([s.fixed_cost == "per_token" for s in steps])
    fixed = np.where(
        per_token[step_index],
        split_fixed(c0, batch, "per_token"),
        split_fixed(c0, batch, "per_slot"),
    )
    own = a[step_index] * new_tokens + b[step_index] * attention_pairs(new_tokens, context)
    if not fitted.all():
        kernel_rows = ~fitted[step_index]
        kernel_fixed, kernel_own = _kernel_work(steps, batch, step_index)
        fixed = np.where(kernel_rows, kernel_fixed, fixed)
        own = np.where(kernel_rows, kernel_own, own)
    compute = fixed + own

    alpha = np.array([s.alpha for s in steps])
    totals = np.array(
        [step_total_units(s.step_ms, s.gpus, s.usd_per_gpu_hour, UNITS[s.unit]) for s in steps],
        dtype=np.int64,
    )
    split = blend_and_allocate(totals, step_index, compute, kv_blocks, alpha)
    compute_part, kv_part = split.parts()
    shares, exact, weight = split.shares, split.exact, compute_part + kv_part
    compute_sum = np.bincount(step_index, weights=compute, minlength=len(steps))
    kv_sum = np.bincount(step_index, weights=kv_blocks, minlength=len(steps))

    explained = []
    for number, step in enumerate(steps):
        rows = range(int(sizes[:number].sum()), int(sizes[: number + 1].sum()))
        explained.append(
            ExplainedStep(
                total=int(totals[number]),
                unit=step.unit,
                alpha=step.alpha,
                work_unit="ms" if step.weights == "fitted" else "us",
                weights=Coefficients(
                    step.coefficients.c0_ms, step.coefficients.a_ms, step.coefficients.b_ms
                ).version
                if step.coefficients
                else "kernel",
                slots=[
                    ExplainedSlot(
                        request_id=slots[i].request_id,
                        new_tokens=int(new_tokens[i]),
                        context=int(context[i]),
                        kv_blocks=float(kv_blocks[i]),
                        fixed_work=float(fixed[i]),
                        own_work=float(own[i]),
                        compute_share=float(compute[i] / compute_sum[number])
                        if compute_sum[number]
                        else 0.0,
                        kv_share=float(kv_blocks[i] / kv_sum[number]) if kv_sum[number] else 0.0,
                        weight=float(weight[i]),
                        exact=float(exact[i]),
                        share=int(shares[i]),
                    )
                    for i in rows
                ],
            )
        )
    return explained
