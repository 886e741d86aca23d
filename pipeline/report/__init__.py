"""The HTML report: what each tenant, feature and request cost, where each invoice went, how
reconciliation went, and what bounds each pool's steps."""

from __future__ import annotations

from pathlib import Path

from pipeline.report.data import ReportData, ReportError, Scope, load_report
from pipeline.report.html import render_html
from pipeline.report.money import usd, usd_per
from schemas.config import PoolsFile

__all__ = [
    "ReportData",
    "ReportError",
    "Scope",
    "load_report",
    "render_html",
    "usd",
    "usd_per",
    "write_report",
]


def write_report(
    warehouse: Path, pools: PoolsFile, lake: Path, scope: Scope, out: Path
) -> ReportData:
    """Build the report for `scope` and write it to `out` (atomically: a reader never sees half a page)."""
    data = load_report(warehouse, pools, lake, scope)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(render_html(data), encoding="utf-8")
    partial.replace(out)
    return data
