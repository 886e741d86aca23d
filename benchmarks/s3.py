"""The benchmarks' S3 server: one SeaweedFS server on loopback for every benchmark of a run
that ships to one, started on first use and killed when the run's process exits (a stop waits
out its filer's farewell to its subscribers; nothing it holds is kept). Each benchmark writes
below a prefix of its own."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

from pipeline.ship.s3server import S3Server


def _discard(server: S3Server, scratch: Path) -> None:
    server.kill()
    shutil.rmtree(scratch, ignore_errors=True)


@functools.cache
def s3_server() -> S3Server:
    """The run's S3 server, started by the first benchmark that asks for it."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-s3-"))
    server = S3Server(scratch / "s3")
    atexit.register(_discard, server, scratch)
    return server.start()
