"""Work weights: how much of a step each slot caused, from fitted coefficients or the kernel.

Two sources, chosen per pool (`Policies.weights`), each with a version string that every
ledger row records:
- fitted: c0 + sum_i [a t_i + b t_i (L_i + (t_i + 1) / 2)] ms, with c0, a, b from a
  calibration run (`pipeline.attribution.calibration`);
- kernel: the pricing kernel's per-slot work, its per-step fixed part plus each slot's own part.
Either way the fixed part is split per the pool's fixed-cost policy: equally per slot
(every request benefited from the one weight read) or per token.
Speculative drafts, rejected ones included, are inside `new_tokens`, so they count as work.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numba
import numpy as np

from pipeline.attribution.allocator import GroupedRows
from pricing import Kernel, Slots

if TYPE_CHECKING:
    from collections.abc import Mapping

    import polars as pl

    from schemas.config import Pool

FixedCostPolicy = Literal["per_slot", "per_token"]


@dataclass(frozen=True)
class Coefficients:
    """Fitted work-model coefficients in milliseconds; `version` identifies them in the ledger."""

    c0_ms: float
    a_ms: float
    b_ms: float
    version: str = field(default="")

    def __post_init__(self) -> None:
        for name in ("c0_ms", "a_ms", "b_ms"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"coefficient {name}={value!r} must be finite and >= 0")
        if not self.version:
            canonical = json.dumps([self.c0_ms, self.a_ms, self.b_ms])
            object.__setattr__(
                self, "version", "fit-" + hashlib.sha256(canonical.encode()).hexdigest()[:10]
            )


# A slot's columns a work model reads.
TOKEN_COLUMNS = ("new_tokens", "context_tokens", "prompt_tokens")


@dataclass(frozen=True)
class SlotBatch:
    """Slots of many steps, step by step: `step_index` is non-decreasing in 0..n_steps-1.

    `steps` is the resulting layout (step s is rows `steps.offsets[s]:steps.offsets[s + 1]`),
    found once here for every pass over the batch.
    """

    step_index: np.ndarray
    n_steps: int
    new_tokens: np.ndarray
    context_tokens: np.ndarray
    prompt_tokens: np.ndarray
    steps: GroupedRows = field(init=False, repr=False)

    def __post_init__(self) -> None:
        n = self.step_index.shape[0]
        for name in TOKEN_COLUMNS:
            if getattr(self, name).shape[0] != n:
                raise ValueError(
                    f"{name} has {getattr(self, name).shape[0]} rows, step_index has {n}"
                )
        try:
            steps = GroupedRows.of(self.step_index, self.n_steps)
        except ValueError:
            raise ValueError("step_index must be non-decreasing within 0..n_steps-1") from None
        object.__setattr__(self, "steps", steps)

    @classmethod
    def of_slots(
        cls,
        step_index: np.ndarray,
        n_steps: int,
        slots: pl.DataFrame | Mapping[str, np.ndarray],
    ) -> SlotBatch:
        """The batch of slot rows whose token columns are `slots`' (a frame or arrays by name)."""
        return cls(
            step_index=step_index,
            n_steps=n_steps,
            **{name: np.asarray(slots[name], dtype=np.int64) for name in TOKEN_COLUMNS},
        )

    @property
    def slots_per_step(self) -> np.ndarray:
        """Each step's slot count, in step order."""
        return self.steps.sizes

    @property
    def kernel_slots(self) -> Slots:
        """The slots as the pricing kernel reads them."""
        return Slots(self.step_index, self.new_tokens, self.context_tokens, self.prompt_tokens)


def attention_pairs(new_tokens: np.ndarray, context_tokens: np.ndarray) -> np.ndarray:
    """t (L + (t + 1) / 2): each new token attends to the context and to the new tokens before it."""
    t = np.asarray(new_tokens, dtype=np.float64)
    return t * (np.asarray(context_tokens, dtype=np.float64) + (t + 1.0) / 2.0)


