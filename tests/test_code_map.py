"""docs/code-map.md says what the code says: its module table is generated from the modules'
docstrings and current, and every path its prose names exists."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def code_map() -> ModuleType:
    spec = importlib.util.spec_from_file_location("code_map", ROOT / "docs" / "code_map.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_module_table_is_the_one_the_docstrings_give() -> None:
    generator = code_map()
    current = generator.MAP.read_text()
    assert generator.rewritten(current) == current, "run `python docs/code_map.py`"


def test_every_package_and_module_says_what_it_is() -> None:
    generator = code_map()
    modules = [p for top in generator.PACKAGES for p in sorted((ROOT / top).rglob("*.py"))]
    assert [str(p.relative_to(ROOT)) for p in modules if not generator.first_sentence(p)] == []


def test_every_path_the_prose_names_exists() -> None:
    prose = code_map().MAP.read_text().partition(code_map().BEGIN)[0]
    named = set(re.findall(r"`((?:pipeline|assets|pricing|schemas|tests)/[\w/.]*)`", prose))
    assert named
    assert sorted(path for path in named if not (ROOT / path).exists()) == []


def test_a_row_shows_the_first_sentence_of_the_docstring(tmp_path: Path) -> None:
    generator = code_map()
    module = tmp_path / "pipeline" / "fresh.py"
    module.parent.mkdir()
    module.write_text('"""A module added since. Its second sentence is left out."""\n')
    assert generator.first_sentence(module) == "A module added since."
