"""The published ledger summed by tenant, feature, pool, day, hour or line kind over a UTC range
and a choice of tenants, pools and features: the queries `stepledger costs` formats."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from pipeline import finance
from schemas.errors import InputError
from schemas.units import to_warehouse

# --by name -> the columns it groups by, in the order they are listed. A feature belongs to a
# tenant, so grouping by feature keeps the tenant.
BREAKDOWNS = {
    "day": ("day",),
    "hour": ("hour",),
    "pool": ("pool",),
    "tenant": ("tenant",),
    "feature": ("tenant", "feature"),
    "line-kind": ("line_kind",),
}
_COLUMN_ORDER = ("day", "hour", "pool", "tenant", "feature", "line_kind")
# Requests are counted as every view counts them (`charged_requests`, sql/views.sql).
_TOTALS = """CAST(sum(amount_nano) AS BIGINT) AS amount_nano,
       nano_to_usd(sum(amount_nano)) AS amount_usd,
       CAST(coalesce(sum(charged_requests), 0) AS BIGINT) AS requests,
       CAST(sum(new_tokens) AS BIGINT) AS tokens,
       usd_per(sum(amount_nano), sum(charged_requests)) AS usd_per_request,
       usd_per(sum(amount_nano) * 1000, sum(new_tokens)) AS usd_per_1k_tokens"""
HELD_BACK = "SELECT hour, pool, amount_nano, reason FROM held_back_hours"


@dataclass(frozen=True)
class CostFilter:
    """Which published ledger lines to sum: hours in [start, end) (UTC), and only the listed
    tenants, pools and features (empty: all)."""

    start: datetime | None = None
    end: datetime | None = None
    tenants: tuple[str, ...] = ()
    pools: tuple[str, ...] = ()
    features: tuple[str, ...] = ()

    def where(self, *, held_back: bool = False) -> tuple[str, list[object]]:
        """The SQL condition and its parameters (`held_back`: for held_back_hours, which has
        hours and pools only)."""
        conditions: list[str] = ["TRUE"]
        params: list[object] = []
        if self.start is not None:
            conditions.append("hour >= ?")
            params.append(to_warehouse(self.start))
        if self.end is not None:
            conditions.append("hour < ?")
            params.append(to_warehouse(self.end))
        chosen = [("pool", self.pools)]
        if not held_back:
            chosen += [("tenant", self.tenants), ("feature", self.features)]
        for column, values in chosen:
            if values:
                conditions.append(f"{column} IN ({', '.join('?' * len(values))})")
                params.extend(values)
        return " AND ".join(conditions), params


def cost_query(by: Sequence[str], where: CostFilter) -> tuple[str, list[object]]:
    """The SQL summing the published ledger lines matching `where`, grouped by `by`."""
    unknown = [b for b in by if b not in BREAKDOWNS]
    if unknown:
        raise ValueError(f"--by {unknown[0]!r}: not one of {', '.join(BREAKDOWNS)}")
    wanted = {c for b in by for c in BREAKDOWNS[b]}
    columns = [c for c in _COLUMN_ORDER if c in wanted]
    listed = ", ".join(columns)
    condition, params = where.where()
    # Money first within a period, names after: the biggest cost of each day or hour on top.
    periods = [c for c in columns if c in ("day", "hour")]
    order = ", ".join([*periods, "amount_nano DESC", *(c for c in columns if c not in periods)])
    sql = (
        f"SELECT {listed}{', ' if columns else ''}{_TOTALS}\n"
        "FROM (SELECT *, CAST(date_trunc('day', hour) AS DATE) AS day FROM published_ledger_lines)\n"
        f"WHERE {condition}\n" + (f"GROUP BY {listed}\n" if columns else "") + f"ORDER BY {order}"
    )
    return sql, params


def cost_tables(
    data_dir: Path,
    by: Sequence[str] | str = ("tenant",),
    *,
    where: CostFilter | None = None,
    as_of: datetime | None = None,
) -> dict[str, pa.Table]:
    """One finance breakdown ("costs") and the hours held back of the same range and pools
    ("held_back"): now, or as the warehouse stood at `as_of`."""
    where = where or CostFilter()
    sql, params = cost_query((by,) if isinstance(by, str) else by, where)
    held_condition, held_params = where.where(held_back=True)
    queries = (
        ("costs", sql, params),
        ("held_back", f"{HELD_BACK} WHERE {held_condition} ORDER BY hour, pool", held_params),
    )
    with finance.connect(data_dir, as_of=as_of) as con:
        problems = unknown_names(con, where)
        if problems:
            raise UnknownName("; ".join(problems))
        return {name: con.execute(q, p).to_arrow_table() for name, q, p in queries}


def cost_report(
    data_dir: Path,
    by: Sequence[str] | str = ("tenant",),
    *,
    where: CostFilter | None = None,
    as_of: datetime | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """`cost_tables` as rows of plain dicts."""
    tables = cost_tables(data_dir, by, where=where, as_of=as_of)
    return {name: table.to_pylist() for name, table in tables.items()}


class UnknownName(InputError):
    """A filter names a tenant, pool or feature the ledger has never charged."""


# The names each filter matches, from every hour billed (published or held back).
_KNOWN = {
    "tenant": "SELECT DISTINCT tenant FROM ledger_lines ORDER BY 1",
    "pool": "SELECT DISTINCT pool FROM invoices ORDER BY 1",
    "feature": "SELECT DISTINCT feature FROM ledger_lines ORDER BY 1",
}


def unknown_names(con: duckdb.DuckDBPyConnection, where: CostFilter) -> list[str]:
    """Per name in `where` the ledger has never billed: "no tenant `acme` (did you mean
    `acme-support`?)", with the closest known names, or all of them when none is close."""
    problems = []
    for kind, wanted in (
        ("tenant", where.tenants),
        ("pool", where.pools),
        ("feature", where.features),
    ):
        if not wanted:
            continue
        known = [name for (name,) in con.execute(_KNOWN[kind]).fetchall()]
        for name in wanted:
            if name not in known:
                problems.append(f"no {kind} `{name}` ({_suggestion(name, known)})")
    return problems


def _suggestion(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    # A prefix is what is typed most often ("acme" for "acme-support").
    close += [k for k in known if k.startswith(name) and k not in close]
    if close:
        return "did you mean " + " or ".join(f"`{c}`" for c in close[:3]) + "?"
    return "known: " + (", ".join(f"`{k}`" for k in known) or "none")
