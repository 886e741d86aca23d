"""Step-log segments on an object store: where `stepledger ship` puts each closed segment of an
engine's outbox, and where ingestion finds them.

    <prefix>/outbox/<replica>/<segment name less .seg>.<last seq:012d>.<sha256>.seg

The key names the replica, the segment's sequence range (its name carries the first sequence
number) and its content's sha256, so an object is put once, found again after a restart, and
checked against its own key when it is read: an object whose bytes do not hash to its key
(a torn or tampered upload) is refused, never ingested. A PUT is atomic on S3 (a reader sees
the whole object or none, and an interrupted multipart upload is never listed), so an object
that is listed and hashes to its key is complete.

The store is `STEPLEDGER_STORE` (`s3://bucket/prefix`, or a local directory). Credentials come
only from the environment or the instance role, as the AWS SDK finds them
(`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_PROFILE`, the
instance's role), with `AWS_ENDPOINT_URL` and `AWS_REGION` for a store other than AWS's; a
URI that carries credentials is refused, so they never reach logs, run config or metadata.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pyarrow.fs as pafs

from schemas.errors import ConfigError, ExternalError

log = logging.getLogger(__name__)

STORE_VARIABLE = "STEPLEDGER_STORE"
OUTBOX_PREFIX = "outbox"
SEGMENT_SUFFIX = ".seg"
_KEY_NAME = re.compile(r"^(?P<stem>.+)\.(?P<last>\d{12,19})\.(?P<sha256>[0-9a-f]{64})\.seg$")
_SECRET_QUERY = {"access_key", "secret_key", "session_token"}


class StoreUnavailable(ExternalError, OSError):
    """The object store could not be reached or refused a request; the message names the key."""


@dataclass(frozen=True)
class SegmentObject:
    """One segment on the store: where it came from, its last sequence number and content."""

    replica: str
    name: str  # the segment's file name in its outbox, `<replica>.<first seq>.<id>.seg`
    last_seq: int
    sha256: str
    size: int = -1  # as listed; -1 before it is

    @property
    def key(self) -> str:
        """The object's key under the store's prefix."""
        stem = self.name.removesuffix(SEGMENT_SUFFIX)
        return f"{OUTBOX_PREFIX}/{self.replica}/{stem}.{self.last_seq:012d}.{self.sha256}.seg"


def parse_key(key: str, size: int = -1) -> SegmentObject | None:
    """The segment an object's key (under the store's prefix) names; None for any other key."""
    parts = key.split("/")
    match = _KEY_NAME.match(parts[-1])
    if len(parts) != 3 or parts[0] != OUTBOX_PREFIX or match is None:
        return None
    return SegmentObject(
        parts[1], match["stem"] + SEGMENT_SUFFIX, int(match["last"]), match["sha256"], size
    )


@dataclass(frozen=True)
class SegmentStore:
    """A prefix of a `pyarrow.fs` file system: an S3 bucket's, or a local directory."""

    filesystem: pafs.FileSystem
    root: str  # the prefix, as the file system names paths
    uri: str  # for messages: the URI it was opened from, which holds no credentials

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def put(self, key: str, data: bytes) -> None:
        """Write an object in one request (atomic on S3); a local store writes a temporary
        file and renames it, for the same effect."""
        target = self.path(key)
        try:
            if isinstance(self.filesystem, pafs.LocalFileSystem):
                self.filesystem.create_dir(target.rsplit("/", 1)[0], recursive=True)
                partial = f"{target}.partial"
                with self.filesystem.open_output_stream(partial) as stream:
                    stream.write(data)
                self.filesystem.move(partial, target)
                return
            with self.filesystem.open_output_stream(target) as stream:
                stream.write(data)
        except OSError as err:
            raise StoreUnavailable(f"{self.uri}/{key}: upload failed: {err}") from err

    def get(self, key: str) -> bytes:
        try:
            with self.filesystem.open_input_stream(self.path(key)) as stream:
                return bytes(stream.read())
        except OSError as err:
            raise StoreUnavailable(f"{self.uri}/{key}: download failed: {err}") from err

    def size_of(self, key: str) -> int | None:
        """The object's size in bytes; None when there is none."""
        try:
            info = self.filesystem.get_file_info(self.path(key))
        except OSError as err:
            raise StoreUnavailable(f"{self.uri}/{key}: cannot look it up: {err}") from err
        return info.size if info.type == pafs.FileType.File else None

    def segments(self, replicas: Iterable[str] | None = None) -> list[SegmentObject]:
        """Every segment object under the prefix (of `replicas`, when given), by key."""
        selector = pafs.FileSelector(self.path(OUTBOX_PREFIX), recursive=True, allow_not_found=True)
        try:
            infos = self.filesystem.get_file_info(selector)
        except OSError as err:
            raise StoreUnavailable(f"{self.uri}: cannot list the segments: {err}") from err
        wanted = None if replicas is None else set(replicas)
        found = [
            parsed
            for info in infos
            if info.type == pafs.FileType.File
            and (parsed := parse_key(info.path.removeprefix(self.root + "/"), info.size))
            and (wanted is None or parsed.replica in wanted)
        ]
        return sorted(found, key=lambda s: s.key)


def open_store(uri: str) -> SegmentStore:
    """The store at `uri` (`s3://bucket/prefix`, `file:///dir` or a local path)."""
    parts = urlsplit(uri)
    if parts.username or parts.password or _SECRET_QUERY & set(parse_qs(parts.query)):
        raise ConfigError(
            f"{STORE_VARIABLE}: the store's URI carries credentials; give them only through "
            "the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) or the instance role"
        )
    if not parts.scheme:
        local = Path(uri).resolve()
        return SegmentStore(pafs.LocalFileSystem(), str(local), str(local))
    try:
        filesystem, root = pafs.FileSystem.from_uri(uri)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{STORE_VARIABLE}={uri}: not a store pyarrow can open: {err}") from err
    return SegmentStore(filesystem, root.rstrip("/"), uri.rstrip("/"))


def store_from_env(environ: Mapping[str, str] | None = None) -> SegmentStore | None:
    """The store `STEPLEDGER_STORE` names; None when it is unset (segments are local)."""
    uri = (os.environ if environ is None else environ).get(STORE_VARIABLE, "")
    return open_store(uri) if uri else None


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class PullReport:
    """What `pull_segments` did: segments copied to the outbox, and objects refused."""

    pulled: list[Path] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # one line per object, naming its key


def pull_segments(
    store: SegmentStore, outbox: Path, replicas: Iterable[str] | None = None
) -> PullReport:
    """Copy every segment on the store not yet in `outbox/<replica>/<name>` there, each checked
    against the sha256 its key names and renamed into place only then, so ingestion (which
    reads the outbox) never sees a torn object. An object refused is listed again on the next
    pull, so one completed late is taken then."""
    report = PullReport()
    for segment in store.segments(replicas):
        target = outbox / segment.replica / segment.name
        if target.is_file() and target.stat().st_size == segment.size:
            continue
        data = store.get(segment.key)
        found = sha256_hex(data)
        if found != segment.sha256:
            report.refused.append(
                f"{store.uri}/{segment.key}: {len(data)} bytes with sha256 {found}, not the "
                "content its key names: a torn or partial upload, not ingested"
            )
            log.warning("%s", report.refused[-1])
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.pull.partial")
        partial.write_bytes(data)
        os.replace(partial, target)
        report.pulled.append(target)
    return report
