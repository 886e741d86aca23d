"""A simulated run directory holds what production delivers, and each fault leaves its artefact."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import yaml
from click.testing import CliRunner, Result

from pipeline.cli import main
from pipeline.ingestion.dcgm import parse_dcgm
from pipeline.ingestion.decoder import read_segments
from pipeline.simulator import SimulationSummary, simulate
from pipeline.simulator.faults import UNCALIBRATED_ENGINE_VERSION, FaultError, parse_fault
from pipeline.simulator.telemetry import busy_between
from pricing import Kernel, Slots
from schemas.config import PoolsFile, load_pools
from tests.helpers.children import STOP_GRACE_SECONDS, child

START = datetime(2026, 11, 30, 5, tzinfo=UTC)
START_NS = int(START.timestamp()) * 1_000_000_000


def small_two_pool_fleet() -> PoolsFile:
    """The default pools with two 8B replicas (one host) and the TP8 replica at a third of its traffic."""
    pools = load_pools()
    chat, reason = pools.pools
    workload = reason.workload
    assert workload is not None
    quieter = workload.model_copy(
        update={
            "tenants": [
                tenant.model_copy(
                    update={
                        "features": [
                            f.model_copy(update={"requests_per_s": f.requests_per_s / 3})
                            for f in tenant.features
                        ]
                    }
                )
                for tenant in workload.tenants
            ]
        }
    )
    return PoolsFile.model_validate(
        {
            "settings": pools.settings.model_dump(),
            "pools": [
                chat.model_copy(update={"replicas": chat.replicas[:2]}).model_dump(),
                reason.model_copy(update={"workload": quieter}).model_dump(),
            ],
        }
    )


def decode(out_dir: Path):
    return read_segments(sorted((out_dir / "outbox").rglob("*.seg")))


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> tuple[Path, SimulationSummary]:
    out = tmp_path_factory.mktemp("clean") / "run"
    return out, simulate(out, small_two_pool_fleet(), hours=0.05, seed=11, start=START)


ALL_FAULTS = {
    "drop-records": 0.1,
    "torn-segment": None,
    "duplicate-segment": None,
    "clock-skew": 360.0,
    "missing-context": 0.2,
    "idle-replica": None,
    "host-stall": 0.5,
    "new-engine-version": None,
    "sink-down": 2.0,
}


@pytest.fixture(scope="module")
def faulty(tmp_path_factory) -> tuple[Path, SimulationSummary]:
    # Over 5 minutes, so the damaged replica ships several segments.
    out = tmp_path_factory.mktemp("faulty") / "run"
    return out, simulate(
        out, small_two_pool_fleet(), hours=0.1, seed=11, start=START, faults=ALL_FAULTS
    )


def test_run_directory_layout(clean):
    out, summary = clean
    assert (
        PoolsFile.model_validate(yaml.safe_load((out / "pools.yaml").read_text()))
        == small_two_pool_fleet()
    )
    assert sorted(p.name for p in (out / "outbox").iterdir()) == [
        "chat-8b-r0",
        "chat-8b-r1",
        "reason-dsv3-r0",
    ]
    assert [p.name for p in (out / "gateway").iterdir()] == ["2026-11-30T05.jsonl"]
    assert sorted(str(p.relative_to(out)) for p in (out / "dcgm").rglob("*.prom")) == [
        "dcgm/gpu-node-01/2026-11-30T05.prom",
        "dcgm/gpu-node-10/2026-11-30T05.prom",
    ]
    assert summary.requests > 300
    assert summary.steps > 20_000
    assert {r.replica: r.busy_fraction > 0.5 for r in summary.replicas} == {
        "chat-8b-r0": True,
        "chat-8b-r1": True,
        "reason-dsv3-r0": True,
    }


def test_sequence_numbers_rise_by_one_and_steps_do_not_overlap(clean):
    out, summary = clean
    log = decode(out)
    assert log.damage.num_rows == 0
    assert log.drops.num_rows == 0
    steps = pl.DataFrame(log.steps).sort("replica", "seq")
    for _replica, part in steps.group_by("replica"):
        seq = part["seq"].to_numpy()
        np.testing.assert_array_equal(seq, np.arange(seq.shape[0]))
        start, end = part["start_utc_ns"].to_numpy(), part["end_utc_ns"].to_numpy()
        assert (end > start).all()
        assert (start[1:] > end[:-1]).all()
        assert start[0] >= START_NS
        assert start[-1] < START_NS + 180 * 10**9
    assert {r.replica: r.recorded_steps for r in summary.replicas} == dict(
        steps.group_by("replica").len().iter_rows()
    )


def test_every_request_computes_its_prompt_once_then_decodes(clean):
    out, _ = clean
    slots = pl.DataFrame(decode(out).slots)
    computed = pl.col("new_tokens") - pl.col("spec_drafted") + pl.col("spec_accepted")
    per_request = (
        slots.sort("replica", "seq")
        .group_by("request_id", maintain_order=True)
        .agg(
            pl.col("prompt_tokens").first(),
            pl.col("prefix_hit_tokens").sum(),
            computed.sum().alias("computed"),
            (pl.col("context_tokens") + computed).last().alias("cached_after"),
            pl.col("context_tokens").first().alias("first_context"),
            (pl.col("context_tokens") >= pl.col("prompt_tokens")).sum().alias("decode_steps"),
        )
    )
    # No preemption in this run: each request's first step starts at its prefix hit, and the
    # tokens it computes are exactly what is cached at the end.
    assert (per_request["first_context"] == per_request["prefix_hit_tokens"]).all()
    assert (
        per_request["computed"] + per_request["prefix_hit_tokens"] == per_request["cached_after"]
    ).all()
    decoding = per_request.filter(pl.col("decode_steps") > 0)
    assert decoding.height > 0.9 * per_request.height
    # A decoding request's cache holds its prompt plus one token per decode step except the last sampled.
    assert (decoding["cached_after"] >= decoding["prompt_tokens"] + decoding["decode_steps"]).all()
    assert per_request["prefix_hit_tokens"].sum() > 0


def test_gateway_context_covers_every_request(clean):
    out, summary = clean
    lines = [
        json.loads(line)
        for line in (out / "gateway" / "2026-11-30T05.jsonl").read_text().splitlines()
    ]
    assert len(lines) == summary.requests == summary.gateway_lines
    assert set(lines[0]) == {
        "request_id",
        "tenant",
        "feature",
        "api_key",
        "retry_of",
        "retry_cause",
        "received_at",
    }
    by_id = {line["request_id"]: line for line in lines}
    slots_ids = set(pl.DataFrame(decode(out).slots)["request_id"].unique().to_list())
    assert slots_ids <= set(by_id)
    retries = [line for line in lines if line["retry_of"] is not None]
    assert retries
    assert all(line["retry_cause"] in ("client_timeout", "platform_timeout") for line in retries)
    for retry in retries:
        original = by_id[retry["retry_of"]]
        assert (original["tenant"], original["feature"], original["api_key"]) == (
            retry["tenant"],
            retry["feature"],
            retry["api_key"],
        )
    received = [line["received_at"] for line in lines]
    assert received == sorted(received)
    assert received[0].startswith("2026-11-30T05:00:")


def engine_busy_by_scrape(out: Path, replica: str, samples: pl.DataFrame) -> np.ndarray:
    steps = pl.DataFrame(decode(out).steps).filter(pl.col("replica") == replica).sort("seq")
    scrape = np.unique(samples["timestamp_ns"].to_numpy())
    window_start = np.maximum(scrape - 15 * 10**9, START_NS)
    busy = busy_between(
        steps["start_utc_ns"].to_numpy(), steps["end_utc_ns"].to_numpy(), window_start, scrape
    )
    fraction: np.ndarray = busy / (scrape - window_start)
    return fraction


def test_dcgm_tracks_engine_busy_time_on_every_gpu(clean):
    out, _summary = clean
    node10 = parse_dcgm(out / "dcgm" / "gpu-node-10" / "2026-11-30T05.prom")
    pools = small_two_pool_fleet()
    assert sorted(node10["uuid"].unique().to_list()) == sorted(pools.pools[1].replicas[0].gpu_uuids)
    assert (
        node10.group_by("uuid").len()["len"].to_list() == [12] * 8
    )  # 180 s at one scrape per 15 s
    expected = engine_busy_by_scrape(out, "reason-dsv3-r0", node10)
    for _, gpu in node10.group_by("uuid"):
        assert np.abs(gpu.sort("timestamp_ns")["value"].to_numpy() - expected).max() < 0.1
    node01 = parse_dcgm(out / "dcgm" / "gpu-node-01" / "2026-11-30T05.prom")
    assert sorted(node01["gpu"].unique().to_list()) == [0, 1]
    for replica in pools.pools[0].replicas:
        gpu = node01.filter(pl.col("uuid") == replica.gpu_uuids[0]).sort("timestamp_ns")
        expected = engine_busy_by_scrape(out, replica.id, gpu)
        assert np.abs(gpu["value"].to_numpy() - expected).max() < 0.1


def test_the_same_seed_gives_the_same_run_in_worker_processes_too(clean, tmp_path):
    out, summary = clean
    again = simulate(
        tmp_path / "again", small_two_pool_fleet(), hours=0.05, seed=11, start=START, workers=2
    )
    assert again.replicas == summary.replicas
    for relative in ("gateway/2026-11-30T05.jsonl", "dcgm/gpu-node-01/2026-11-30T05.prom"):
        assert (tmp_path / "again" / relative).read_bytes() == (out / relative).read_bytes()
    first, second = decode(out), decode(tmp_path / "again")
    assert first.slots.equals(second.slots)
    assert first.holders.equals(second.holders)
    assert first.steps.drop_columns(["segment_id"]).equals(
        second.steps.drop_columns(["segment_id"])
    )


def test_a_run_directory_is_never_overwritten(clean):
    out, _ = clean
    with pytest.raises(FileExistsError, match="pools.yaml exists"):
        simulate(out, small_two_pool_fleet(), hours=0.01, seed=1, start=START)


def test_drop_records_leaves_counted_drops_and_a_time_shortfall(faulty):
    out, summary = faulty
    log = decode(out)
    drops = pl.DataFrame(log.drops)
    target = next(r for r in summary.replicas if r.replica == "chat-8b-r0")
    assert drops["replica"].unique().to_list() == ["chat-8b-r0"]
    assert drops["steps"].sum() == target.dropped_steps > 100
    steps = pl.DataFrame(log.steps).filter(pl.col("replica") == "chat-8b-r0").sort("seq")
    gaps = steps["start_utc_ns"].to_numpy()[1:] - steps["end_utc_ns"].to_numpy()[:-1]
    assert gaps.max() > 0.9 * 0.1 * 360 * 10**9 * (
        1 - 360 / 3600
    )  # the 36 s burst is one long hole


def test_torn_and_duplicated_segments_are_reported_by_the_decoder(faulty):
    out, summary = faulty
    damage = pl.DataFrame(decode(out).damage)
    assert sorted(damage["kind"].to_list()) == ["duplicate_segment", "torn_tail"]
    assert "truncated" in summary.faults["torn-segment"]
    assert "redelivered" in summary.faults["duplicate-segment"]
    assert len(list((out / "outbox" / "chat-8b-r0").glob("*-redelivered.seg"))) == 1


def test_clock_skew_makes_consecutive_segments_overlap(faulty):
    out, _ = faulty
    log = decode(out)
    steps = pl.DataFrame(log.steps).filter(pl.col("replica") == "chat-8b-r0")
    by_segment = (
        steps.group_by("segment_id")
        .agg(pl.col("seq").min(), pl.col("start_utc_ns").min(), pl.col("end_utc_ns").max())
        .sort("seq")
    )
    assert by_segment.height >= 2
    starts, ends = by_segment["start_utc_ns"].to_numpy(), by_segment["end_utc_ns"].to_numpy()
    # 360 s per hour slow: each 300 s segment re-anchors 30 s behind where the previous one ended.
    overlap = ends[:-1] - starts[1:]
    assert (overlap > 29 * 10**9).all()
    assert (overlap < 31 * 10**9).all()


def test_missing_context_leaves_requests_without_a_gateway_line(faulty):
    out, summary = faulty
    missing = 1 - summary.gateway_lines / summary.requests
    assert 0.15 < missing < 0.25
    ids = {
        json.loads(line)["request_id"]
        for line in (out / "gateway" / "2026-11-30T05.jsonl").read_text().splitlines()
    }
    logged = set(pl.DataFrame(decode(out).slots)["request_id"].unique().to_list())
    assert logged - ids
    assert logged & ids


def test_idle_replica_has_no_steps_and_an_idle_gpu(faulty):
    out, summary = faulty
    idle = next(r for r in summary.replicas if r.replica == "chat-8b-r1")
    assert (idle.requests, idle.steps, idle.segments) == (0, 0, 0)
    samples = parse_dcgm(out / "dcgm" / "gpu-node-01" / "2026-11-30T05.prom")
    idle_gpu = samples.filter(
        pl.col("uuid") == small_two_pool_fleet().pools[0].replicas[1].gpu_uuids[0]
    )
    assert idle_gpu.height == 24
    busiest = idle_gpu["value"].max()
    assert isinstance(busiest, float)
    assert busiest < 0.1


def test_host_stall_shows_busy_engine_and_idle_gpu(faulty):
    out, summary = faulty
    target = next(r for r in summary.replicas if r.replica == "chat-8b-r0")
    assert target.busy_fraction == pytest.approx(1.5 * target.gpu_busy_fraction, rel=1e-3)
    samples = parse_dcgm(out / "dcgm" / "gpu-node-01" / "2026-11-30T05.prom")
    gpu = samples.filter(pl.col("uuid") == small_two_pool_fleet().pools[0].replicas[0].gpu_uuids[0])
    assert gpu["value"].mean() < target.busy_fraction - 0.2


def test_new_engine_version_is_in_the_segment_headers(faulty):
    out, _ = faulty
    versions = dict(
        pl.DataFrame(decode(out).segments).select("replica", "engine_version").unique().iter_rows()
    )
    assert versions == {"chat-8b-r0": UNCALIBRATED_ENGINE_VERSION, "reason-dsv3-r0": "0.11.0"}


def sink_command(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "pipeline.simulator.sink", str(run_dir)]


def test_sink_down_serves_a_webhook_that_refuses_then_accepts(faulty):
    out, summary = faulty
    assert summary.faults["sink-down"] == (
        "the alert webhook (alert-sink.json) answers its first 2 deliveries with HTTP 500, "
        "then accepts"
    )
    with child(sink_command(out), stdout=subprocess.PIPE, text=True) as sink:
        assert sink.stdout is not None
        url = sink.stdout.readline().strip()
        statuses = []
        for attempt in range(3):
            request = urllib.request.Request(
                url, data=json.dumps({"text": f"page {attempt}"}).encode(), method="POST"
            )
            try:
                # A bound for a sink that hangs, not a wait a slow machine could outlast.
                with urllib.request.urlopen(request, timeout=STOP_GRACE_SECONDS) as response:
                    statuses.append(response.status)
            except urllib.error.HTTPError as err:
                statuses.append(err.code)
        assert statuses == [500, 500, 200]


def ignore_stop_signals() -> None:
    """As a shell's background job starts, and more: SIGINT and SIGTERM ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_the_sink_stops_at_once_on_sigterm_or_sigint_even_if_started_ignoring_them(
    tmp_path: Path, stop_signal: signal.Signals
) -> None:
    command = sink_command(tmp_path)
    with child(command, stdout=subprocess.PIPE, text=True, preexec_fn=ignore_stop_signals) as sink:
        assert sink.stdout is not None
        assert sink.stdout.readline().startswith("http://127.0.0.1:")
        sink.send_signal(stop_signal)
        assert sink.wait(timeout=STOP_GRACE_SECONDS) == 0


