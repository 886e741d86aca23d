from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.attribution.calibration import CalibrationMissing
from pipeline.attribution.weights import kernel_weights, weight_source
from pipeline.attribution.workmodel import KernelWeights
from schemas.config import load_pools

POOLS = load_pools()
CHAT = POOLS.pool("chat-8b")
FITTED = CHAT.model_copy(
    update={"policies": CHAT.policies.model_copy(update={"weights": "fitted"})}
)


def test_a_pools_kernel_is_built_once_and_serves_kernel_weights(tmp_path: Path) -> None:
    first = kernel_weights(CHAT)
    assert isinstance(first, KernelWeights)
    assert kernel_weights(CHAT.model_copy()) is first
    assert weight_source(CHAT, None, tmp_path / "absent.yaml") is first


def test_fitted_weights_need_an_engine_version_and_its_calibration(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pool 'chat-8b': no segments ingested, so no engine"):
        weight_source(FITTED, None, tmp_path / "calibration.yaml")
    with pytest.raises(CalibrationMissing, match="no calibration for model 'llama-3.1-8b"):
        weight_source(FITTED, ("0.11.0", "570.172.08"), tmp_path / "calibration.yaml")
