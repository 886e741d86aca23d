"""Lets SGLang import beside the CPU build of torch.

PyPI's torchvision is built against CUDA torch, so its operators cannot load beside the CPU
torch, and its import then fails registering fake kernels for the two operators below. SGLang
(and transformers, once torchvision is installed) import torchvision's image transforms, pure
Python, at import time; declaring the two operators' schemas lets that import through. Nothing
here calls them.
"""

from __future__ import annotations

import torch


def declare_torchvision_operators() -> None:
    """Call before importing SGLang."""
    for operator in ("nms", "qnms"):
        if not torch._C._dispatch_has_kernel(f"torchvision::{operator}"):
            torch.library.define(
                f"torchvision::{operator}",
                "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            )
