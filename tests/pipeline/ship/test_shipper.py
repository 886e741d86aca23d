"""The shipper: each closed segment put once and verified before it leaves the outbox, backoff
with jitter while the store is down, and a page when the outbox outgrows its budget."""

from __future__ import annotations

import hashlib
import json
import random
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.fs as pafs
from hypothesis import given
from hypothesis import strategies as st

from pipeline.reconcile.alerts import JsonLinesSink
from pipeline.ship.shipper import (
    FIRST_RETRY_S,
    LAST_RETRY_S,
    Shipper,
    ship_pending,
    ship_segment,
)
from pipeline.ship.store import SegmentStore, open_store
from tests.helpers.dagster_processes import free_port

REPLICA = "r0"
NOON = datetime(2026, 11, 30, 12, 5, tzinfo=UTC)


def outbox_with_segment(tmp_path: Path, write_segment, steps: int = 5) -> tuple[Path, Path]:
    outbox = tmp_path / "outbox"
    (segment,) = write_segment(steps, outbox / REPLICA)
    return outbox, segment


def test_a_closed_segment_is_put_verified_and_then_removed(tmp_path, write_segment):
    outbox, segment = outbox_with_segment(tmp_path, write_segment)
    data = segment.read_bytes()
    open_file = outbox / REPLICA / f".{segment.name}.999.partial"
    open_file.write_bytes(b"still being written")
    store = open_store(str(tmp_path / "store"))

    report = ship_pending(store, outbox)

    key = (
        f"outbox/{REPLICA}/{segment.name.removesuffix('.seg')}.000000000004."
        f"{hashlib.sha256(data).hexdigest()}.seg"
    )
    assert [s.key for s in report.shipped] == [key]
    assert report.failed == []
    assert (tmp_path / "store" / key).read_bytes() == data
    assert not segment.exists()
    assert open_file.read_bytes() == b"still being written"


def test_a_segment_already_on_the_store_is_not_put_again(tmp_path, write_segment):
    """As after a shipper killed between the verified upload and the local delete."""
    _, segment = outbox_with_segment(tmp_path, write_segment)
    store = open_store(str(tmp_path / "store"))
    first = ship_segment(store, segment)
    object_path = tmp_path / "store" / first.key
    before = object_path.stat()
    segment.parent.mkdir(parents=True, exist_ok=True)
    segment.write_bytes(object_path.read_bytes())

    assert ship_segment(store, segment) == first
    after = object_path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert not segment.exists()


def test_a_torn_object_under_the_key_is_replaced(tmp_path, write_segment):
    _, segment = outbox_with_segment(tmp_path, write_segment)
    data = segment.read_bytes()
    store = open_store(str(tmp_path / "store"))
    key = ship_segment(store, segment).key
    segment.write_bytes(data)
    store.put(key, data[: len(data) // 2])

    ship_segment(store, segment)
    assert (tmp_path / "store" / key).read_bytes() == data


@given(failures=st.integers(1, 40), seed=st.integers(0, 2**32))
def test_retries_back_off_exponentially_with_full_jitter(failures, seed):
    shipper = Shipper(
        open_store("/nonexistent"),
        Path("/nonexistent"),
        "chat-8b",
        1,
        JsonLinesSink(),
        rng=random.Random(seed),
        failures=failures,
    )
    bound = min(LAST_RETRY_S, FIRST_RETRY_S * 2 ** (failures - 1))
    assert 0 <= shipper.retry_delay() <= bound


def unreachable_store() -> SegmentStore:
    filesystem = pafs.S3FileSystem(
        endpoint_override=f"http://127.0.0.1:{free_port()}",
        access_key="k",
        secret_key="s",
        region="us-east-1",
        connect_timeout=1,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1),
    )
    return SegmentStore(filesystem, "bucket/fleet", "s3://bucket/fleet")


def test_a_store_that_is_down_is_retried_and_the_outbox_kept(tmp_path, write_segment):
    outbox, segment = outbox_with_segment(tmp_path, write_segment)
    shipper = Shipper(
        unreachable_store(), outbox, "chat-8b", 1 << 30, JsonLinesSink(tmp_path / "pages")
    )
    delays = [shipper.step(), shipper.step()]
    assert shipper.failures == 2
    assert 0 <= delays[0] <= FIRST_RETRY_S
    assert 0 <= delays[1] <= 2 * FIRST_RETRY_S
    assert segment.exists()
    assert not (tmp_path / "pages").exists()


def test_an_outbox_over_its_budget_pages_once_an_hour(tmp_path, write_segment):
    outbox, segment = outbox_with_segment(tmp_path, write_segment)
    size = segment.stat().st_size
    pages = tmp_path / "pages.jsonl"
    now = [NOON]
    shipper = Shipper(
        unreachable_store(),
        outbox,
        "chat-8b",
        size - 1,
        JsonLinesSink(pages),
        clock=lambda: now[0],
    )
    shipper.step()
    shipper.step()
    now[0] = NOON.replace(hour=13)
    shipper.step()

    sent = [json.loads(line) for line in pages.read_text().splitlines()]
    assert [(p["hour"], p["kind"], p["finding"], p["pool"]) for p in sent] == [
        ("2026-11-30T12", "ship", "outbox_over_budget", "chat-8b"),
        ("2026-11-30T13", "ship", "outbox_over_budget", "chat-8b"),
    ]
    assert sent[0]["detail"] == (
        f"outbox {outbox} holds {size:,} bytes, over its budget of {size - 1:,}: segments are "
        "not reaching the object store (check the shipper's log and the store); the engine "
        "keeps recording until the disk fills"
    )


def test_an_outbox_within_its_budget_pages_nobody(tmp_path, write_segment):
    outbox, segment = outbox_with_segment(tmp_path, write_segment)
    shipper = Shipper(
        unreachable_store(),
        outbox,
        "chat-8b",
        segment.stat().st_size,
        JsonLinesSink(tmp_path / "pages"),
    )
    assert shipper.check_budget() is None
    assert not (tmp_path / "pages").exists()
