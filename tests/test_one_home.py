"""Each unit conversion and each data-directory path has one home: `schemas/units.py` turns
dollars into nano-dollars, seconds and hours into nanoseconds and instants into the
warehouse's naive UTC; `pipeline/datadir.py` knows where a data directory keeps what. A copy
elsewhere is how two modules came to disagree, so the code outside those homes is read here for
the marks a copy leaves. (ruff's banned-API rule, TID251 in pyproject.toml, keeps out the
datetime calls that read a naive clock.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNITS_HOME = "schemas/units.py"
DATADIR_HOME = "pipeline/datadir.py"
# Nanoseconds per second, per hour; milliseconds per hour.
UNIT_LITERALS = {1_000_000_000, 3_600_000_000_000, 3_600_000}
UNIT_NAME = re.compile(r"^_?([A-Z]+_PER_USD|(NS|US|MS)_PER_[A-Z]+|HOUR_[MN]S)$")
DATA_DIR_NAMES = {
    "outbox",
    "gateway",
    "dcgm",
    "lake",
    "redelivery",
    "warehouse",
    "pools.yaml",
    "calibration.yaml",
    "pipeline.duckdb",
    "warehouse.duckdb",
}


def copies(path: Path, relative: str) -> set[tuple[str, int, str]]:
    """The marks of a unit conversion or a data-directory path in one module."""
    found: set[tuple[str, int, str]] = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if relative != UNITS_HOME:
            found |= _unit_marks(node, relative)
        if relative != DATADIR_HOME:
            found |= _path_marks(node, relative)
    return found


def _unit_marks(node: ast.AST, relative: str) -> set[tuple[str, int, str]]:
    marks = set()
    if isinstance(node, ast.keyword) and node.arg == "tzinfo":
        value = node.value
        if isinstance(value, ast.Constant) and value.value is None:
            marks.add((relative, node.lineno, "tzinfo=None"))
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        if node.value in UNIT_LITERALS:
            marks.add((relative, node.lineno, f"literal {node.value}"))
    elif isinstance(node, ast.Assign | ast.AnnAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            if isinstance(target, ast.Name) and UNIT_NAME.match(target.id):
                marks.add((relative, node.lineno, f"defines {target.id}"))
    return marks


def _path_marks(node: ast.AST, relative: str) -> set[tuple[str, int, str]]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        right = node.right
        if isinstance(right, ast.Constant) and right.value in DATA_DIR_NAMES:
            return {(relative, node.lineno, f"path / {right.value!r}")}
    return set()


def test_conversions_and_data_directory_paths_live_in_their_homes() -> None:
    found = set()
    for package in ("pipeline", "assets", "schemas", "benchmarks"):
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = str(path.relative_to(ROOT))
            found |= copies(path, relative)
    assert found == set()


@pytest.mark.parametrize(
    ("source", "mark"),
    [
        ("when = moment.replace(tzinfo=None)\n", "tzinfo=None"),
        ("span = hours * 3_600_000_000_000\n", "literal 3600000000000"),
        ("ns = seconds * 1_000_000_000\n", "literal 1000000000"),
        ("MICRO_PER_USD: int = 10**6\n", "defines MICRO_PER_USD"),
        ("lake = data_dir / 'lake'\n", "path / 'lake'"),
    ],
)
def test_the_check_sees_each_kind_of_copy(tmp_path: Path, source: str, mark: str) -> None:
    module = tmp_path / "module.py"
    module.write_text(source)
    assert copies(module, "pipeline/module.py") == {("pipeline/module.py", 1, mark)}


def test_the_homes_themselves_may_convert(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text("NS_PER_SECOND = 1_000_000_000\nlake = root / 'lake'\n")
    assert copies(module, UNITS_HOME) == {(UNITS_HOME, 2, "path / 'lake'")}
