"""Cost while it happens: how soon a finished request's provisional cost is readable, how far
provisional usage is from the hourly ledger's, what the API answers at 200 requests/s, and the
live path's CPU per GPU-hour beside the hourly attribution's.

A busy pool (the default chat pool, four replicas) is simulated (kept between runs:
`benchmarks.simulated`) with the recorder's 15 s rotation and its segments delivered as their
recorders would ship them (`OutboxReplay`); every 5 s of simulated time (the live service's
interval) a cycle prices what arrived and the API's index reloads. A request's latency is the
simulated wait from its last step to the cycle that found its segment (rotation and polling),
plus the measured time of that cycle, the index reload and an HTTP lookup. The hourly
attribution then prices the same steps in one go (`attribute_hour`, as the hourly path does)
for the comparison and its CPU time. The API figure is measured against a `stepledger serve`
child process, the client in this process sending lookups on schedule (latency counted from
the scheduled time).
"""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import polars as pl

from benchmarks.figure import Figure
from benchmarks.simulated import simulated
from pipeline import finance
from pipeline.api.index import RequestIndex
from pipeline.api.tokens import mint
from pipeline.attribution.hour import attribute_hour
from pipeline.attribution.weights import kernel_weights
from pipeline.datadir import DataDir
from pipeline.hook.recorder import ROTATE_SECONDS
from pipeline.ingestion.decoder import read_segments
from pipeline.ingestion.gateway import key_salt, read_gateway_file
from pipeline.ingestion.ingest import segment_files
from pipeline.live.price import USAGE_KINDS
from pipeline.live.replay import OutboxReplay
from pipeline.live.service import DEFAULT_INTERVAL_S, LivePricer
from pipeline.storage.warehouse import query_frame
from schemas.config import load_pools
from schemas.units import HOUR_NS, NS_PER_SECOND, hour_start_ns

ROOT = Path(__file__).resolve().parents[1]
POOL = "chat-8b"
API_RATE = 200
API_CLIENTS = 4


def _simulated(hours: float) -> Path:
    """The busy pool simulated for `hours` hours, from the cache when already there: the
    replay reads it and never writes it."""
    pools = load_pools()
    pools = pools.model_copy(update={"pools": [pools.pool(POOL)]})
    return simulated(
        f"live-{hours:g}h", pools, hours=hours, seed=3, rotate_seconds=ROTATE_SECONDS, workers=2
    )


def _finish_ns(source: Path) -> dict[str, int]:
    """Each request's finish: the end of the last step it had a slot in (UTC ns)."""
    log = read_segments(segment_files(DataDir(source).outbox))
    steps = pl.from_arrow(log.steps.select(["replica", "seq", "end_utc_ns"]))
    slots = pl.from_arrow(log.slots.select(["replica", "seq", "request_id"]))
    assert isinstance(steps, pl.DataFrame)
    assert isinstance(slots, pl.DataFrame)
    ends = slots.join(steps, on=["replica", "seq"]).group_by("request_id").agg(pl.max("end_utc_ns"))
    return dict(ends.iter_rows())


def _readable_now(index: RequestIndex, finish: dict[str, int], waiting: set[str]) -> list[str]:
    """Requests of `waiting` whose cost the index now holds up to their last step."""
    ready = [
        request_id
        for request_id in waiting
        if (cost := index.find(request_id, None)[1]) is not None
        and max(h["last_step_end_utc_ns"] or 0 for h in cost["hours"]) >= finish[request_id]
    ]
    waiting.difference_update(ready)
    return ready


def _replay_live(source: Path, data: Path, hours: float) -> tuple[list[float], float]:
    """Replay the span through the live path; each finished request's latency (s) and the
    cycles' CPU seconds."""
    finish = _finish_ns(source)
    replay = OutboxReplay(source, data, round(ROTATE_SECONDS * NS_PER_SECOND))
    pricer = LivePricer(data, load_pools(DataDir(data).own_pools_file))
    con = pricer.open_warehouse()
    index = RequestIndex(data, refresh_s=3600)
    start = hour_start_ns(DataDir(source).hours()[0])
    step_ns = round(DEFAULT_INTERVAL_S * NS_PER_SECOND)
    latencies: list[float] = []
    cpu = 0.0
    waiting = set(finish)
    try:
        for now_ns in range(start + step_ns, start + round(hours * HOUR_NS) + 4 * step_ns, step_ns):
            if not replay.deliver_until(now_ns):
                continue
            cpu_before, wall_before = time.process_time(), time.perf_counter()
            pricer.cycle(con)
            cpu += time.process_time() - cpu_before
            index.refresh()
            processing = time.perf_counter() - wall_before
            for request_id in _readable_now(index, finish, waiting):
                latencies.append((now_ns - finish[request_id]) / NS_PER_SECOND + processing)
    finally:
        con.close()
        index.close()
    return latencies, cpu


