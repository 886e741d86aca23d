"""No function is over MAX_FUNCTION_LINES lines, numba kernels aside: numba compiles a kernel
as one loop, and splitting it would cost a call per iteration. (Ruff's C901 holds the
complexity; see pyproject.toml.)"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "assets", "pricing", "schemas")
MAX_FUNCTION_LINES = 80
NUMBA_DECORATORS = {"njit", "jit", "numba.njit", "numba.jit"}


def is_numba_kernel(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether a decorator is numba's njit or jit, bare or called (`@njit(cache=True)`)."""
    for decorator in function.decorator_list:
        named = decorator.func if isinstance(decorator, ast.Call) else decorator
        if ast.unparse(named) in NUMBA_DECORATORS:
            return True
    return False


def long_functions(root: Path, packages: tuple[str, ...]) -> list[str]:
    """`path:line name length` of each function in `packages` (under `root`) over
    MAX_FUNCTION_LINES lines that is no numba kernel."""
    offenders = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                assert node.end_lineno is not None
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES and not is_numba_kernel(node):
                    where = path.relative_to(root)
                    offenders.append(f"{where}:{node.lineno} {node.name} {length}")
    return offenders


def test_no_function_is_over_the_length_limit() -> None:
    assert long_functions(ROOT, PACKAGES) == []


def test_the_scan_skips_numba_kernels_and_names_long_plain_functions(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "kernels.py").write_text(
        "import numba\nfrom numba import njit\n\n\n"
        f"def plain():\n{body}\n\n"
        f"@njit(cache=True)\ndef compiled():\n{body}\n\n"
        f"@numba.jit\ndef jitted():\n{body}\n\n"
        "def short():\n    return 1\n",
        encoding="utf-8",
    )
    assert long_functions(tmp_path, ("code",)) == [
        f"code/kernels.py:5 plain {MAX_FUNCTION_LINES + 1}"
    ]
