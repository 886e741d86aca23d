"""A replica's log is complete head to tail, or its hour is held back and paged: each way a
log can come up short, simulated on a small fleet and billed through the pool-hour job,
against the same fleet without the fault. Damage that hides no sequence number is reported
and holds nothing: the money is the clean fleet's to the nano-dollar."""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any, TypedDict

import dagster as dg
import polars as pl
import pytest

from pipeline.ingestion.decoder import read_segments
from tests.hardening.test_every_step_billed import failed_findings
from tests.helpers.fleets import bill, costs, simulate_small, small_pools
from tests.helpers.hours import SIMULATED_HOUR
from tests.helpers.reconcile_builders import S

pytestmark = pytest.mark.timeout(600)

REPLICA = "chat-8b-r0"
HOUR_START_NS = int(SIMULATED_HOUR.timestamp()) * S
SPAN_S = 180  # the small fleet's three simulated minutes


class Clean(TypedDict):
    """The fleet without a fault: its data, what it bills and finds, and REPLICA's steps."""

    data: Path
    money: dict[str, list[tuple[Any, ...]]]
    findings: list[tuple[Any, ...]]
    steps: pl.DataFrame


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Clean:
    data = simulate_small(tmp_path_factory.mktemp("clean") / "fleet", small_pools())
    assert billed(data)
    money = costs(data)
    assert money["published"]
    assert money["held_back"] == []
    steps = pl.DataFrame(read_segments(sorted((data / "outbox" / REPLICA).glob("*.seg"))).steps)
    return {"data": data, "money": money, "findings": failed_findings(data), "steps": steps}


def billed(data: Path, hour=SIMULATED_HOUR) -> bool:
    with dg.DagsterInstance.ephemeral() as instance:
        (result,) = bill(data, small_pools(), instance, hour)
    return result.success


def new_findings(data: Path, clean: Clean) -> list[tuple[Any, ...]]:
    """(check, replica, severity, blocking, finding, detail) the fault added."""
    return [f for f in failed_findings(data) if f not in clean["findings"]]


def held(tmp_path: Path, faults: dict[str, float | None], reason: str) -> list[tuple[Any, ...]]:
    """Simulate with `faults`, bill: nothing is published, the hour is held for `reason`;
    the fault's new findings."""
    data = simulate_small(tmp_path / "fleet", small_pools(), faults=faults)
    assert not billed(data)
    assert costs(data) == {"published": [], "held_back": [("chat-8b", reason)]}
    return [f for f in failed_findings(data) if f[3]]


def max_of(frame: pl.DataFrame, column: str) -> int:
    return int(frame[column].to_numpy().max())


def min_of(frame: pl.DataFrame, column: str) -> int:
    return int(frame[column].to_numpy().min())


