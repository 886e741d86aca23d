"""Good data is billed, and what an outbox holds besides segments stops nothing: a simulated
fleet's segments damaged by the simulator's file fault knobs, then billed through the
pool-hour job. Each hour is either published with exactly the money of the undamaged fleet,
or held back with the finding that names the damage, until an intact copy arrives."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from pipeline.simulator.faults import damage_segments
from pipeline.storage.warehouse import STATE_FILE, connect
from schemas.config import PoolsFile
from tests.helpers.fleets import bill, costs, rerecord, simulate_small, small_pools

pytestmark = pytest.mark.timeout(600)

REPLICA = "chat-8b-r0"
# Bytes per segment when the fleet is recorded again: several segments per replica, so that
# damage in one has neighbours on both sides.
SEGMENT_BYTES = 2 << 20


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> tuple[PoolsFile, Path]:
    pools = small_pools()
    data = simulate_small(tmp_path_factory.mktemp("unbillable") / "fleet", pools)
    rerecord(data, rotate_bytes=SEGMENT_BYTES)
    assert len(list((data / "outbox" / REPLICA).glob("*.seg"))) >= 3
    return pools, data


def billed(data: Path, pools: PoolsFile) -> bool:
    with dg.DagsterInstance.ephemeral() as instance:
        (result,) = bill(data, pools, instance)
    return result.success


@pytest.fixture(scope="module")
def undamaged(fleet, tmp_path_factory) -> dict[str, Any]:
    pools, data = fleet
    copy = tmp_path_factory.mktemp("undamaged") / "fleet"
    shutil.copytree(data, copy)
    assert billed(copy, pools)
    money = costs(copy)
    assert money["published"]
    assert money["held_back"] == []
    return money


def damaged(fleet, tmp_path: Path, *faults: str) -> tuple[Path, list[Path], dict[str, str]]:
    """A copy of the fleet with `faults` applied to the replica's segments."""
    _, data = fleet
    copy = tmp_path / "fleet"
    shutil.copytree(data, copy, symlinks=True)
    segments = sorted((copy / "outbox" / REPLICA).glob("*.seg"))
    return copy, segments, damage_segments(copy, REPLICA, segments, dict.fromkeys(faults))


def sequence_detail(data: Path) -> str:
    with connect(data / STATE_FILE) as con:
        return "\n".join(
            row[0]
            for row in con.execute(
                "SELECT detail FROM reconciliation WHERE check_name = 'sequence' AND NOT passed"
            ).fetchall()
        )


def damage_rows(data: Path) -> list[tuple[Any, ...]]:
    with connect(data / STATE_FILE) as con:
        return con.execute("SELECT path, kind, detail FROM damage ORDER BY path").fetchall()