def test_fault_values_are_checked():
    assert parse_fault("host-stall=0.25") == ("host-stall", 0.25)
    assert parse_fault("drop-records") == ("drop-records", 0.02)
    with pytest.raises(FaultError, match="unknown fault 'stall'"):
        parse_fault("stall")
    with pytest.raises(FaultError, match="'torn-segment' takes no value"):
        parse_fault("torn-segment=2")
    with pytest.raises(FaultError, match=r"fraction 1.5 must be in \(0, 1\]"):
        parse_fault("missing-context=1.5")
    with pytest.raises(FaultError, match="'clock-skew': value 'fast' is not a number"):
        parse_fault("clock-skew=fast")
    assert parse_fault("sink-down") == ("sink-down", 1.0)
    with pytest.raises(FaultError, match="'sink-down': 1.5 deliveries must be a whole number"):
        parse_fault("sink-down=1.5")


def test_busy_between_counts_partial_intervals():
    starts, ends = np.array([0, 10, 30]), np.array([5, 20, 40])
    windows = (np.array([0, 3, 12, 20, 35, 0]), np.array([5, 12, 25, 30, 50, 100]))
    assert busy_between(starts, ends, *windows).tolist() == [5, 4, 8, 0, 5, 25]


def test_cli_simulates_and_reports(tmp_path):
    pools_path = tmp_path / "pools.yaml"
    pools_path.write_text(yaml.safe_dump(small_two_pool_fleet().model_dump(mode="json")))

    def simulate(out: str, *options: str) -> Result:
        return CliRunner().invoke(main, ["simulate", "--out", str(tmp_path / out), *options])

    # A few seconds of the small fleet from 03:00.
    pools = str(pools_path)
    small = ["--hours", "0.005", "--seed", "2", "--pools", pools, "--start", "2026-12-01T03:00Z"]
    result = simulate("run", *small, "--fault", "new-engine-version")
    assert result.exit_code == 0, result.output
    assert "chat-8b-r0" in result.output
    assert "reason-dsv3-r0" in result.output
    assert "fault new-engine-version: chat-8b-r0: reports engine version 0.12.0rc2" in result.output
    assert (tmp_path / "run" / "gateway" / "2026-12-01T03.jsonl").exists()
    as_json = simulate("run2", *small, "--json")
    assert as_json.exit_code == 0, as_json.output
    summary = json.loads(as_json.stdout)
    assert (summary["seed"], summary["start"]) == (2, "2026-12-01 03:00:00+00:00")
    assert [r["replica"] for r in summary["replicas"]] == [
        r.id for p in small_two_pool_fleet().pools for r in p.replicas
    ]
    assert summary["steps"] == sum(r["steps"] for r in summary["replicas"])
    bad = simulate("x", "--hours", "1", "--seed", "1", "--fault", "host-stall=-1")
    assert bad.exit_code != 0
    assert "fault 'host-stall': fraction -1.0 must be positive" in bad.output
    late = simulate("y", "--hours", "1", "--seed", "1", "--start", "2026-12-01T03:30Z")
    assert late.exit_code != 0
    assert "is not on the hour" in late.output