def _hourly(source: Path) -> tuple[pl.DataFrame, float]:
    """The hourly attribution of the span's steps: its usage per tenant, and its CPU seconds."""
    layout = DataDir(source)
    pool = load_pools(layout.own_pools_file).pool(POOL)
    before = time.process_time()
    log = read_segments(segment_files(layout.outbox))
    context = pl.concat(
        [read_gateway_file(p, key_salt()) for p in sorted(layout.gateway.glob("*"))]
    )
    frames = [pl.from_arrow(t) for t in (log.steps, log.slots, log.holders)]
    steps, slots, holders = (f for f in frames if isinstance(f, pl.DataFrame))
    lines = attribute_hour(
        layout.hours()[0],
        pool,
        steps,
        slots.drop("pool"),
        holders.drop("pool"),
        context,
        kernel_weights(pool),
    ).ledger.ledger_lines
    cpu = time.process_time() - before
    usage = (
        lines.filter(pl.col("line_kind").is_in(USAGE_KINDS))
        .group_by("tenant")
        .agg(pl.col("amount_nano").sum().alias("final_nano"))
    )
    return usage, cpu


def _largest_difference_pct(data: Path, final: pl.DataFrame) -> float:
    with finance.connect(data) as con:
        provisional = query_frame(
            con,
            "SELECT tenant, CAST(sum(amount_nano) AS BIGINT) AS provisional_nano "
            "FROM provisional_lines GROUP BY tenant",
        )
    both = final.join(provisional, on="tenant", how="full", coalesce=True).fill_null(0)
    difference = (both["final_nano"] - both["provisional_nano"]).abs() / both["final_nano"]
    return float(difference.max()) * 100  # type: ignore[arg-type]


def _serve(data: Path) -> tuple[subprocess.Popen[bytes], int]:
    """`stepledger serve` on a free loopback port, and the port once it answers."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from assets.cli import main; main()",
            "serve",
            "--data",
            str(data),
            "--port",
            str(port),
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return server, port
        except OSError:
            if server.poll() is not None:
                raise RuntimeError("stepledger serve exited before it listened") from None
            time.sleep(0.2)
    server.kill()
    raise RuntimeError("stepledger serve did not listen within 120 s")


def _api_p99_ms(data: Path, seconds: float) -> float:
    token = mint(DataDir(data).api_tokens, "bench", None)
    with finance.connect(data) as con:
        ids = [
            r[0]
            for r in con.execute(
                "SELECT request_id FROM provisional_cost_per_request LIMIT 500"
            ).fetchall()
        ]
    server, port = _serve(data)
    latencies: list[float] = []
    lock = threading.Lock()
    started = time.perf_counter() + 0.5
    period = API_CLIENTS / API_RATE

    def client(offset: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        mine = []
        for n in range(int(seconds * API_RATE / API_CLIENTS)):
            due = started + (n + offset / API_CLIENTS) * period
            time.sleep(max(0.0, due - time.perf_counter()))
            connection.request(
                "GET",
                f"/v1/requests/{ids[(n * API_CLIENTS + offset) % len(ids)]}/cost",
                headers={"Authorization": f"Bearer {token}"},
            )
            answer = connection.getresponse()
            answer.read()
            if answer.status != 200:
                raise RuntimeError(f"lookup answered {answer.status}")
            mine.append(time.perf_counter() - due)
        connection.close()
        with lock:
            latencies.extend(mine)

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(API_CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        server.terminate()
        server.wait(timeout=30)
    return float(np.percentile(latencies, 99)) * 1000


def figures(quick: bool) -> list[Figure]:
    hours = 0.05 if quick else 0.25
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        source = _simulated(hours)
        data = root / "live"
        latencies, live_cpu = _replay_live(source, data, hours)
        final, hourly_cpu = _hourly(source)
        difference = _largest_difference_pct(data, final)
        api_ms = _api_p99_ms(data, 5.0 if quick else 30.0)
    pool = load_pools().pool(POOL)
    gpu_hours = hours * pool.gpus_per_replica * len(pool.replicas)
    return [
        Figure(
            "live_cost_latency_p50_s",
            round(float(np.percentile(latencies, 50)), 2),
            "s",
            15.0,
            "max",
        ),
        Figure(
            "live_cost_latency_p95_s",
            round(float(np.percentile(latencies, 95)), 2),
            "s",
            60.0,
            "max",
        ),
        Figure("live_vs_final_usage_pct", round(difference, 4), "%", 0.5, "max"),
        Figure("api_p99_ms", round(api_ms, 2), "ms", 50.0, "max"),
        Figure("live_cpu_s_per_gpu_hour", round(live_cpu / gpu_hours, 1), "s", 60.0, "max"),
        Figure("hourly_cpu_s_per_gpu_hour", round(hourly_cpu / gpu_hours, 1), "s", 60.0, "max"),
    ]


if __name__ == "__main__":
    for figure in figures(quick=True):
        print(figure.line())
