"""The segment store on a real S3 server: keys, credentials, and pulls that take a segment only
once its object is complete."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.ship.s3server import S3Server
from pipeline.ship.store import (
    SegmentObject,
    StoreUnavailable,
    open_store,
    parse_key,
    pull_segments,
)
from schemas.errors import ConfigError

REPLICA = "chat-8b-r0"
SEGMENT = b"segment bytes " * 1000


def shipped(data: bytes, name: str = f"{REPLICA}.000000000100.0123456789ab.seg") -> SegmentObject:
    return SegmentObject(REPLICA, name, 180, hashlib.sha256(data).hexdigest(), len(data))


@given(
    replica=st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True),
    first=st.integers(0, 10**15),
    length=st.integers(0, 10**6),
    segment_id=st.from_regex(r"[0-9a-f]{12}", fullmatch=True),
    digest=st.binary(min_size=32, max_size=32),
)
def test_a_key_names_its_segment_and_back(replica, first, length, segment_id, digest):
    segment = SegmentObject(
        replica, f"{replica}.{first:012d}.{segment_id}.seg", first + length, digest.hex(), 7
    )
    assert parse_key(segment.key, 7) == segment
    assert segment.key.startswith(f"outbox/{replica}/")


@pytest.mark.parametrize(
    "key",
    [
        "outbox/r0/r0.000000000001.ab.seg",  # no range and hash
        "outbox/r0/r0.000000000001.ab.000000000009.ABCD.seg",
        "ledger/r0/r0.000000000001.ab.000000000009." + "0" * 64 + ".seg",
        "outbox/r0/nested/r0.000000000001.ab.000000000009." + "0" * 64 + ".seg",
    ],
)
def test_other_keys_are_not_segments(key):
    assert parse_key(key) is None


@pytest.mark.parametrize(
    "uri",
    [
        "s3://key:secret@bucket/prefix",
        "s3://bucket/prefix?access_key=AKIA&secret_key=s",
        "s3://bucket/prefix?session_token=t",
    ],
)
def test_credentials_in_the_uri_are_refused(uri):
    with pytest.raises(ConfigError, match="AWS_ACCESS_KEY_ID") as refused:
        open_store(uri)
    assert "secret" not in str(refused.value).replace("AWS_SECRET_ACCESS_KEY", "")


def test_credentials_come_from_the_environment(s3_server: S3Server, monkeypatch) -> None:
    store = open_store(s3_server.uri("lake"))
    store.put("outbox/x/probe", b"1")
    assert store.size_of("outbox/x/probe") == 1
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StoreUnavailable, match=r"s3://stepledger/lake/outbox/x/probe") as refused:
        open_store(s3_server.uri("lake")).size_of("outbox/x/probe")
    assert "not-the-secret" not in str(refused.value)


def test_a_torn_object_is_refused_until_its_whole_segment_arrives(
    s3_server: S3Server, tmp_path: Path
) -> None:
    store = open_store(s3_server.uri("fleet"))
    segment = shipped(SEGMENT)
    store.put(segment.key, SEGMENT[:5000])
    outbox = tmp_path / "outbox"

    torn = pull_segments(store, outbox)
    assert torn.pulled == []
    assert torn.refused == [
        f"s3://stepledger/fleet/{segment.key}: 5000 bytes with sha256 "
        f"{hashlib.sha256(SEGMENT[:5000]).hexdigest()}, not the content its key names: "
        "a torn or partial upload, not ingested"
    ]
    assert list(outbox.rglob("*")) == []

    store.put(segment.key, SEGMENT)
    late = pull_segments(store, outbox)
    assert late.pulled == [outbox / REPLICA / segment.name]
    assert late.refused == []
    assert (outbox / REPLICA / segment.name).read_bytes() == SEGMENT
    # Already in the outbox: not pulled again.
    assert pull_segments(store, outbox).pulled == []


def test_a_pull_takes_only_the_replicas_asked_for(s3_server: S3Server, tmp_path: Path) -> None:
    store = open_store(s3_server.uri("replicas"))
    other = SegmentObject("r9", "r9.000000000000.0123456789ab.seg", 3, shipped(b"x").sha256)
    store.put(other.key, b"x")
    store.put(shipped(SEGMENT).key, SEGMENT)
    report = pull_segments(store, tmp_path, replicas=[REPLICA])
    assert [p.relative_to(tmp_path).parts[0] for p in report.pulled] == [REPLICA]


def test_a_local_directory_is_a_store(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "store"))
    segment = shipped(SEGMENT)
    store.put(segment.key, SEGMENT)
    assert store.segments() == [segment]
    assert sorted(p.name for p in (tmp_path / "store").rglob("*") if p.is_file()) == [
        segment.key.rsplit("/", 1)[1]
    ]
