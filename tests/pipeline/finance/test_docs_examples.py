"""Every `stepledger sql` / `stepledger costs` example and the Python example in sql/README.md
and docs/warehouse.md runs against a billed warehouse, and where the docs show the output,
the columns shown are the columns the query returns."""

from __future__ import annotations

import itertools
import re
import shlex
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.storage.warehouse import STATE_FILE, connect, record_checks, replace_hour

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "sql" / "README.md", ROOT / "docs" / "warehouse.md"]
HOUR = datetime(2026, 11, 30, 0, tzinfo=UTC)
RUN_DIRS = ("demo-run", "runs/gs")


def examples(doc: Path) -> list[tuple[list[str], str, list[str] | None]]:
    """(argv, standard input, the columns of the output block shown after it, if any)."""
    found = []
    blocks = re.findall(r"```(\w+)\n(.*?)```", doc.read_text(), flags=re.S)
    for index, (kind, body) in enumerate(blocks):
        if kind != "sh":
            continue
        lines = iter(body.splitlines())
        for line in lines:
            if not line.startswith("stepledger sql") and not line.startswith("stepledger costs"):
                continue
            command, heredoc, _ = line.partition("<<'SQL'")
            argv = shlex.split(command.split("#")[0])[1:]
            stdin = (
                "\n".join(itertools.takewhile(lambda sql: sql != "SQL", lines)) if heredoc else ""
            )
            shown = None
            if index + 1 < len(blocks) and blocks[index + 1][0] == "text":
                shown = columns_of(blocks[index + 1][1])
            found.append((argv, stdin, shown))
    return found


def columns_of(table: str) -> list[str]:
    header = next(line for line in table.splitlines() if line.startswith("│"))
    return [cell.strip() for cell in header.strip("│").split("│")]


@pytest.fixture(scope="module")
def billed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("docs")
    stamp: dict[str, list[Any]] = {"hour": [HOUR], "pool": ["chat-8b"]}
    lines = pl.DataFrame(
        {
            **{k: v * 3 for k, v in stamp.items()},
            "tenant": ["acme-support", "acme-support", "platform-inference"],
            "feature": ["support-bot", "support-bot", "(prefix-cache)"],
            "line_kind": ["usage", "idle", "cache_credit"],
            "amount_nano": [900, 110, -10],
            "requests": [3, 0, 0],
            "new_tokens": [300, 0, 0],
            "cached_tokens": [0, 0, 0],
            "weights_version": ["kernel-1"] * 3,
            "policy_version": ["pol-1"] * 3,
        }
    )
    invoice = pl.DataFrame({**stamp, "gpus": [1], "usd_per_gpu_hour": [3.6], "amount_nano": [1000]})
    costs = pl.DataFrame(
        {
            **stamp,
            "request_id": ["r1"],
            "tenant": ["acme-support"],
            "feature": ["support-bot"],
            "api_key_id": ["key-1"],
            "compute_nano": [700],
            "kv_nano": [200],
            "amount_nano": [900],
            "steps": [30],
            "new_tokens": [300],
            "cached_tokens": [0],
            "prompt_tokens": [200],
            "output_tokens": [100],
        }
    )
    with connect(root / STATE_FILE) as con:
        tables = {"invoices": invoice, "ledger_lines": lines, "request_costs": costs}
        replace_hour(con, HOUR, "chat-8b", tables)
        record_checks(con, HOUR, "chat-8b", [], [])
        con.execute(
            "INSERT INTO reconciliation (hour, pool, check_name, passed, expected, observed, "
            "detail) VALUES (?, 'chat-8b', 'money', true, '', '', '')",
            [HOUR.replace(tzinfo=None)],
        )
    steps = root / "lake" / "steps" / "pool=chat-8b" / "hour=2026-11-30T00"
    steps.mkdir(parents=True)
    pl.DataFrame({"start_ns": [0, 10], "end_ns": [5, 20]}).write_parquet(steps / "r0.parquet")
    return root


def in_billed(argv: list[str], root: Path) -> list[str]:
    moved = []
    for arg in argv:
        for run_dir in RUN_DIRS:
            arg = arg.replace(run_dir, str(root))
        moved.append(arg)
    if "--as-of" in moved:
        # The docs' moment is an example; this warehouse was written a moment ago.
        moved[moved.index("--as-of") + 1] = datetime.now(UTC).isoformat()
    return moved


@pytest.mark.parametrize(
    ("argv", "stdin", "shown"),
    [example for doc in DOCS for example in examples(doc)],
    ids=lambda value: " ".join(value)[:60] if isinstance(value, list) else None,
)
def test_the_documented_example_runs(billed: Path, argv, stdin, shown, monkeypatch) -> None:
    monkeypatch.chdir(billed)
    result = CliRunner().invoke(main, in_billed(argv, billed), input=stdin.replace("demo-run/", ""))
    assert result.exit_code == 0, result.output
    if shown is not None:
        assert columns_of(result.output) == shown


def test_the_documented_python_example_runs(billed: Path) -> None:
    text = (ROOT / "docs" / "warehouse.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    scope: dict[str, object] = {}
    exec(code.replace('"demo-run"', repr(str(billed))), scope)
    daily = scope["daily"]
    assert isinstance(daily, pl.DataFrame)
    assert daily.select("tenant", "amount_nano").rows() == [
        ("acme-support", 1010),
        ("platform-inference", -10),
    ]


def test_every_doc_has_examples() -> None:
    assert all(examples(doc) for doc in DOCS)