def split_fixed(
    fixed_per_step: np.ndarray, batch: SlotBatch, policy: FixedCostPolicy
) -> np.ndarray:
    """Each slot's part of its step's fixed work, per the fixed-cost policy: (n_slots,) from
    (n_steps,), or (n_slots, m) from m columns of fixed work (n_steps, m)."""
    if policy not in ("per_slot", "per_token"):
        raise ValueError(f"unknown fixed-cost policy {policy!r}; expected per_slot or per_token")
    steps = batch.step_index
    slots = batch.slots_per_step.reshape(-1, *([1] * (fixed_per_step.ndim - 1)))
    # A step without slots has no share to give: it is never gathered.
    per_slot: np.ndarray = np.divide(
        fixed_per_step, slots, out=np.zeros(fixed_per_step.shape), where=slots > 0
    )[steps]
    if policy == "per_slot":
        return per_slot
    tokens = batch.new_tokens.astype(np.float64)
    tokens_per_step = np.bincount(steps, weights=tokens, minlength=batch.n_steps)[steps]
    fraction = np.divide(
        tokens, tokens_per_step, out=np.zeros_like(tokens), where=tokens_per_step > 0
    ).reshape(-1, *([1] * (fixed_per_step.ndim - 1)))
    # A step of zero new tokens (holders only, defensive) falls back to per slot.
    split: np.ndarray = np.where(
        (tokens_per_step > 0).reshape(fraction.shape), fixed_per_step[steps] * fraction, per_slot
    )
    return split


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _add_own_work(
    fixed: np.ndarray,
    fixed_index: np.ndarray,
    new_tokens: np.ndarray,
    context: np.ndarray,
    a: float,
    b: float,
    out: np.ndarray,
) -> None:
    """out = fixed[fixed_index] + a t + b t (L + (t + 1) / 2), in the reference allocator's
    operation order (so the shares match it bit for bit). One pass over all rows: a loop per
    step costs three times as much on steps of a few dozen slots."""
    for i in range(out.shape[0]):
        t = float(new_tokens[i])
        out[i] = fixed[fixed_index[i]] + (a * t + b * (t * (context[i] + (t + 1.0) / 2.0)))


def fitted_work_ms(
    coefficients: Coefficients, batch: SlotBatch, policy: FixedCostPolicy
) -> np.ndarray:
    """Each slot's predicted milliseconds: its part of c0 plus a t + b t (L + (t+1)/2)."""
    if policy == "per_slot":
        # c0 / slots, as the reference divides it: one value per step.
        slots = batch.slots_per_step
        fixed = np.divide(coefficients.c0_ms, slots, out=np.zeros(batch.n_steps), where=slots > 0)
        fixed_index = batch.step_index
    else:
        fixed = split_fixed(np.full(batch.n_steps, coefficients.c0_ms), batch, policy)
        fixed_index = np.arange(fixed.shape[0])
    out = np.empty(batch.step_index.shape[0])
    _add_own_work(
        fixed,
        np.ascontiguousarray(fixed_index, dtype=np.int64),
        np.ascontiguousarray(batch.new_tokens, dtype=np.int64),
        np.ascontiguousarray(batch.context_tokens, dtype=np.int64),
        coefficients.a_ms,
        coefficients.b_ms,
        out,
    )
    return out


def kernel_work_us(
    fixed_us: np.ndarray, slot_us: np.ndarray, batch: SlotBatch, policy: FixedCostPolicy
) -> np.ndarray:
    """Each slot's kernel work: its part of the step's fixed time plus its own, summed over resources.

    `fixed_us` is (n_steps, resources) and `slot_us` (n_slots, resources), as the kernel's
    `slot_work_many` returns them; the sum over resources is the NoOverlap estimate's split.
    """
    fixed = np.asarray(fixed_us, dtype=np.float64)
    own = np.asarray(slot_us, dtype=np.float64)
    fixed_total = fixed.sum(axis=1) if fixed.ndim == 2 else fixed
    own_total = own.sum(axis=1) if own.ndim == 2 else own
    if fixed_total.shape[0] != batch.n_steps or own_total.shape[0] != batch.step_index.shape[0]:
        raise ValueError(
            f"kernel returned {fixed_total.shape[0]} steps x {own_total.shape[0]} slots, "
            f"expected {batch.n_steps} x {batch.step_index.shape[0]}"
        )
    return split_fixed(fixed_total, batch, policy) + own_total


