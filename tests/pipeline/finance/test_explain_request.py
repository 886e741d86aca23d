"""`stepledger explain` formats what the attribution bills: it prices, weighs and splits
nothing itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
# Where prices, weights and splits are computed: explain reads their results instead.
PRICING_AND_ALLOCATION = {
    "pricing",
    "pipeline.attribution.allocator",
    "pipeline.attribution.clock",
    "pipeline.attribution.kv",
    "pipeline.attribution.layout",
    "pipeline.attribution.rollup",
    "pipeline.attribution.workmodel",
}


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports by name, and each of its parent packages."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            parts = name.split(".")
            found |= {".".join(parts[:n]) for n in range(1, len(parts) + 1)}
    return found


@pytest.mark.parametrize(
    "module", ["pipeline/finance/explain_request.py", "pipeline/cli/explain_request.py"]
)
def test_explain_imports_no_pricing_or_allocation(module: str) -> None:
    assert imported_modules(ROOT / module) & PRICING_AND_ALLOCATION == set()


def test_explain_takes_its_rows_from_the_attribution_that_bills() -> None:
    imported = imported_modules(ROOT / "pipeline/finance/explain_request.py")
    assert "pipeline.attribution.attribute.attribute_pool_hour" in imported


def test_the_check_sees_a_from_import_of_a_submodule(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text("def run():\n    from pipeline.attribution import allocator\n")
    assert imported_modules(module) & PRICING_AND_ALLOCATION == {"pipeline.attribution.allocator"}
