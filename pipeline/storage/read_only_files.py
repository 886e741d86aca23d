"""The warehouse's data files as a file system that can only read, for finance's connections.

DuckDB has no read-only file access: `allowed_directories` lets a connection whose external
access is off read *and write* there, so a reader allowed the lake's data directory could
overwrite a published Parquet file with `COPY ... TO`. A finance connection therefore reaches
the data files (and the Parquet lake beside the warehouse) only through this file system,
registered under its own protocol with the DuckLake's data path pointing into it, and has
DuckDB's local file system disabled. It opens files for reading and lists directories, inside
the directories it was given only; anything else (opening to write, removing, moving, copying,
creating directories) is refused.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

PROTOCOL = "ledgerfiles"


class ReadOnlyFileRefused(PermissionError):
    """A finance connection tried to change a file, or to read outside its directories."""


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

    def url(self, root: Path) -> str:
        """A directory `root` (one of `roots`, or below one) as a URL of this file system, with
        a trailing slash."""
        return f"{PROTOCOL}://{self._inside(str(root))}/"

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
        return self._local._open(self._inside(path), mode="rb")

    def _refuse(self, path: Any, *args: Any, **kwargs: Any) -> None:
        raise ReadOnlyFileRefused(f"{path}: read-only here")

    mkdir = makedirs = rmdir = cp_file = _rm = rm = mv = _refuse
