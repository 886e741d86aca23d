"""The simulated fleet's alert sink: a webhook on 127.0.0.1 that keeps what it accepts.

`stepledger simulate --fault sink-down[=ATTEMPTS]` writes SINK_FILE into the run directory:
the sink answers the first ATTEMPTS deliveries with HTTP 500, as an alerting service that is
down does, and accepts the rest. Without the file it accepts every delivery. Point
STEPLEDGER_ALERT_WEBHOOK_URL (with STEPLEDGER_ALERT_FORMAT=slack) at its URL:

    python -m pipeline.simulator.sink RUN_DIR     # prints the URL, serves until SIGINT or SIGTERM
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

SINK_FILE = "alert-sink.json"
REFUSAL_STATUS = 500


def write_sink(run_dir: Path, refused_attempts: int) -> str:
    """Describe a sink that refuses its first `refused_attempts` deliveries; what was done."""
    (run_dir / SINK_FILE).write_text(
        json.dumps({"refused_attempts": refused_attempts, "status": REFUSAL_STATUS}) + "\n"
    )
    return (
        f"the alert webhook ({SINK_FILE}) answers its first {refused_attempts} deliveries "
        f"with HTTP {REFUSAL_STATUS}, then accepts"
    )


@dataclass
class SimulatedSink:
    """What the sink has seen: `accepted` request bodies, and how many it `refused`."""

    url: str
    refused_attempts: int
    status: int
    accepted: list[dict[str, Any]] = field(default_factory=list)
    refused: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, body: dict[str, Any]) -> int:
        with self.lock:
            if self.refused < self.refused_attempts:
                self.refused += 1
                return self.status
            self.accepted.append(body)
            return 200


@contextmanager
def serve_sink(run_dir: Path) -> Iterator[SimulatedSink]:
    """The run directory's sink (see the module docstring), served while the context is open."""
    described = run_dir / SINK_FILE
    spec = json.loads(described.read_text()) if described.is_file() else {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(sink.answer(body))
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    sink = SimulatedSink(
        url=f"http://127.0.0.1:{server.server_port}/hook",
        refused_attempts=int(spec.get("refused_attempts", 0)),
        status=int(spec.get("status", REFUSAL_STATUS)),
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield sink
    finally:
        server.shutdown()
        server.server_close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.simulator.sink", description=__doc__)
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    # A handler, set whatever the process was started with (a shell's background job ignores
    # SIGINT; a parent may have blocked both): CPython runs it in the main thread whichever
    # thread the signal reaches, so the threads numpy and polars start at import cannot take
    # the signal's default action and kill the sink before it closes its server.
    stop = threading.Event()
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    for number in stop_signals:
        signal.signal(number, lambda _number, _frame: stop.set())
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)
    with serve_sink(args.run_dir) as sink:
        print(sink.url, flush=True)
        stop.wait()


if __name__ == "__main__":
    main()