@dataclass(frozen=True)
class PricedBatch:
    """A batch priced by a pool's kernel (`slot_work_many`): each step's fixed work
    (n_steps, resources) and each slot's own (n_slots, resources), in us."""

    kernel_version: str
    fixed_us: np.ndarray
    slot_us: np.ndarray

    def resource_work_us(self, batch: SlotBatch, policy: FixedCostPolicy) -> np.ndarray:
        """Each slot's work on each resource (n_slots, resources): its own part plus its share
        of the step's fixed part under the fixed-cost policy."""
        work: np.ndarray = split_fixed(self.fixed_us, batch, policy) + self.slot_us
        return work


class WeightSource(Protocol):
    """What attribute_hour needs from a work-weight source."""

    @property
    def version(self) -> str:
        """The version id the ledger rows record for these weights."""

    def compute_work(
        self, batch: SlotBatch, policy: FixedCostPolicy, priced: PricedBatch | None = None
    ) -> np.ndarray:
        """Each slot's work. `priced`: the batch as the pool's kernel priced it, if it was."""
        ...

    def kv_bytes_per_token(self) -> int | None:
        """Bytes of KV cache per token when KV is priced in byte-seconds; None for block-seconds."""


@dataclass(frozen=True)
class FittedWeights:
    """Work from calibrated coefficients (ms); KV memory is priced in block-seconds."""

    coefficients: Coefficients

    @property
    def version(self) -> str:
        """The coefficients' version id."""
        return self.coefficients.version

    def compute_work(
        self, batch: SlotBatch, policy: FixedCostPolicy, priced: PricedBatch | None = None
    ) -> np.ndarray:
        """Each slot's work in ms from the fitted coefficients."""
        return fitted_work_ms(self.coefficients, batch, policy)

    def kv_bytes_per_token(self) -> int | None:
        """None: fitted weights price KV in block-seconds."""
        return None


@dataclass(frozen=True)
class KernelWeights:
    """Work from the pricing kernel (us); KV memory is priced in byte-seconds.

    `kernel` is anything with the kernel's `slot_work_many(slots, n_steps)` and
    `kv_bytes_per_token`.
    """

    kernel: Any
    version: str

    @classmethod
    def from_deployment(cls, deployment: Any) -> KernelWeights:
        """Build the kernel for a pricing.Deployment; its version hashes the deployment, the
        laws' revision and the chip and model files."""

        kernel = Kernel.build(deployment)
        return cls(kernel, kernel.version)

    @classmethod
    def for_pool(cls, pool: Pool) -> KernelWeights:
        """The weights of the pool's deployment."""
        return cls.from_deployment(pool.deployment())

    def compute_work(
        self, batch: SlotBatch, policy: FixedCostPolicy, priced: PricedBatch | None = None
    ) -> np.ndarray:
        """Each slot's work in us, from `priced` when it is this kernel's pricing of the batch."""
        # Pricing a busy hour's slots is most of attributing it: done once when it can be.
        if priced is None or priced.kernel_version != self.version:
            priced = self.price(batch)
        return kernel_work_us(priced.fixed_us, priced.slot_us, batch, policy)

    def price(self, batch: SlotBatch) -> PricedBatch:
        """The batch priced by the kernel: each step's fixed work and each slot's own (us)."""
        return PricedBatch(
            self.version, *self.kernel.slot_work_many(batch.kernel_slots, batch.n_steps)
        )

    def kv_bytes_per_token(self) -> int | None:
        """The deployment's KV cache bytes per token."""
        return int(self.kernel.kv_bytes_per_token)
