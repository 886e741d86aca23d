"""The read API (`pipeline.api.app`) served on a loopback port in a thread of the test, and a
real HTTP client with a finance token and a tenant's."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import uvicorn

from pipeline.api.app import create_app
from pipeline.api.tokens import mint
from pipeline.datadir import DataDir


@dataclass
class Api:
    base: str
    app: Any
    finance: str
    tenant: str

    def get(self, path: str, token: str) -> tuple[int, Any]:
        request = urllib.request.Request(
            self.base + path, headers={"Authorization": f"Bearer {token}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return answer.status, json.load(answer)
        except urllib.error.HTTPError as err:
            return err.code, json.load(err)

    def committed(self) -> None:
        """Make the server's index read the latest commit now (it reloads on its own too)."""
        self.app.state.request_index.refresh()


@contextmanager
def serving(
    data: Path, tenant: str, clock: Callable[[], datetime] = lambda: datetime.now(UTC)
) -> Iterator[Api]:
    """The API over `data` on a loopback port, listening before the server thread starts;
    `tenant` the tenant of the tenant token, `clock` the time budgets are seen at."""
    layout = DataDir(data)
    finance_token = mint(layout.api_tokens, "finance", None)
    tenant_token = mint(layout.api_tokens, tenant, tenant)
    app = create_app(data, clock=clock)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    try:
        host, port = sock.getsockname()
        yield Api(f"http://{host}:{port}", app, finance_token, tenant_token)
    finally:
        server.should_exit = True
        thread.join()
        sock.close()
