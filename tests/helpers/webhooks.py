"""Local HTTP endpoints standing in for an alert webhook, each served by a thread of the test
that is stopped when the `with` block ends."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self


class LocalEndpoint:
    """Serves POSTs to `http://127.0.0.1:<port><path>` with `on_post(handler)`."""

    def __init__(self, path: str, on_post: Callable[[BaseHTTPRequestHandler], None]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                on_post(self)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}{path}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


class TricklingSink(LocalEndpoint):
    """Reads a request, then answers one byte at a time, a byte every `interval_s`, never
    finishing, until the client goes away or the test stops it: no single read ever waits
    long enough for a per-read timeout."""

    def __init__(self, path: str, interval_s: float) -> None:
        self.got_request = threading.Event()
        self.client_gone = threading.Event()
        self.stopping = threading.Event()
        self.interval_s = interval_s
        super().__init__(path, self._trickle)

    def _trickle(self, handler: BaseHTTPRequestHandler) -> None:
        handler.rfile.read(int(handler.headers["Content-Length"]))
        self.got_request.set()
        answer = b"HTTP/1.1 200 OK\r\n" + b"X-Trickle: " + b"." * 1_000_000
        for byte in answer:
            if self.stopping.wait(self.interval_s):
                return
            try:
                handler.wfile.write(bytes([byte]))
                handler.wfile.flush()
            except OSError:
                self.client_gone.set()
                return

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        super().__exit__(*exc)


class RecordingSink(LocalEndpoint):
    """Keeps every POSTed JSON body and answers 202; a `held` one answers only once the test
    sets `release`: a sink that is slow for as long as the test says."""

    def __init__(self, path: str = "/hooks/pages", *, held: bool = False) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.got_request = threading.Event()
        self.release = threading.Event()
        if not held:
            self.release.set()
        super().__init__(path, self._record)

    def _record(self, handler: BaseHTTPRequestHandler) -> None:
        body = handler.rfile.read(int(handler.headers["Content-Length"]))
        self.bodies.append(json.loads(body))
        self.got_request.set()
        self.release.wait()
        handler.send_response(202)
        handler.end_headers()

    def __exit__(self, *exc) -> None:
        self.release.set()
        super().__exit__(*exc)
