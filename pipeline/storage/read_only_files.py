"""The warehouse's data files as a file system that can only read, for finance's connections.

DuckDB has no read-only file access: `allowed_directories` lets a connection whose external
access is off read *and write* there, so a reader allowed the lake's data directory could
overwrite a published Parquet file with `COPY ... TO`. A finance connection therefore reaches
the data files (and the Parquet lake beside the warehouse) only through this file system,
registered under its own protocol with the DuckLake's data path pointing into it, and has
DuckDB's local file system disabled. It opens files for reading and lists directories, inside
the directories it was given only; anything else (opening to write, removing, moving, copying,
creating directories) is refused.

It also verifies what it serves: each data file of a published pool-hour (the warehouse's
`published_files`, pipeline.storage.integrity) is hashed when a query first opens it and
refused unless its sha256 is the one recorded when the hour was published. Hashes are cached
in the process by (path, size, modification time), out of reach of the reader's SQL, so a
file is read through once per process and only if a query reads it.

When the data files are on an object store (`pipeline.storage.data_files`), they are reached
through a pyarrow S3 client holding the reader's keys, under URLs without a leading slash
(`ledgerfiles://bucket/prefix/...`); the same refusals hold, and the store refuses the
reader's keys any write besides. A published object is read whole and hashed, and served
from those very bytes: an object's modification time has a resolution of a second, too
coarse to key a cache on, and bytes checked then read again could have changed between.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import io
import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from pipeline.storage.data_files import HASH_CHUNK_BYTES, DataFiles
from schemas.errors import DataError
from schemas.units import hour_key

PROTOCOL = "ledgerfiles"
# Files whose sha256 a process keeps; beyond this the least recently read are hashed again.
CACHED_HASHES = 1 << 16


class ReadOnlyFileRefused(PermissionError):
    """A finance connection tried to change a file, or to read outside its directories."""


@dataclass(frozen=True)
class PublishedFile:
    """A DuckLake data file holding rows of a published pool-hour, as it was published."""

    path: str  # relative to the warehouse's data directory
    table_name: str
    hour: datetime
    pool: str
    sha256: str

    def changed(self, where: str, found: str) -> str:
        """What is wrong when the file at `where` (its path or URI) now has sha256 `found`."""
        return (
            f"{where} ({self.table_name} of pool {self.pool} hour {hour_key(self.hour)}): "
            f"sha256 {found}, but it was published as {self.sha256}: the warehouse data file "
            "was changed after publishing, so it is not served (restore it from a backup)"
        )


class PublishedFileChanged(DataError):
    """A data file of a published pool-hour is not what was published."""


def refusal_in(err: BaseException) -> PublishedFileChanged | None:
    """The PublishedFileChanged a DuckDB error carries, if any: DuckDB reports an exception
    raised in a file system as text (the class name, the message, then a traceback)."""
    prefix = f"{PublishedFileChanged.__name__}: "
    text = str(err)
    if prefix not in text:
        return None
    return PublishedFileChanged(text.split(prefix, 1)[1].split("\n\nAt:", 1)[0])


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


@functools.lru_cache(maxsize=CACHED_HASHES)
def cached_sha256(path: str, size: int, mtime_ns: int) -> str:
    """The sha256 of the file at `path`, hashed once per version of it in this process."""
    return file_sha256(Path(path))


# fsspec ships no type hints: its base class is Any to mypy.
class ReadOnlyFiles(AbstractFileSystem):  # type: ignore[misc]
    """Files under the directories `roots`, read-only. fsspec's base class refuses every write
    it does not route through `_open`, which refuses every mode but reading; the directory
    operations the base class treats as no-ops are refused too, so nothing reports success
    for a change. `store`: the warehouse's data files on an object store, readable too."""

    protocol = (PROTOCOL,)
    # Each finance connection registers its own instance; fsspec must not hand out a cached one.
    cachable = False

    def __init__(self, *roots: Path, store: DataFiles | None = None) -> None:
        super().__init__()
        self.roots = [Path(os.path.realpath(root)) for root in roots]
        self.store = store
        self._local = LocalFileSystem()
        self._published: dict[str, PublishedFile] = {}

    def verify_published(self, data: DataFiles, files: Mapping[str, PublishedFile]) -> None:
        """From now on, serve the data files `files` (by path relative to the data path of
        `data`) only while their sha256 is the one they were published with."""
        if data.on_store:
            self._published = {data.path(path): file for path, file in files.items()}
            return
        real = os.path.realpath(data.root)
        self._published = {os.path.join(real, path): file for path, file in files.items()}

    def data_url(self, data: DataFiles) -> str:
        """The data path of `data` as a URL of this file system, with a trailing slash."""
        if data.on_store:
            return f"{PROTOCOL}://{self._on_store(data.root)}/"
        return self.url(Path(data.root))

    def readable_urls(self) -> list[str]:
        """The URL prefixes a connection over this file system may read: each root's URL, and
        its glob pattern when that differs (`pattern`)."""
        urls = [url for root in self.roots for url in (self.url(root), self.pattern(root))]
        if self.store is not None:
            urls.append(self.data_url(self.store))
        return list(dict.fromkeys(urls))

    def url(self, root: Path) -> str:
        """A directory `root` (one of `roots`, or below one) as a URL of this file system, with
        a trailing slash."""
        return f"{PROTOCOL}://{self._inside(str(root))}/"

    def pattern(self, root: Path) -> str:
        """`url` of the directory `root` with the wildcards of its path (`[`, `*`, `?`) escaped
        as `glob.escape` escapes them, as DuckDB does: the start of a glob pattern of the files
        below it, whatever the directory is named."""
        return f"{PROTOCOL}://{glob.escape(self._inside(str(root)))}/"

    def glob(self, path: str, **kwargs: Any) -> Any:
        """The paths matching the glob pattern `path`. fsspec lists a pattern's matches from the
        directory before its first wildcard, which for a root whose own path holds one (a
        `[bold]demo` directory) lies above the root and is refused, so nothing would match: a
        pattern below such a root, escaped as `pattern` escapes it, is matched from the root."""
        local = self._strip_protocol(path)
        for root in self.roots:
            escaped = glob.escape(str(root))
            if escaped != str(root) and local.startswith(escaped + "/"):
                break
        else:
            return super().glob(path, **kwargs)
        relative = local.removeprefix(escaped + "/")
        # Python's glob matches as fsspec's does (fsspec's pattern translation is a copy of it).
        found = glob.glob(relative, root_dir=root, recursive=True, include_hidden=True)
        matches = sorted(str(root / name) for name in found if self._readable(str(root / name)))
        return {name: self.info(name) for name in matches} if kwargs.get("detail") else matches

    def _readable(self, path: str) -> bool:
        """Whether `path` is inside a root (a symbolic link below one may lead out of it)."""
        try:
            self._inside(path)
        except ReadOnlyFileRefused:
            return False
        return True

    def _on_store(self, path: str) -> str:
        """The store path (`bucket/key`) of `path`, a URL of this file system without a
        leading slash, refused unless the store's data path holds it (no `..` out of it)."""
        key = posixpath.normpath(str(self._strip_protocol(path)))
        root = self.store.root if self.store is not None else None
        if root is None or not (key == root or key.startswith(root + "/")):
            raise ReadOnlyFileRefused(f"{path}: outside the files readable here")
        return key

    def _stored(self, path: str) -> bool:
        """Whether `path` names an object on the store rather than a local file."""
        return self.store is not None and not str(self._strip_protocol(path)).startswith("/")

    def _store_entry(self, info: pafs.FileInfo) -> dict[str, Any]:
        kind = "directory" if info.type == pafs.FileType.Directory else "file"
        return {"name": info.path, "size": info.size or 0, "type": kind, "mtime": info.mtime}

    def _store_info(self, key: str) -> pafs.FileInfo:
        assert self.store is not None
        info = self.store.filesystem.get_file_info(key)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"{self.store.uri}: no {key}")
        return info

    def _inside(self, path: str) -> str:
        """The local path of `path` (a URL of this file system or a plain path), refused unless it
        resolves to a root or below one (no `..` or symbolic link out of them)."""
        local = os.path.realpath(str(self._strip_protocol(path)))
        if not any(Path(local).is_relative_to(root) for root in self.roots):
            raise ReadOnlyFileRefused(
                f"{path}: outside the directories readable here ({', '.join(map(str, self.roots))})"
            )
        return local

    # Entries are named by local path, as fsspec names them (without the protocol).
    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        if self._stored(path):
            assert self.store is not None
            selector = pafs.FileSelector(self._on_store(path), allow_not_found=True)
            listed = [self._store_entry(i) for i in self.store.filesystem.get_file_info(selector)]
            return listed if detail else [entry["name"] for entry in listed]
        entries: list[Any] = self._local.ls(self._inside(path), detail=detail)
        return entries

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        if self._stored(path):
            return self._store_entry(self._store_info(self._on_store(path)))
        info: dict[str, Any] = self._local.info(self._inside(path))
        return info

    def modified(self, path: str) -> Any:
        if self._stored(path):
            return self._store_info(self._on_store(path)).mtime
        return self._local.modified(self._inside(path))

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if mode != "rb":
            raise ReadOnlyFileRefused(f"{path}: read-only here")
        if self._stored(path):
            return self._open_stored(self._on_store(path))
        local = self._inside(path)
        published = self._published.get(local)
        if published is not None:
            version = os.stat(local)
            found = cached_sha256(local, version.st_size, version.st_mtime_ns)
            if found != published.sha256:
                raise PublishedFileChanged(published.changed(local, found))
        return self._local._open(local, mode="rb")

    def _open_stored(self, key: str) -> Any:
        assert self.store is not None
        published = self._published.get(key)
        if published is None:
            return self.store.filesystem.open_input_file(key)
        with self.store.filesystem.open_input_stream(key) as stream:
            data = bytes(stream.read())
        found = hashlib.sha256(data).hexdigest()
        if found != published.sha256:
            where = f"s3://{key}"
            raise PublishedFileChanged(published.changed(where, found))
        return io.BytesIO(data)

    def _refuse(self, path: Any, *args: Any, **kwargs: Any) -> None:
        raise ReadOnlyFileRefused(f"{path}: read-only here")

    mkdir = makedirs = rmdir = cp_file = _rm = rm = mv = _refuse
