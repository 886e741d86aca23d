"""The registry of findings as the markdown table `docs/production.md` shows between its
markers; `python -m pipeline.reconcile.findings_doc docs/production.md` rewrites it."""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.reconcile.findings import FINDINGS


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def findings_table() -> str:
    """The registry as a markdown table, one row per finding kind."""
    header = (
        "| check | finding | scope | severity | holds the hour back | what it means | what to do "
        "| what releases the hour |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    rows = [
        f"| {kind.check} | `{kind.code}` | {kind.scope}"
        + (f" (`weights: {kind.weights}`)" if kind.weights else "")
        + f" | {kind.severity} | {'yes' if kind.blocks else 'no'} | {_cell(kind.description)}"
        f" | {_cell(kind.runbook)} | {_cell(kind.releases) or 'not held: the hour is published'} |"
        for kind in FINDINGS
    ]
    return header + "\n".join(rows) + "\n"


TABLE_BEGIN = (
    "<!-- findings table: generated from pipeline/reconcile/findings.py "
    "(python -m pipeline.reconcile.findings_doc docs/production.md) -->\n"
)
TABLE_END = "<!-- end of findings table -->\n"


def with_findings_table(document: str) -> str:
    """`document` with the text between the table's markers replaced by `findings_table()`."""
    begin = document.index(TABLE_BEGIN) + len(TABLE_BEGIN)
    end = document.index(TABLE_END, begin)
    return document[:begin] + findings_table() + document[end:]


if __name__ == "__main__":
    for name in sys.argv[1:]:
        path = Path(name)
        path.write_text(with_findings_table(path.read_text()))
