"""Pricing a step: a per-layer, five-resource model of one engine step on a GPU deployment.

Chips and model graphs are YAML data under `pricing/chips/` and `pricing/models/`; the laws
are pure functions in `pricing.laws`; `Kernel` composes them for one deployment.
"""

from __future__ import annotations

from pricing.kernel import (
    RESOURCES,
    Deployment,
    Kernel,
    SlotWork,
    StepPrice,
    StepPrices,
    deployment_for_pool,
)
from pricing.spec import PricingError, chip_names, load_chip, load_model, model_names

__all__ = [
    "RESOURCES",
    "Deployment",
    "Kernel",
    "PricingError",
    "SlotWork",
    "StepPrice",
    "StepPrices",
    "chip_names",
    "deployment_for_pool",
    "load_chip",
    "load_model",
    "model_names",
]
