"""Dependencies point one way: assets/ over pipeline/ over schemas/ over pricing/ (the pools
file names the kernel's deployments; the kernel knows no pools file). The engine hook
(pipeline/hook/) runs inside the customer's inference server: it and the record layout it
writes import the standard library and numpy only."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package -> the first-party packages it must never import
FORBIDDEN = {
    "pipeline": {"assets"},
    "pricing": {"pipeline", "assets", "schemas"},
    "schemas": {"pipeline", "assets"},
}
# What the engine's process loads with the hook: the hook, the record layout, and the
# packages' own __init__ modules, which Python runs on the way in.
HOOK_MODULES = (
    "pipeline/__init__.py",
    "pipeline/hook",
    "schemas/__init__.py",
    "schemas/errors.py",
    "schemas/records.py",
)
# Beside the standard library, the only modules those may import.
HOOK_MAY_IMPORT = ("numpy", "pipeline.hook", "schemas.errors", "schemas.records")
# An engine adapter imports its engine inside functions only, when the engine asks for the
# recording class: importing the adapter must not import the engine.
# SGLang's adapter reads the GPU's name through torch, which SGLang has loaded already.
ENGINE_IMPORTED_LAZILY = {
    "pipeline/hook/vllm.py": ("vllm",),
    "pipeline/hook/sglang.py": ("sglang", "torch"),
}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


class _Imports(ast.NodeVisitor):
    """Every module an import statement names (`from a import b` names `a.b`), with whether the
    statement is inside a function."""

    def __init__(self) -> None:
        self.found: list[tuple[str, bool]] = []
        self._depth = 0

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [(alias.name, self._depth > 0) for alias in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = "." * node.level + (f"{node.module}." if node.module else "")
        self.found += [(module + alias.name, self._depth > 0) for alias in node.names]


def imports(path: Path) -> list[tuple[str, bool]]:
    """(module, inside a function) for every import statement of a module, wherever it is."""
    visitor = _Imports()
    visitor.visit(ast.parse(path.read_text(), filename=str(path)))
    return visitor.found


def imported_packages(path: Path) -> set[str]:
    """Top-level packages a module imports, wherever the import statement is."""
    return {module.split(".")[0] for module, _ in imports(path) if not module.startswith(".")}


def hook_violations(path: Path, relative: str) -> list[str]:
    """Imports of `path` the engine's process must not make."""
    engines = ENGINE_IMPORTED_LAZILY.get(relative, ())

    def engine(module: str) -> bool:
        return any(_within(module, name) for name in engines)

    return [
        f"{module}{' (at module level)' if engine(module) else ''}"
        for module, in_function in imports(path)
        if module.split(".")[0] not in sys.stdlib_module_names
        and not any(_within(module, allowed) for allowed in HOOK_MAY_IMPORT)
        and not (in_function and engine(module))
    ]


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


def _hook_paths() -> list[Path]:
    paths = []
    for entry in HOOK_MODULES:
        path = ROOT / entry
        paths += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return paths


def test_the_hook_imports_the_standard_library_and_numpy_only() -> None:
    offenders = {}
    for path in _hook_paths():
        relative = str(path.relative_to(ROOT))
        offenders[relative] = hook_violations(path, relative)
    assert {path: found for path, found in offenders.items() if found} == {}


def test_the_hook_check_refuses_an_engine_at_module_level_and_anything_else_anywhere(
    tmp_path: Path,
) -> None:
    module = tmp_path / "adapter.py"
    module.write_text(
        "import json\n"
        "import numpy as np\n"
        "import vllm\n"
        "from pipeline.hook.recorder import StepRecorder\n"
        "from schemas import records, config\n"
        "def scheduler():\n"
        "    from vllm.v1.core.sched.scheduler import Scheduler\n"
        "    import pyarrow\n"
        "    from . import sibling\n"
    )
    assert hook_violations(module, "pipeline/hook/vllm.py") == [
        "vllm (at module level)",
        "schemas.config",
        "pyarrow",
        ".sibling",
    ]
    # Another module of the hook may not import vLLM at all.
    assert hook_violations(module, "pipeline/hook/recorder.py") == [
        "vllm",
        "schemas.config",
        "vllm.v1.core.sched.scheduler.Scheduler",
        "pyarrow",
        ".sibling",
    ]


def test_importing_the_vllm_adapter_loads_no_other_package() -> None:
    """The same rule on the real import, in a fresh interpreter: what `import
    pipeline.hook.vllm` adds to the modules of a bare interpreter."""
    program = (
        "import json, sys; before = set(sys.modules); import pipeline.hook.vllm; "
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    loaded = json.loads(
        subprocess.run(
            [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
    )
    first_party = sorted(m for m in loaded if m.split(".")[0] in {"pipeline", "schemas"})
    assert first_party == [
        "pipeline",
        "pipeline.hook",
        "pipeline.hook.format",
        "pipeline.hook.recorder",
        "pipeline.hook.replica",
        "pipeline.hook.vllm",
        "schemas",
        "schemas.errors",
        "schemas.records",
    ]
    others = {m.split(".")[0] for m in loaded} - set(sys.stdlib_module_names)
    assert others == {"numpy", "pipeline", "schemas"}
