"""The read API (`stepledger serve`): request costs, spend, budgets and hour status as JSON,
described by OpenAPI at /openapi.json (and browsable at /docs).

Every route reads through finance connections (`pipeline.finance.snapshot_reader`: read-only,
sealed, each read of one snapshot whose published files are verified), a request's cost from
the index of recent ones (`pipeline.api.index`) where it is held, and calls the query
functions the CLI calls (`pipeline.finance.spend`, `pipeline.budgets`). Every route needs a
bearer token (`stepledger tokens mint`): a tenant's token sees only its own requests, spend
and budgets (another tenant's request is "not found", so its existence does not leak); a
finance token sees all. A bad parameter is a 400 naming it. Money is integer nano-dollars
(`*_nano`) beside exact dollar strings (`*_usd`).
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations as objects,
# and they name dependencies local to create_app.

import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

import duckdb
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

import pipeline.finance
from pipeline.api.index import RequestIndex
from pipeline.api.tokens import TokenEntry, TokenStore
from pipeline.budgets import budget_status
from pipeline.datadir import DataDir
from pipeline.finance.spend import QueryError, Window, hour_status, request_cost, spend
from pipeline.storage.read_only_files import refusal_in
from pipeline.storage.warehouse import SnapshotReader
from schemas.budgets import BudgetsFile, load_budgets
from schemas.units import nano_to_usd, parse_range_bound

Result = TypeVar("Result")
_bearer = HTTPBearer(auto_error=False)
# Warehouse queries answered at once; more wait for a connection. Each runs on one thread
# (READER_CONFIG), so a few use the machine's cores without a connection per waiting request.
READERS = 4


class _Readers:
    """The routes' finance connections: one query at a time on each (DuckDB's rule), opened as
    concurrent queries first need them, up to `size`, and kept for the server's life."""

    def __init__(self, data_dir: Path, size: int) -> None:
        self._data_dir = data_dir
        self._free = threading.BoundedSemaphore(size)
        self._idle: queue.SimpleQueue[SnapshotReader] = queue.SimpleQueue()
        self._opened: list[SnapshotReader] = []

    def run(self, query: Callable[[duckdb.DuckDBPyConnection], Result]) -> Result:
        with self._free:
            try:
                reader = self._idle.get_nowait()
            except queue.Empty:
                reader = pipeline.finance.snapshot_reader(self._data_dir)
                self._opened.append(reader)
            try:
                return reader.read(query)[1]
            finally:
                self._idle.put(reader)

    def close(self) -> None:
        for reader in self._opened:
            reader.close()


def _with_usd(value: Any) -> Any:
    """JSON values: every `*_nano` amount with its exact dollars beside it as `*_usd`."""
    if isinstance(value, list):
        return [_with_usd(v) for v in value]
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out[key] = _with_usd(item)
            if key.endswith("_nano") and isinstance(item, int):
                out[key[: -len("_nano")] + "_usd"] = f"{nano_to_usd(item):f}"
        return out
    if isinstance(value, datetime):
        return value.replace(tzinfo=UTC).isoformat() if value.tzinfo is None else value.isoformat()
    return value


def _window(start: str, end: str) -> Window:
    bounds = []
    for name, text, is_end in (("from", start, False), ("to", end, True)):
        try:
            bounds.append(parse_range_bound(text, end=is_end))
        except ValueError as err:
            raise QueryError(name, str(err)) from None
    return Window(bounds[0], bounds[1])


