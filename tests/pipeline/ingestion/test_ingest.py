from __future__ import annotations

import fcntl
import logging
import shutil
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import polars as pl
import pyarrow as pa
import pytest
from hypothesis import given, settings

from pipeline.ingestion import ingest
from pipeline.ingestion.ingest import (
    INTENTS_DIR,
    batch_of,
    committed_batches,
    ingest_outbox,
    partition_dir,
    segment_files,
)
from pipeline.reconcile import check_sequence
from pipeline.storage.lake import last_seq_before, load_hour
from pipeline.storage.warehouse import connect, query_frame
from schemas.config import load_pools
from tests.helpers.hours import HOUR
from tests.helpers.warehouse_fleet import NS, write_replica_log

POOL = load_pools().pool("chat-8b")


def write_r0_parts(outbox: Path, parts: int, *, gap_ns: int, requests: list[str]) -> None:
    """`parts` logs of r0 from 05:00, ten minutes apart, each of 20 one-second steps numbered on
    from the previous log's."""
    for part in range(parts):
        write_replica_log(
            outbox,
            POOL,
            "chat-8b-r0",
            start=HOUR + timedelta(minutes=10 * part),
            steps=20,
            step_ns=NS,
            gap_ns=gap_ns,
            requests=requests,
            first_seq=20 * part,
        )


@pytest.fixture
def outbox(tmp_path: Path) -> Path:
    root = tmp_path / "outbox"
    # r0: 120 steps of 1 s every 30 s from 04:30 -> 60 in hour 04, 60 in hour 05.
    write_replica_log(
        root,
        POOL,
        "chat-8b-r0",
        start=HOUR - timedelta(minutes=30),
        steps=120,
        step_ns=NS,
        gap_ns=29 * NS,
        requests=["a", "b"],
    )
    # r1: 10 steps of 2 s every 10 s in hour 05.
    write_replica_log(
        root,
        POOL,
        "chat-8b-r1",
        start=HOUR + timedelta(minutes=1),
        steps=10,
        step_ns=2 * NS,
        gap_ns=8 * NS,
        requests=["c"],
    )
    return root


class Killed(Exception):
    """Stands in for the process dying as the warehouse is about to record a batch."""


def die_before_commit(con):
    raise Killed


def lake_rows(lake: Path, table: str) -> int:
    files = list((lake / table).rglob("*.parquet"))
    return pl.read_parquet(files).height if files else 0


def test_ingest_partitions_by_pool_and_hour(tmp_path: Path, outbox: Path) -> None:
    lake = tmp_path / "lake"
    with connect(tmp_path / "w.duckdb") as con:
        report = ingest_outbox(con, outbox, lake)
        assert report.steps == 130
        assert report.damage == 0
        assert report.partitions == {("chat-8b", "2026-11-30T04"), ("chat-8b", "2026-11-30T05")}
        assert con.execute("SELECT count(*), sum(steps) FROM segments").fetchone() == (2, 130)
        assert con.execute("SELECT count(*) FROM sequence_gaps").fetchone() == (0,)
    early = pl.read_parquet(
        list(partition_dir(lake, "steps", "chat-8b", "2026-11-30T04").glob("*.parquet"))
    )
    assert early.height == 60
    assert early["replica"].unique().to_list() == ["chat-8b-r0"]
    assert lake_rows(lake, "slots") == 120 * 2 + 10