def clock_at(utc_ns: int) -> str:
    """The UTC time of day of an instant in the simulated hour, as the findings print it."""
    moment = SIMULATED_HOUR + timedelta(microseconds=(utc_ns - HOUR_START_NS) // 1000)
    return moment.strftime("%H:%M:%S.%f")[:-3]


def steps_starting(clean: Clean, first_s: float, last_s: float) -> pl.DataFrame:
    """The clean replica's steps starting in [first_s, last_s) seconds into the hour."""
    start = pl.col("start_utc_ns") - HOUR_START_NS
    return clean["steps"].filter(start.is_between(int(first_s * S), int(last_s * S), closed="left"))


def test_the_first_segments_of_a_replicas_hour_never_arriving_hold_it(clean, tmp_path) -> None:
    lost = steps_starting(clean, 0, SPAN_S / 4)
    ((check, replica, severity, _, finding, detail),) = held(
        tmp_path, {"missing-head": 0.25}, "failed blocking checks: sequence"
    )
    assert (check, replica, severity, finding) == ("sequence", REPLICA, "ERROR", "missing_head")
    first_kept = min_of(steps_starting(clean, SPAN_S / 4, SPAN_S), "start_utc_ns")
    assert detail == (
        f"missing seq 0-{max_of(lost, 'seq')} ({lost.height} steps) before the hour's first logged "
        f"step, UTC 00:00:00.000-{clock_at(first_kept)}: no segment "
        "holds them (the log continues seq -1)"
    )


def test_segments_missing_in_the_middle_hold_the_hour_naming_steps_and_time(
    clean, tmp_path
) -> None:
    # A fifth of the three minutes, 36 s, is twice the time check's tolerance (0.5 % of the
    # hour, 18 s), so the time check fails too; a tenth would lose the tolerance's own 18 s,
    # and whether the time check failed would hang on how long the steps at its edges ran.
    lost = steps_starting(clean, 0.4 * SPAN_S, 0.6 * SPAN_S)
    findings = held(tmp_path, {"missing-middle": 0.2}, "failed blocking checks: sequence, time")
    (gap,) = [f for f in findings if f[0] == "sequence"]
    before = max_of(clean["steps"].filter(pl.col("seq") == min_of(lost, "seq") - 1), "end_utc_ns")
    after = min_of(clean["steps"].filter(pl.col("seq") == max_of(lost, "seq") + 1), "start_utc_ns")
    assert gap[1:5] == (REPLICA, "ERROR", True, "gap")
    assert gap[5] == (
        f"missing seq {min_of(lost, 'seq')}-{max_of(lost, 'seq')} ({lost.height} steps) with no "
        "counted drop or damage to explain them, UTC "
        f"{clock_at(before)}-{clock_at(after)}"
    )


def test_the_last_segments_never_arriving_while_dcgm_shows_work_hold_the_hour(
    clean, tmp_path
) -> None:
    kept = steps_starting(clean, 0, SPAN_S / 2)
    ((check, replica, severity, _, finding, detail),) = held(
        tmp_path, {"missing-tail": 0.5}, "failed blocking checks: silence"
    )
    assert (check, replica, severity, finding) == ("silence", REPLICA, "ERROR", "silent_tail")
    assert detail.startswith(
        f"replica {REPLICA} (host gpu-node-01) in hour 2026-11-30T00: its last logged step ends "
        f"at {clock_at(max_of(kept, 'end_utc_ns'))} UTC, and DCGM shows its GPUs "
    )
    assert "the log's last segments are missing" in detail


def test_a_torn_last_segment_holds_the_hour(clean, tmp_path) -> None:
    findings = held(
        tmp_path, {"torn-last-segment": None}, "failed blocking checks: sequence, silence"
    )
    assert [f[:5] for f in findings] == [
        ("sequence", REPLICA, "ERROR", True, "lost_tail"),
        ("silence", REPLICA, "ERROR", True, "silent_tail"),
    ]
    assert "file ends inside a frame; no later segment: the steps from seq " in findings[0][5]


def test_a_second_segment_with_the_same_id_and_other_steps_holds_the_hour(clean, tmp_path) -> None:
    """The last segment split in two files under its one id: both halves' steps are decoded
    (the log has no hole), and the hour is held until an operator says which file is the log."""
    ((*where, finding, detail),) = held(
        tmp_path, {"divergent-copy": None}, "failed blocking checks: sequence"
    )
    assert (*where, finding) == ("sequence", REPLICA, "ERROR", True, "divergent_copy")
    halves = sorted((tmp_path / "fleet" / "outbox" / REPLICA).glob("*.seg"))
    smaller = min(read_segments([half]).steps.num_rows for half in halves)
    assert (
        f"; {smaller} of this copy's frames are not in the kept copy (its steps among them "
        "decoded too), 0 of its steps differ from the kept copy's"
    ) in detail


def test_a_silent_replica_without_dcgm_holds_the_hour(clean, tmp_path) -> None:
    ((*where, finding, detail),) = held(
        tmp_path, {"silent-replica": None, "no-dcgm": None}, "failed blocking checks: silence"
    )
    assert (*where, finding) == ("silence", REPLICA, "ERROR", True, "silent_unverified")
    assert detail == (
        f"no step log and no DCGM sample from replica {REPLICA} (host gpu-node-01) in hour "
        "2026-11-30T00: nothing shows it sat idle, so the hour is not billed as idle"
    )


def test_an_hour_with_no_data_at_all_is_held_not_billed_as_idle(clean, tmp_path) -> None:
    data = tmp_path / "fleet"
    shutil.copytree(clean["data"], data)
    assert not billed(data, SIMULATED_HOUR + timedelta(hours=1))
    assert costs(data) == {
        "published": clean["money"]["published"],
        "held_back": [("chat-8b", "failed blocking checks: silence")],
    }
    next_hour = [f for f in failed_findings(data) if f[3]]
    assert [f[:5] for f in next_hour] == [
        ("silence", replica, "ERROR", True, "silent_unverified")
        for replica in ("chat-8b-r0", "chat-8b-r1")
    ]


@pytest.mark.parametrize(
    ("damage", "shown"),
    [
        ("empty file", "torn_tail in outbox/chat-8b-r0/zero.seg at byte 0: empty file"),
        ("trailing garbage", "corrupt_frame in outbox/chat-8b-r0/"),
    ],
)
def test_damage_that_hides_no_sequence_number_is_reported_and_bills_the_clean_money(
    clean, tmp_path, damage, shown
) -> None:
    """A zero-byte file no writer finished (its name no segment's), or bytes that are no frame
    after the last intact one: every step is in the log, so the hour is billed as without it."""
    faults: dict[str, float | None] = {"trailing-garbage": None} if damage != "empty file" else {}
    data = simulate_small(tmp_path / "fleet", small_pools(), faults=faults)
    if damage == "empty file":
        (data / "outbox" / REPLICA / "zero.seg").touch()
    assert billed(data)
    assert costs(data) == clean["money"]
    ((*where, finding, detail),) = new_findings(data, clean)
    assert (*where, finding) == ("sequence", REPLICA, "WARN", False, "harmless_damage")
    assert detail.startswith(f"hides no missing sequence number: 1 damaged frames: {shown}")


def test_steps_holding_more_kv_blocks_than_the_engine_has_are_flagged(clean, tmp_path) -> None:
    """Impossible KV moves money between a step's requests, never out of the hour: the hour is
    published, to the clean fleet's total, and the run fails so that on-call is paged."""
    data = simulate_small(tmp_path / "fleet", small_pools(), faults={"impossible-kv": 100.0})
    assert not billed(data)
    money = costs(data)
    assert money["held_back"] == []
    assert sum(row[-1] for row in money["published"]) == sum(
        row[-1] for row in clean["money"]["published"]
    )
    ((*where, finding, detail),) = new_findings(data, clean)
    # The clean fleet's three minutes in an hour already find the GPUs busier than the log.
    assert (*where, finding) == (
        "plausibility",
        REPLICA,
        "ERROR",
        False,
        "impossible_kv+gpu_busier",
    )
    assert "hold more KV blocks than the engine has; the most, step " in detail
