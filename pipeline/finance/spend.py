"""What a gateway or finance asks while hours run: a request's cost, spend over a window, the
status of hours. Final figures where the hour is published, provisional ones (pipeline.live)
where it is not, each row saying which. The API (`stepledger serve`) and the CLI call these
functions on a finance connection (`pipeline.finance.connect`); `tenant` confines a query to
one tenant's requests and spend.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import duckdb

from pipeline.live.price import PROVISIONAL_NOTE
from schemas.errors import InputError
from schemas.units import to_warehouse

# What spend can be grouped by: spend_lines' columns, and the day of the hour.
SPEND_GROUPS = ("tenant", "feature", "pool", "line_kind", "basis", "hour", "day")
_REQUEST_COLUMNS = (
    "hour, pool, tenant, feature, line_kind, amount_nano, compute_nano, kv_nano, steps, "
    "new_tokens, cached_tokens"
)
_PARTS = ("amount_nano", "compute_nano", "kv_nano", "steps", "new_tokens", "cached_tokens")


class QueryError(InputError):
    """A query parameter is invalid; `parameter` names it."""

    def __init__(self, parameter: str, message: str) -> None:
        super().__init__(f"{parameter}: {message}")
        self.parameter = parameter


@dataclass(frozen=True)
class Window:
    """A UTC window of hours, [start, end)."""

    start: datetime
    end: datetime

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            if getattr(self, name).tzinfo is None:
                raise QueryError(name, "give a time zone (UTC)")
        if self.end <= self.start:
            raise QueryError("to", f"{self.end.isoformat()} is not after {self.start.isoformat()}")

    def params(self) -> list[datetime]:
        return [to_warehouse(self.start), to_warehouse(self.end)]


def _rows(con: duckdb.DuckDBPyConnection, sql: str, params: list[Any]) -> list[dict[str, Any]]:
    cursor = con.execute(sql, params)
    names = [d[0] for d in cursor.description or []]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def _request_hours(
    con: duckdb.DuckDBPyConnection, where: str, params: list[Any]
) -> list[dict[str, Any]]:
    """Request-hours matching `where` (over request_id, tenant, hour): final where the hour is
    published, provisional where it is not (with the UTC end of the last step priced, ns);
    ordered by request, hour and pool."""
    return _rows(
        con,
        f"SELECT request_id, {_REQUEST_COLUMNS}, 'final' AS basis, "
        "CAST(NULL AS BIGINT) AS last_step_end_utc_ns FROM cost_per_request "
        f"WHERE {where} UNION ALL "
        f"SELECT request_id, {_REQUEST_COLUMNS}, 'provisional', last_step_end_utc_ns "
        "FROM provisional_cost_per_request c "
        f"WHERE {where} AND NOT EXISTS (SELECT 1 FROM published_hours p "
        "WHERE p.hour = c.hour AND p.pool = c.pool) ORDER BY request_id, hour, pool",
        params + params,
    )


def assemble_request_cost(request_id: str, hours: list[dict[str, Any]]) -> dict[str, Any]:
    """A request's cost from its request-hours (`_request_hours` rows): totals of its parts,
    its basis (final, provisional or mixed) and the provisional note where it applies."""
    bases = {h["basis"] for h in hours}
    return {
        "request_id": request_id,
        "tenant": hours[-1]["tenant"],
        "feature": hours[-1]["feature"],
        "basis": bases.pop() if len(bases) == 1 else "mixed",
        **{part: sum(int(h[part]) for h in hours) for part in _PARTS},
        "hours": [{k: v for k, v in h.items() if k != "request_id"} for h in hours],
        "note": PROVISIONAL_NOTE if any(h["basis"] == "provisional" for h in hours) else None,
    }


def request_cost(
    con: duckdb.DuckDBPyConnection, request_id: str, tenant: str | None = None
) -> dict[str, Any] | None:
    """A request's cost with its parts, per hour it ran in: final where the hour is published,
    provisional where it is not. None when the request is unknown (or, with `tenant`, another
    tenant's)."""
    where, params = "request_id = ?", [request_id]
    if tenant is not None:
        where, params = where + " AND tenant = ?", [request_id, tenant]
    hours = _request_hours(con, where, params)
    return assemble_request_cost(request_id, hours) if hours else None


def recent_request_hours(
    con: duckdb.DuckDBPyConnection, hours: int
) -> dict[str, list[dict[str, Any]]]:
    """Per request, its request-hours in the `hours` latest hours the warehouse holds (final
    or provisional): what a server keeps at hand to answer lookups without a query."""
    latest = con.execute(
        "SELECT max(hour) FROM (SELECT max(hour) AS hour FROM invoices "
        "UNION ALL SELECT max(hour) FROM provisional_lines)"
    ).fetchall()[0][0]
    if latest is None:
        return {}
    by_request: dict[str, list[dict[str, Any]]] = {}
    for row in _request_hours(con, "hour > ?", [latest - timedelta(hours=hours)]):
        by_request.setdefault(row["request_id"], []).append(row)
    return by_request


def spend(
    con: duckdb.DuckDBPyConnection,
    window: Window,
    group_by: list[str],
    *,
    tenant: str | None = None,
    pool: str | None = None,
) -> list[dict[str, Any]]:
    """Spend in the window grouped by `group_by` (of SPEND_GROUPS), final and provisional
    together (group by `basis` to tell them apart); largest first."""
    unknown = [g for g in group_by if g not in SPEND_GROUPS]
    if unknown or len(set(group_by)) != len(group_by):
        raise QueryError(
            "group_by", f"{unknown or group_by} not distinct names of {', '.join(SPEND_GROUPS)}"
        )
    columns = [
        "CAST(date_trunc('day', hour) AS DATE) AS day" if g == "day" else g for g in group_by
    ]
    filters = ["hour >= ?", "hour < ?"]
    params: list[Any] = list(window.params())
    for column, value in (("tenant", tenant), ("pool", pool)):
        if value is not None:
            filters.append(f"{column} = ?")
            params.append(value)
    keys = ", ".join([*columns, ""])
    grouping = f"GROUP BY {', '.join(str(i + 1) for i in range(len(columns)))}" if columns else ""
    rows = _rows(
        con,
        f"SELECT {keys}CAST(sum(amount_nano) AS BIGINT) AS amount_nano, "
        "CAST(sum(new_tokens) AS BIGINT) AS new_tokens, "
        "bool_or(basis = 'provisional') AS includes_provisional "
        f"FROM spend_lines WHERE {' AND '.join(filters)} {grouping} "
        f"ORDER BY amount_nano DESC{''.join(f', {i + 1}' for i in range(len(columns)))}",
        params,
    )
    for row in rows:
        row["note"] = PROVISIONAL_NOTE if row["includes_provisional"] else None
    return rows


def hour_status(
    con: duckdb.DuckDBPyConnection, window: Window, pool: str | None = None
) -> list[dict[str, Any]]:
    """Each pool-hour of the window: published, held back (and why) or provisional."""
    scope = "" if pool is None else " AND pool = ?"
    return _rows(
        con,
        f"SELECT hour, pool, status, reason FROM hour_status WHERE hour >= ? AND hour < ?{scope} "
        "ORDER BY hour, pool",
        window.params() + ([] if pool is None else [pool]),
    )