def test_a_full_outbox_is_ingested_in_batches_of_bounded_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outbox = tmp_path / "outbox"
    # Six segments of 20 steps each (one every 30 s), and a replica of one segment.
    write_r0_parts(outbox, 6, gap_ns=29 * NS, requests=["a", "b"])
    write_replica_log(
        outbox, POOL, "chat-8b-r1", start=HOUR, steps=10, step_ns=NS, gap_ns=NS, requests=["c"]
    )

    def lake_content(lake: Path) -> dict[str, list[tuple[Any, ...]]]:
        return {
            table: sorted(
                row for f in (lake / table).rglob("*.parquet") for row in pl.read_parquet(f).rows()
            )
            for table in ("steps", "slots")
        }

    with connect(tmp_path / "whole.duckdb") as con:
        ingest_outbox(con, outbox, tmp_path / "whole")
    segments = segment_files(outbox, ["chat-8b-r0"])
    sizes = [p.stat().st_size for p in segments]
    assert len(segments) >= 5
    # Room for two segments of r0 per batch, never three.
    monkeypatch.setattr(ingest, "BATCH_BYTES", 2 * max(sizes))
    assert sum(sorted(sizes)[:3]) > ingest.BATCH_BYTES
    with connect(tmp_path / "w.duckdb") as con:
        report = ingest_outbox(con, outbox, tmp_path / "lake")
        batches = con.execute(
            "SELECT batch_id, sum(bytes), count(*) FROM segment_files WHERE path LIKE '%chat-8b-r0%' GROUP BY 1"
        ).fetchall()
    assert report.steps == 130
    assert len(batches) == (len(segments) + 1) // 2
    assert all(total <= ingest.BATCH_BYTES or files == 1 for _, total, files in batches)
    assert lake_content(tmp_path / "lake") == lake_content(tmp_path / "whole")


def test_a_segment_delivered_twice_is_ingested_once(tmp_path: Path, outbox: Path) -> None:
    lake = tmp_path / "lake"
    with connect(tmp_path / "w.duckdb") as con:
        ingest_outbox(con, outbox, lake)
        before = {p: p.read_bytes() for p in lake.rglob("*.parquet")}
        original = segment_files(outbox, ["chat-8b-r1"])[0]
        shutil.copy(original, original.with_name("redelivered.seg"))
        again = ingest_outbox(con, outbox, lake)
        assert (again.ingested_files, again.duplicate_files, again.steps) == (
            [],
            [original.with_name("redelivered.seg")],
            0,
        )
        assert ingest_outbox(con, outbox, lake).batch_id is None
        assert con.execute(
            "SELECT status, count(*) FROM segment_files GROUP BY status ORDER BY status"
        ).fetchall() == [("duplicate", 1), ("ingested", 2)]
        assert con.execute("SELECT sum(steps) FROM segments").fetchone() == (130,)
    assert {p: p.read_bytes() for p in lake.rglob("*.parquet")} == before


def test_duplicates_in_one_batch_are_kept_once(tmp_path: Path, outbox: Path) -> None:
    original = segment_files(outbox, ["chat-8b-r1"])[0]
    shutil.copy(original, original.with_name("copy.seg"))
    with connect(tmp_path / "w.duckdb") as con:
        report = ingest_outbox(con, outbox, tmp_path / "lake")
    assert report.steps == 130
    assert len(report.duplicate_files) == 1


def test_torn_segment_damage_is_recorded(tmp_path: Path, outbox: Path) -> None:
    victim = segment_files(outbox, ["chat-8b-r1"])[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 40])
    with connect(tmp_path / "w.duckdb") as con:
        report = ingest_outbox(con, outbox, tmp_path / "lake")
        damage = con.execute("SELECT kind, path FROM damage").fetchall()
    assert report.damage >= 1
    assert ("torn_tail", str(victim.relative_to(tmp_path))) in damage


def test_a_torn_segment_is_bounded_by_the_next_one_in_the_next_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outbox = tmp_path / "outbox"
    write_r0_parts(outbox, 2, gap_ns=NS, requests=["a"])
    torn = segment_files(outbox)[0]
    torn.write_bytes(torn.read_bytes()[:-40])

    def damage(database: str) -> list[tuple[Any, ...]]:
        with connect(tmp_path / database) as con:
            ingest_outbox(con, outbox, tmp_path / database.replace(".duckdb", "-lake"))
            return con.execute("SELECT kind, first_seq, last_seq FROM damage").fetchall()

    together = damage("one-batch.duckdb")
    monkeypatch.setattr(ingest, "BATCH_BYTES", 1)  # every segment a batch of its own
    assert damage("batches.duckdb") == together == [("torn_tail", 19, 19)]


