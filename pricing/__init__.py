"""Pricing a step: a per-layer, five-resource model of one engine step on a GPU deployment.

Chips and model graphs are YAML data under `pricing/chips/` and `pricing/models/`; the laws
are pure functions in `pricing.laws`; `Kernel` composes them for one deployment.
"""

from __future__ import annotations

from pricing.deployment import GRAPH_MODES, CudagraphMode, Deployment
from pricing.kernel import RESOURCES, Kernel, Slots, SlotWork, StepPrice, StepPrices
from pricing.spec import PricingError, chip_names, load_chip, load_model, model_names

__all__ = [
    "GRAPH_MODES",
    "RESOURCES",
    "CudagraphMode",
    "Deployment",
    "Kernel",
    "PricingError",
    "SlotWork",
    "Slots",
    "StepPrice",
    "StepPrices",
    "chip_names",
    "load_chip",
    "load_model",
    "model_names",
]