def test_a_hybrid_models_pool_is_served_and_each_step_lasts_its_kernel_price(tmp_path):
    """A pool of Qwen3-Next (gated delta-net and attention layers) is simulated like any other:
    with no step noise each recorded step lasts exactly the kernel's NoOverlap for its slots."""
    pools = load_pools()
    chat = pools.pools[0]
    assert chat.workload is not None
    hybrid = chat.model_copy(
        update={
            "name": "hybrid-next",
            "model": "qwen3-next-80b-a3b",
            "gpu_type": "h200",
            "gpus_per_replica": 2,
            "replicas": [
                chat.replicas[0].model_copy(
                    update={"id": "hybrid-next-r0", "gpu_uuids": chat.replicas[0].gpu_uuids * 2}
                )
            ],
            "workload": chat.workload.model_copy(update={"step_noise": 0.0}),
        }
    )
    fleet = PoolsFile.model_validate(
        {"settings": pools.settings.model_dump(), "pools": [hybrid.model_dump()]}
    )
    summary = simulate(tmp_path / "run", fleet, hours=0.005, seed=3, start=START)
    assert summary.steps > 100
    log = decode(tmp_path / "run")
    steps = pl.DataFrame(log.steps).sort("seq")
    slots = pl.DataFrame(log.slots).join(
        steps.select("seq", pl.int_range(pl.len()).alias("i")), on="seq"
    )
    prices = Kernel.build(hybrid.deployment()).price_many(
        Slots(
            *(slots[c].to_numpy() for c in ("i", "new_tokens", "context_tokens", "prompt_tokens"))
        ),
        steps.height,
    )
    np.testing.assert_array_equal(
        (steps["end_utc_ns"] - steps["start_utc_ns"]).to_numpy(),
        np.rint(prices.nooverlap_us * 1000.0).astype(np.int64),
    )
    assert (slots["new_tokens"] > 1).any()
    assert (slots["new_tokens"] == 1).any()
