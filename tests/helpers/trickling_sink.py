"""A webhook that never finishes answering, for deadlines on alert delivery."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class TricklingSink:
    """A local HTTP endpoint that reads a request, then answers one byte at a time, a byte
    every `interval_s`, never finishing, until the client goes away or the test stops it: no
    single read ever waits long enough for a per-read timeout."""

    def __init__(self, path: str, interval_s: float) -> None:
        self.got_request = threading.Event()
        self.client_gone = threading.Event()
        self.stopping = threading.Event()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                sink.got_request.set()
                answer = b"HTTP/1.1 200 OK\r\n" + b"X-Trickle: " + b"." * 1_000_000
                for byte in answer:
                    if sink.stopping.wait(interval_s):
                        return
                    try:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                    except OSError:
                        sink.client_gone.set()
                        return

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}{path}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> TricklingSink:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
