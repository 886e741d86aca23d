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
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from schemas.errors import DataError
from schemas.units import hour_key

PROTOCOL = "ledgerfiles"
HASH_CHUNK_BYTES = 1 << 20
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

    def changed(self, local: Path, found: str) -> str:
        """What is wrong when the file at `local` now has sha256 `found`."""
        return (
            f"{local} ({self.table_name} of pool {self.pool} hour {hour_key(self.hour)}): "
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
    for a change."""

    protocol = (PROTOCOL,)
    # Each finance connection registers its own instance; fsspec must not hand out a cached one.
    cachable = False

    def __init__(self, *roots: Path) -> None:
        super().__init__()
        self.roots = [Path(os.path.realpath(root)) for root in roots]
        self._local = LocalFileSystem()
        self._published: dict[str, PublishedFile] = {}

    def verify_published(self, data_dir: Path, files: Mapping[str, PublishedFile]) -> None:
        """From now on, serve the data files `files` (by path relative to `data_dir`) only
        while their sha256 is the one they were published with."""
        real = os.path.realpath(data_dir)
        self._published = {os.path.join(real, path): file for path, file in files.items()}

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
        entries: list[Any] = self._local.ls(self._inside(path), detail=detail)
        return entries

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        info: dict[str, Any] = self._local.info(self._inside(path))
        return info

    def modified(self, path: str) -> Any:
        return self._local.modified(self._inside(path))

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if mode != "rb":
            raise ReadOnlyFileRefused(f"{path}: read-only here")
        local = self._inside(path)
        published = self._published.get(local)
        if published is not None:
            version = os.stat(local)
            found = cached_sha256(local, version.st_size, version.st_mtime_ns)
            if found != published.sha256:
                raise PublishedFileChanged(published.changed(Path(local), found))
        return self._local._open(local, mode="rb")

    def _refuse(self, path: Any, *args: Any, **kwargs: Any) -> None:
        raise ReadOnlyFileRefused(f"{path}: read-only here")

    mkdir = makedirs = rmdir = cp_file = _rm = rm = mv = _refuse