def test_sequence_gaps_between_segments(tmp_path: Path) -> None:
    outbox = tmp_path / "outbox"
    first = write_replica_log(
        outbox, POOL, "chat-8b-r0", start=HOUR, steps=5, step_ns=NS, gap_ns=NS, requests=["a"]
    )
    with connect(tmp_path / "w.duckdb") as con:
        ingest_outbox(con, outbox, tmp_path / "lake")
        # A later segment of the same replica starting at seq 9: 5..8 never arrived.
        con.execute(
            "UPDATE segments SET first_seq = 9, last_seq = 12, segment_id = 'later' WHERE path = ?",
            [str(first[0].relative_to(tmp_path))],
        )
        con.execute(
            "INSERT INTO segments SELECT * REPLACE (0 AS first_seq, 4 AS last_seq, 'earlier' AS segment_id) "
            "FROM segments WHERE segment_id = 'later'"
        )
        assert con.execute(
            "SELECT replica, first_missing_seq, last_missing_seq, missing_steps FROM sequence_gaps"
        ).fetchall() == [("chat-8b-r0", 5, 8, 4)]


def test_load_hour_includes_steps_running_into_the_hour(tmp_path: Path) -> None:
    outbox = tmp_path / "outbox"
    # Steps of 40 s every 60 s from 04:58:30: the one at 04:59:30 runs until 05:00:10.
    for replica, requests in (("chat-8b-r1", ["c"]), ("chat-8b-r0", ["a", "b"])):
        write_replica_log(
            outbox,
            POOL,
            replica,
            start=HOUR - timedelta(seconds=90),
            steps=4,
            step_ns=40 * NS,
            gap_ns=20 * NS,
            requests=requests,
        )
    lake = tmp_path / "lake"
    with connect(tmp_path / "w.duckdb") as con:
        ingest_outbox(con, outbox, lake)
    data = load_hour(lake, "chat-8b", HOUR)
    # Ordered by replica, then sequence: the straddling step first.
    assert data.steps.select("replica", "seq").rows() == [
        ("chat-8b-r0", 1),
        ("chat-8b-r0", 2),
        ("chat-8b-r0", 3),
        ("chat-8b-r1", 1),
        ("chat-8b-r1", 2),
        ("chat-8b-r1", 3),
    ]
    assert data.slots.select("replica", "seq", "request_id").rows() == [
        ("chat-8b-r0", 1, "a"),
        ("chat-8b-r0", 1, "b"),
        ("chat-8b-r0", 2, "a"),
        ("chat-8b-r0", 2, "b"),
        ("chat-8b-r0", 3, "a"),
        ("chat-8b-r0", 3, "b"),
        ("chat-8b-r1", 1, "c"),
        ("chat-8b-r1", 2, "c"),
        ("chat-8b-r1", 3, "c"),
    ]
    assert data.holders.height == 0
    # Only the columns asked for, of each table that has them: the same rows.
    keys = load_hour(lake, "chat-8b", HOUR, columns=["pool", "replica", "seq", "request_id"])
    assert keys.steps.columns == ["pool", "replica", "seq"]
    assert keys.holders.columns == [
        "pool",
        "replica",
        "seq",
        "request_id",
    ]
    assert keys.slots.rows() == data.slots.select("pool", "replica", "seq", "request_id").rows()
    assert keys.steps.rows() == data.steps.select("pool", "replica", "seq").rows()
    # Without the step key, the straddling step's rows are still found by it.
    ids = load_hour(lake, "chat-8b", HOUR, columns=["request_id", "seq"])
    assert ids.slots.rows() == data.slots.select("request_id", "seq").rows()
    assert ids.steps.rows() == data.steps.select("seq").rows()
    # Only the tables asked for: the others empty, with their columns.
    steps_only = load_hour(lake, "chat-8b", HOUR, tables=("steps",))
    assert steps_only.steps.equals(data.steps)
    assert (steps_only.slots.height, steps_only.slots.columns) == (0, data.slots.columns)
    assert (steps_only.holders.height, steps_only.holders.columns) == (0, data.holders.columns)


