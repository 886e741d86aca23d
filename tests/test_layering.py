"""Dependencies point one way: assets/ over pipeline/ over schemas/ over pricing/ (the pools
file names the kernel's deployments; the kernel knows no pools file)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package -> the first-party packages it must never import
FORBIDDEN = {
    "pipeline": {"assets"},
    "pricing": {"pipeline", "assets", "schemas"},
    "schemas": {"pipeline", "assets"},
}


def imported_packages(path: Path) -> set[str]:
    """Top-level packages a module imports, wherever the import statement is."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_never_imports_the_layers_above_it(package: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) & FORBIDDEN[package])
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_check_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text("def run():\n    from assets.definitions import defs\n")
    assert imported_packages(module) == {"assets"}