def create_app(
    data_dir: Path,
    budgets_file: Path | None = None,
    clock: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> FastAPI:
    """The API over the warehouse of `data_dir`, its tokens file, and `budgets_file` if any;
    `clock`: the time budgets are seen at (their month, day and projection)."""
    layout = DataDir(data_dir)
    tokens = TokenStore(layout.api_tokens)
    budgets = load_budgets(budgets_file) if budgets_file is not None else BudgetsFile()
    readers = _Readers(data_dir, READERS)
    index = RequestIndex(data_dir)

    @asynccontextmanager
    async def closing_reader(app: FastAPI) -> AsyncIterator[None]:
        yield
        index.close()
        readers.close()

    app = FastAPI(title="stepledger", version="1", description=__doc__, lifespan=closing_reader)
    # Reachable for a caller that must see a commit at once (the index reloads on its own).
    app.state.request_index = index

    _answer_errors(app)

    Caller = Annotated[TokenEntry, Depends(_authenticator(tokens))]

    def tenant_scope(entry: TokenEntry, asked: str | None) -> str | None:
        if entry.tenant is not None and asked not in (None, entry.tenant):
            raise HTTPException(403, f"tenant: this token reads tenant {entry.tenant!r} only")
        return entry.tenant or asked

    # A gateway asks this for every request: an index hit is answered on the event loop in
    # microseconds, without a hand-over to a worker thread and back; only a miss waits on one.
    @app.get("/v1/requests/{request_id}/cost", summary="A request's cost with its parts")
    async def get_request_cost(request_id: str, entry: Caller) -> Any:
        held, found = index.find(request_id, entry.tenant)
        if not held:
            found = await run_in_threadpool(
                readers.run, lambda con: request_cost(con, request_id, entry.tenant)
            )
        if found is None:
            raise HTTPException(404, f"request_id: no cost for request {request_id!r}")
        return JSONResponse(_with_usd(found))

    @app.get("/v1/spend", summary="Spend over a window, grouped as asked")
    def get_spend(
        entry: Caller,
        start: Annotated[str, Query(alias="from", description="YYYY-MM, YYYY-MM-DD or hour")],
        end: Annotated[str, Query(alias="to", description="inclusive, as from")],
        group_by: Annotated[str, Query(description="comma-separated: tenant,feature,...")] = "",
        tenant: str | None = None,
        pool: str | None = None,
    ) -> Any:
        window = _window(start, end)
        groups = [g for g in group_by.split(",") if g]
        scope = tenant_scope(entry, tenant)
        return _with_usd(
            readers.run(lambda con: spend(con, window, groups, tenant=scope, pool=pool))
        )

    @app.get("/v1/hours", summary="The status of each pool-hour of a window")
    def get_hours(
        entry: Caller,
        start: Annotated[str, Query(alias="from")],
        end: Annotated[str, Query(alias="to")],
        pool: str | None = None,
    ) -> Any:
        window = _window(start, end)
        return _with_usd(readers.run(lambda con: hour_status(con, window, pool)))

    @app.get("/v1/budgets", summary="Budgets: spend, thresholds crossed, projected month-end")
    def get_budgets(entry: Caller, tenant: str | None = None) -> Any:
        scope = tenant_scope(entry, tenant)
        now = clock()
        statuses = readers.run(lambda con: budget_status(con, budgets, now, scope))
        return _with_usd([s.as_json() for s in statuses])

    return app


def _answer_errors(app: FastAPI) -> None:
    """A bad parameter, ours or FastAPI's, is a 400 naming it; a published file that changed,
    a 500 naming it."""

    @app.exception_handler(QueryError)
    async def _bad_parameter(request: Request, err: QueryError) -> JSONResponse:
        return JSONResponse({"error": str(err), "parameter": err.parameter}, status_code=400)

    @app.exception_handler(duckdb.Error)
    async def _refused(request: Request, err: duckdb.Error) -> JSONResponse:
        # A data file changed after its hour was published is named, as the CLI names it;
        # any other failure stays the server's own error.
        refusal = refusal_in(err)
        if refusal is None:
            raise err
        return JSONResponse({"error": str(refusal)}, status_code=500)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        parameter = str(first["loc"][-1])
        return JSONResponse(
            {"error": f"{parameter}: {first['msg']}", "parameter": parameter}, status_code=400
        )


def _authenticator(tokens: TokenStore) -> Callable[..., Awaitable[TokenEntry]]:
    """The dependency that turns the bearer token into its entry (else 401)."""

    # On the event loop: a stat of the tokens file and a hash, not worth a worker thread.
    async def caller(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> TokenEntry:
        entry = None if credentials is None else tokens.lookup(credentials.credentials)
        if entry is None:
            raise HTTPException(
                401,
                "a valid bearer token is required (stepledger tokens mint)",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return entry

    return caller