def middle(segments: list[Path]) -> Path:
    return segments[len(segments) // 2]


@pytest.mark.parametrize(
    ("fault", "found", "redelivered_as"),
    [("torn-segment", "torn_tail", None), ("bit-flip", "corrupt_frame", "again.seg")],
    ids=["torn-then-same-name", "bit-flipped-then-another-name"],
)
def test_a_damaged_segment_is_held_back_then_billed_exactly_once_its_intact_copy_arrives(
    fleet, undamaged, tmp_path: Path, fault: str, found: str, redelivered_as: str | None
) -> None:
    pools, _ = fleet
    data, segments, _ = damaged(fleet, tmp_path, fault, "intact-copy")
    victim = middle(segments)
    assert not billed(data, pools)
    ((pool, reason),) = costs(data)["held_back"]
    assert pool == "chat-8b"
    assert reason.startswith("failed blocking checks: sequence")
    assert f"{found} in {victim.relative_to(data)}" in sequence_detail(data)
    # The replica ships the segment again, under the same name or another.
    shutil.copyfile(
        data / "redelivery" / victim.relative_to(data),
        victim.with_name(redelivered_as or victim.name),
    )
    assert billed(data, pools)
    assert costs(data) == undamaged
    settled = [(k, d) for p, k, d in damage_rows(data) if p.endswith(victim.name)]
    assert [k for k, _ in settled] == ["recovered"]
    assert settled[0][1].startswith(f"{found} (")


@pytest.mark.parametrize(
    ("fault", "found"),
    [
        # Garbage after the last frame of a segment the next one follows without a gap.
        ("trailing-garbage", "corrupt_frame (bad frame marker, length or checksum)"),
        # A zero-byte file named like a delivery of a segment that is there intact.
        ("empty-segment", "torn_tail (empty file)"),
    ],
)
def test_damage_that_can_hide_no_step_holds_nothing_back(
    fleet, undamaged, tmp_path: Path, fault: str, found: str
) -> None:
    pools, _ = fleet
    data, _, notes = damaged(fleet, tmp_path, fault)
    assert billed(data, pools)
    assert costs(data) == undamaged
    ((path, kind, detail),) = damage_rows(data)
    assert notes[fault].startswith(f"{path}: ")
    assert kind == "recovered"
    assert detail.startswith(found)
    assert "it can hide no step" in detail


def test_a_moved_data_directory_bills_its_hours_again_unchanged(
    fleet, undamaged, tmp_path: Path
) -> None:
    pools, data = fleet
    before = tmp_path / "before"
    shutil.copytree(data, before)
    assert billed(before, pools)
    restored = tmp_path / "restored"
    shutil.move(before, restored)
    with connect(restored / STATE_FILE) as con:
        files = con.execute("SELECT count(*) FROM segment_files").fetchone()
    assert billed(restored, pools)
    assert costs(restored) == undamaged
    with connect(restored / STATE_FILE) as con:
        assert con.execute("SELECT count(*) FROM segment_files").fetchone() == files


def test_what_an_outbox_holds_besides_segments_is_reported_and_blocks_nothing(
    fleet, undamaged, tmp_path: Path
) -> None:
    pools, _ = fleet
    data, _, notes = damaged(fleet, tmp_path, "hostile-outbox")
    assert billed(data, pools)  # under the timeout: nothing blocked on the FIFO
    assert costs(data) == undamaged
    reported = {Path(path).name: (kind, detail) for path, kind, detail in damage_rows(data)}
    expected = {
        "a directory": "unreadable (a directory, not a segment file)",
        "a FIFO": "unreadable (a FIFO, not a segment file)",
        "a dangling symlink": "unreadable (cannot open: No such file or directory)",
        "a symlink to itself": "unreadable (cannot open: Too many levels of symbolic links)",
    }
    for entry in notes["hostile-outbox"].split("; "):
        path, what = entry.split(": ")
        name = Path(path).name
        if what == "a copy of mode 000" and os.geteuid() == 0:
            # Root reads it all the same: it is a duplicate delivery of the middle segment.
            assert name not in reported
            continue
        kind, detail = reported[name]
        assert kind == "recovered"
        assert detail.startswith(expected.get(what, "unreadable (cannot open: Permission denied)"))


def test_an_entry_whose_name_does_not_place_it_holds_the_hour_back_naming_it(
    fleet, tmp_path: Path
) -> None:
    pools, _ = fleet
    data, _, _ = damaged(fleet, tmp_path)
    stray = data / "outbox" / REPLICA / "stray.seg"
    os.mkfifo(stray)
    assert not billed(data, pools)
    assert (
        "unreadable in outbox/chat-8b-r0/stray.seg at byte 0: a FIFO, not a segment file"
        in sequence_detail(data)
    )


def test_a_fleet_simulated_with_the_file_knobs_bills_exactly(fleet, undamaged, tmp_path: Path):
    """The same knobs through `simulate`: the fleet as delivered, one segment per replica."""
    pools, _ = fleet
    knobs = ("trailing-garbage", "empty-segment", "hostile-outbox")
    data = simulate_small(tmp_path / "fleet", pools, faults=dict.fromkeys(knobs))
    assert billed(data, pools)
    assert costs(data) == undamaged
    kinds = {kind for _, kind, _ in damage_rows(data)}
    assert kinds == {"recovered", "corrupt_frame"}  # the garbage ends the replica's last segment