def ingest_until_killed(
    monkeypatch: pytest.MonkeyPatch, con, outbox: Path, lake: Path, replica: str
) -> list[Path]:
    """Ingest `replica` up to its warehouse commit, then die; return the lake files it left."""
    before = set(lake.rglob("*.parquet"))
    with monkeypatch.context() as patch:
        patch.setattr(ingest, "transaction", die_before_commit)
        with pytest.raises(Killed):
            ingest_outbox(con, outbox, lake, replicas=[replica])
    return sorted(set(lake.rglob("*.parquet")) - before)


def test_a_batch_that_died_before_its_commit_is_removed_by_the_next_ingest(
    tmp_path: Path, outbox: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    lake = tmp_path / "lake"
    with connect(tmp_path / "w.duckdb") as con:
        dead = ingest_until_killed(monkeypatch, con, outbox, lake, "chat-8b-r0")
        # r0's steps fall in hours 04 and 05, its slots too; it logged no holders.
        assert len(dead) == 4
        assert len({batch_of(p) for p in dead}) == 1
        # r0 ships another segment before the retry, so the retried batch gets another id.
        write_replica_log(
            outbox,
            POOL,
            "chat-8b-r0",
            start=HOUR + timedelta(minutes=30),
            steps=5,
            step_ns=NS,
            gap_ns=29 * NS,
            requests=["a", "b"],
            first_seq=120,
        )
        with caplog.at_level(logging.WARNING, logger="pipeline.ingestion.ingest"):
            report = ingest_outbox(con, outbox, lake)
        assert report.uncommitted_removed == dead
        assert batch_of(dead[0]) not in committed_batches(con)
        assert con.execute("SELECT sum(steps) FROM segments").fetchone() == (135,)
    assert f"batch {batch_of(dead[0])} was written to the lake but never committed" in caplog.text
    assert not any(path.exists() for path in dead)
    steps = pl.read_parquet(list((lake / "steps").rglob("*.parquet")))
    assert steps.height == 135
    assert steps.select("replica", "seq").is_unique().all()
    assert lake_rows(lake, "slots") == 125 * 2 + 10
    assert list((lake / INTENTS_DIR).glob("*.json*")) == []


def test_readers_of_committed_batches_skip_a_batch_not_yet_committed(
    tmp_path: Path, outbox: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lake = tmp_path / "lake"
    with connect(tmp_path / "w.duckdb") as con:
        ingest_outbox(con, outbox, lake, replicas=["chat-8b-r1"])
        # r0's files are in the lake, as they are while its ingest is still running.
        assert ingest_until_killed(monkeypatch, con, outbox, lake, "chat-8b-r0")
        committed = committed_batches(con)
    data = load_hour(lake, "chat-8b", HOUR, committed)
    assert data.steps.select("replica", "seq").rows() == [("chat-8b-r1", seq) for seq in range(10)]
    assert data.slots.height == 10
    assert data.holders.height == 0
    assert load_hour(lake, "chat-8b", HOUR).steps.height == 10 + 60


def test_an_ingest_waits_for_the_lake_lock(tmp_path: Path, outbox: Path) -> None:
    # Another ingest between its lake writes and its commit must not see its files removed.
    lake = tmp_path / "lake"
    (lake / INTENTS_DIR).mkdir(parents=True)
    reports = []
    with connect(tmp_path / "w.duckdb") as con, (lake / INTENTS_DIR / "lock").open("a") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        waiting = threading.Thread(target=lambda: reports.append(ingest_outbox(con, outbox, lake)))
        waiting.start()
        waiting.join(timeout=0.5)
        assert waiting.is_alive()
        assert not list(lake.rglob("*.parquet"))
        fcntl.flock(other, fcntl.LOCK_UN)
        waiting.join()
    assert reports[0].steps == 130


# --- good data that can never be billed; what filesystems hold -------------------------------


def replica_r0(tmp_path: Path) -> list[Path]:
    """chat-8b-r0: 120 steps of 1 s every 30 s from 04:30 in six segments of 20 (seq 0-59 in
    hour 04, 60-119 in hour 05)."""
    for part in range(6):
        write_replica_log(
            tmp_path / "outbox",
            POOL,
            "chat-8b-r0",
            start=HOUR - timedelta(minutes=30 - 10 * part),
            steps=20,
            step_ns=NS,
            gap_ns=29 * NS,
            requests=["a", "b"],
            first_seq=20 * part,
        )
    return segment_files(tmp_path / "outbox")


def held_seqs(con, lake: Path) -> list[int]:
    data = load_hour(lake, "chat-8b", HOUR - timedelta(hours=1), committed_batches(con))
    later = load_hour(lake, "chat-8b", HOUR, committed_batches(con))
    return sorted({*data.steps["seq"].to_list(), *later.steps["seq"].to_list()})


def both_hours_pass(con, lake: Path) -> bool:
    return all(sequence_findings(con, lake, h)[0] for h in (HOUR - timedelta(hours=1), HOUR))


def sequence_findings(con, lake: Path, hour) -> tuple[bool, str]:
    """The sequence check of chat-8b-r0 for `hour`, from what the warehouse and lake hold."""
    batches = committed_batches(con)
    steps = load_hour(lake, "chat-8b", hour, batches).steps
    tables = {
        name: query_frame(con, f"SELECT * EXCLUDE (batch_id) FROM {name}")
        for name in ("drops", "damage", "segments")
    }
    results = check_sequence(
        hour,
        POOL.model_copy(update={"replicas": POOL.replicas[:1]}),
        steps,
        tables["drops"],
        tables["damage"],
        tables["segments"],
        last_seq_before=last_seq_before(lake, "chat-8b", hour, batches),
    )
    (result,) = results
    return result.passed, result.detail


def test_a_torn_segment_then_its_intact_copy_under_the_same_name_is_billed_once(
    tmp_path: Path,
) -> None:
    segments = replica_r0(tmp_path)
    assert len(segments) == 6
    victim = segments[2]
    intact = victim.read_bytes()
    victim.write_bytes(intact[: len(intact) * 2 // 3])
    lake = tmp_path / "lake"
    with connect(tmp_path / "w.duckdb") as con:
        torn = ingest_outbox(con, outbox=tmp_path / "outbox", lake=lake)
        ((first, last),) = con.execute(
            "SELECT first_seq, last_seq FROM damage WHERE kind = 'torn_tail'"
        ).fetchall()
        assert torn.steps == 120 - (last - first + 1)
        assert last == 59
        assert not both_hours_pass(con, lake)

        victim.write_bytes(intact)  # the replica ships the segment again, same name
        again = ingest_outbox(con, tmp_path / "outbox", lake)
        assert (again.steps, again.ingested_files) == (last - first + 1, [victim])
        assert held_seqs(con, lake) == list(range(120))
        assert con.execute("SELECT kind, first_seq, last_seq FROM damage").fetchall() == [
            ("recovered", first, last)
        ]
        assert con.execute(
            "SELECT count(*), count(DISTINCT sha256) FROM segment_files WHERE path = ?",
            [str(victim.relative_to(tmp_path))],
        ).fetchone() == (2, 2)
        assert con.execute("SELECT sum(steps) FROM segments").fetchone() == (120,)
        assert both_hours_pass(con, lake)
        # Delivered a third time: nothing new.
        shutil.copy(victim, victim.with_name("third.seg"))
        assert ingest_outbox(con, tmp_path / "outbox", lake).steps == 0


def test_a_bit_flipped_segment_then_its_intact_copy_under_a_new_name_is_recovered(
    tmp_path: Path,
) -> None:
    segments = replica_r0(tmp_path)
    victim = segments[3]
    intact = victim.read_bytes()
    flipped = bytearray(intact)
    flipped[len(flipped) // 2] ^= 0x10
    victim.write_bytes(bytes(flipped))
    lake = tmp_path / "lake"
    with connect(tmp_path / "w.duckdb") as con:
        ingest_outbox(con, tmp_path / "outbox", lake)
        ((kind, first, last),) = con.execute(
            "SELECT kind, first_seq, last_seq FROM damage"
        ).fetchall()
        assert kind == "corrupt_frame"
        assert first == last
        assert not both_hours_pass(con, lake)
        victim.with_name("redelivered.seg").write_bytes(intact)
        assert ingest_outbox(con, tmp_path / "outbox", lake).steps == 1
        assert held_seqs(con, lake) == list(range(120))
        assert con.execute("SELECT kind FROM damage").fetchall() == [("recovered",)]
        assert both_hours_pass(con, lake)


def test_garbage_after_an_intact_segment_holds_nothing_back(tmp_path: Path) -> None:
    segments = replica_r0(tmp_path)
    with segments[1].open("ab") as handle:
        handle.write(b"\0" * 100)
    lake = tmp_path / "lake"
    with connect(tmp_path / "w.duckdb") as con:
        assert ingest_outbox(con, tmp_path / "outbox", lake).steps == 120
        ((kind, first, last, detail),) = con.execute(
            "SELECT kind, first_seq, last_seq, detail FROM damage"
        ).fetchall()
        next_segment = con.execute(
            "SELECT first_seq FROM segments ORDER BY first_seq LIMIT 1 OFFSET 2"
        ).fetchone()
        assert next_segment is not None
        (next_first,) = next_segment
        # The next segment starts right after the last intact frame: an empty range.
        assert (kind, first, last) == ("recovered", next_first, next_first - 1)
        assert detail.startswith("corrupt_frame (") or detail.startswith("torn_tail (")
        assert both_hours_pass(con, lake)


def test_a_zero_byte_file_holds_back_only_the_steps_it_can_hide(tmp_path: Path) -> None:
    segments = replica_r0(tmp_path)
    lost = segments[1]  # seq 20-39, 04:40-04:50: zero bytes after a crash
    lost.write_bytes(b"")
    lake = tmp_path / "lake"
    with connect(tmp_path / "w.duckdb") as con:
        assert ingest_outbox(con, tmp_path / "outbox", lake).steps == 100
        assert con.execute("SELECT kind, first_seq, last_seq FROM damage").fetchall() == [
            ("torn_tail", 20, 39)
        ]
        passed, detail = sequence_findings(con, lake, HOUR - timedelta(hours=1))
        assert not passed
        assert "20 steps lost (seq 20-39)" in detail
        # The next hour does not wait on a file that could only hide seq 20-39.
        assert sequence_findings(con, lake, HOUR) == (True, "no steps logged in the hour")


def test_a_moved_data_directory_is_the_same_data(tmp_path: Path, outbox: Path) -> None:
    lake = tmp_path / "lake"
    with connect(tmp_path / "w.duckdb") as con:
        ingest_outbox(con, outbox, lake)
        moved = tmp_path / "restored"
        moved.mkdir()
        shutil.move(outbox, moved / "outbox")
        again = ingest_outbox(con, moved / "outbox", lake)
        assert (again.batch_id, again.ingested_files, again.duplicate_files) == (None, [], [])


def test_what_is_no_readable_file_is_damage_naming_it_and_nothing_blocks(
    tmp_path: Path, outbox: Path
) -> None:
    import os

    directory = outbox / "chat-8b-r1"
    odd = {
        "a-directory.seg": "unreadable (a directory, not a segment file)",
        "a-fifo.seg": "unreadable (a FIFO, not a segment file)",
        "b-fifo.seg": "unreadable (a FIFO, not a segment file)",
        "dangling.seg": "unreadable (cannot open: No such file or directory)",
        "loop.seg": "unreadable (cannot open: Too many levels of symbolic links)",
        # Root reads a file of mode 000 all the same; /proc/self/mem refuses every reader
        # at offset 0 (an unmapped address), so the read error is a real one.
        "eio.seg": "unreadable (cannot read: Input/output error)",
    }
    (directory / "a-directory.seg").mkdir()
    os.mkfifo(directory / "a-fifo.seg")
    os.mkfifo(directory / "b-fifo.seg")
    (directory / "dangling.seg").symlink_to(directory / "gone.seg")
    (directory / "loop.seg").symlink_to("loop.seg")
    (directory / "eio.seg").symlink_to("/proc/self/mem")
    lake = tmp_path / "lake"
    with connect(tmp_path / "w.duckdb") as con:
        report = ingest_outbox(con, outbox, lake)
        assert report.steps == 130
        damage = con.execute("SELECT path, kind, detail FROM damage ORDER BY path").fetchall()
        assert damage == [
            (f"outbox/chat-8b-r1/{name}", "unreadable", why.removeprefix("unreadable (")[:-1])
            for name, why in sorted(odd.items())
        ]
        # Names that do not place them in the sequence: they may hide anything of the replica.
        assert con.execute("SELECT count(*) FROM damage WHERE first_seq IS NULL").fetchone() == (6,)
        # Reported once, not on every ingest.
        assert ingest_outbox(con, outbox, lake).batch_id is None


DAMAGE_KINDS = st.sampled_from(["tear", "flip", "empty"])


@settings(max_examples=20, deadline=None)
@given(
    damaged=st.dictionaries(st.integers(0, 5), st.tuples(DAMAGE_KINDS, st.floats(0.0, 1.0))),
    same_name=st.lists(st.booleans(), min_size=6, max_size=6),
    order=st.permutations(range(6)),
    rounds=st.integers(1, 3),
)
def test_every_step_is_billed_once_whatever_is_damaged_and_redelivered(
    damaged, same_name, order, rounds
) -> None:
    """Damage any segments (torn anywhere, a byte flipped anywhere, emptied), ingest, then
    deliver the intact copies in any order, under the same name or another, over several
    ingests: no step is ever held twice, and at the end every step is held and no damage can
    hide one."""
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        segments = replica_r0(root)
        intact = {i: segments[i].read_bytes() for i in damaged}
        for i, (kind, where) in damaged.items():
            data = intact[i]
            at = min(int(where * len(data)), len(data) - 1)
            if kind == "tear":
                segments[i].write_bytes(data[:at])
            elif kind == "flip":
                segments[i].write_bytes(data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1 :])
            else:
                segments[i].write_bytes(b"")
        lake = root / "lake"
        redeliveries = [i for i in order if i in damaged]
        with connect(root / "w.duckdb") as con:
            ingest_outbox(con, root / "outbox", lake)
            for turn in range(rounds):
                for i in redeliveries[turn::rounds]:
                    target = (
                        segments[i] if same_name[i] else segments[i].with_name(f"again-{i}.seg")
                    )
                    target.write_bytes(intact[i])
                ingest_outbox(con, root / "outbox", lake)
                held = pl.read_parquet(
                    [
                        p
                        for p in (lake / "steps").rglob("*.parquet")
                        if batch_of(p) in committed_batches(con)
                    ]
                )["seq"]
                assert held.is_unique().all()
            assert sorted(held.to_list()) == list(range(120))
            hiding = con.execute(
                "SELECT path, kind, first_seq, last_seq FROM damage WHERE list_contains(?, kind)",
                [list(ingest.HIDING_DAMAGE)],
            ).fetchall()
            assert hiding == []
            assert con.execute("SELECT sum(steps) FROM segments").fetchone() == (120,)


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["chat", "reason"]),
            st.sampled_from(["r0", "r1"]),
            st.integers(0, 6),
            st.integers(0, 3),
            st.integers(0, 2),
        ),
        max_size=12,
    ),
    shuffle=st.randoms(use_true_random=False),
    in_step_order=st.booleans(),
    chunks=st.integers(1, 4),
)
def test_hour_parts_are_the_rows_a_join_on_the_step_gives_grouped_in_order_of_first_appearance(
    steps, shuffle, in_step_order, chunks
):
    """Slicing the rows of runs of steps (rows in step order, unique step keys) and joining the
    steps' hours then grouping agree exactly: the groups, their rows and the rows' order, whether
    the steps' keys repeat or not, the rows are in order or not, and however the table is cut."""
    step_frame = pl.DataFrame(
        steps,
        schema={
            "pool": pl.String,
            "replica": pl.String,
            "seq": pl.Int64,
            "num_slots": pl.Int32,
            "_hour": pl.Int64,
        },
        orient="row",
    )
    hours = step_frame.select("pool", "replica", "seq", "_hour")
    step_runs = ingest._runs(hours.select(ingest.PART_KEY))
    in_order = in_step_order and ingest._unique_in_order(hours["seq"].to_numpy(), step_runs)
    rows = [(p, r, s, i) for p, r, s, n, _ in steps for i in range(n)]
    if not in_step_order:
        shuffle.shuffle(rows)
    slots = pl.DataFrame(
        rows,
        schema={"pool": pl.String, "replica": pl.String, "seq": pl.Int64, "slot": pl.Int64},
        orient="row",
    )
    for frame, counts in (
        (slots, step_frame["num_slots"].to_numpy()),
        (step_frame.drop("_hour", "num_slots"), None),
    ):
        joined = frame.join(hours, on=ingest.STEP_KEY, how="left", maintain_order="left")
        expected = [
            (group, part.drop("_hour").to_dicts())
            for group, part in joined.group_by(ingest.PART_KEY, maintain_order=True)
        ]
        cut = max(1, frame.height // chunks)
        table = pl.concat(
            [frame.slice(i, cut) for i in range(0, frame.height, cut)] or [frame], rechunk=False
        ).to_arrow()
        parts = ingest._hour_parts(table, hours, step_runs, counts, in_order)
        assert [(group, part.to_pylist()) for group, part in parts] == expected


@given(steps=st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 5)), max_size=8))
def test_step_keys_are_unique_and_in_order_when_each_replica_rises_in_one_run(steps):
    hours = pl.DataFrame(
        [("p", replica, seq, 0) for replica, seq in steps],
        schema={"pool": pl.String, "replica": pl.String, "seq": pl.Int64, "_hour": pl.Int64},
        orient="row",
    )
    runs = ingest._runs(hours.select(ingest.PART_KEY))
    blocks = [r for i, (r, _) in enumerate(steps) if i == 0 or steps[i - 1][0] != r]
    rising = all(
        seqs == sorted(set(seqs))
        for seqs in ([s for r, s in steps if r == replica] for replica in "ab")
    )
    expected = len(blocks) == len(set(blocks)) and rising
    assert ingest._unique_in_order(hours["seq"].to_numpy(), runs) == expected


def test_a_lake_file_has_the_same_bytes_however_its_rows_were_chunked(tmp_path: Path) -> None:
    # Enough distinct strings that a column's pages fill, where chunk boundaries would show.
    rows = 100_000
    schema = ingest.LAKE_TABLES["slots"]
    whole = pa.table(
        [
            pa.array(
                [f"{f.name}-{i}" for i in range(rows)] if f.type == pa.string() else range(rows),
                f.type,
            )
            for f in schema
        ],
        schema=schema,
    )
    digests = {
        ingest._write_part(
            pa.concat_tables([whole.slice(at, cut) for at in range(0, rows, cut)]),
            schema,
            tmp_path / f"{cut}.parquet",
        )
        for cut in (rows, rows // 3, 7777)
    }
    assert len(digests) == 1
