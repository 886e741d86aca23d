"""Where the warehouse's data files are: the directory `<warehouse>/data/` (the default), or a
prefix on an object store, and how the pipeline and finance reach them there.

On a store, DuckLake writes its data files through DuckDB's httpfs extension (the
`duckdb-extension-httpfs` package, loaded from the virtualenv like the others), with the
writer's keys from the environment given to DuckDB as a temporary secret: in the connection's
memory only, never in a file, a log, the run's configuration or the catalog (which records
the data path and each file's path below it, never a key). Finance's connections never load
httpfs: they read the files through `ReadOnlyFiles` over a pyarrow S3 client of their own,
with reader keys of their own (an identity the store lets get and list objects only).

    STEPLEDGER_WAREHOUSE_DATA            s3://bucket/prefix: put a new warehouse's data files
                                         there (a warehouse keeps where it was created)
    AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN
                                         the writer's keys (the pipeline's processes)
    STEPLEDGER_READER_ACCESS_KEY_ID, STEPLEDGER_READER_SECRET_ACCESS_KEY,
    STEPLEDGER_READER_SESSION_TOKEN      the reader's keys (finance's processes)
    AWS_ENDPOINT_URL, AWS_REGION         a store other than AWS's, its region

A warehouse whose data files are on a store holds DATA_POINTER, naming where (no key): every
process opening it finds its files there, whatever its own environment says.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from schemas.errors import ConfigError

WAREHOUSE_DATA_VARIABLE = "STEPLEDGER_WAREHOUSE_DATA"
READER_ACCESS_KEY = "STEPLEDGER_READER_ACCESS_KEY_ID"
READER_SECRET_KEY = "STEPLEDGER_READER_SECRET_ACCESS_KEY"
READER_SESSION_TOKEN = "STEPLEDGER_READER_SESSION_TOKEN"
DATA_POINTER = "data_path.json"
DATA_FILES_DIR = "data"
HASH_CHUNK_BYTES = 1 << 20
MISSING = "(file missing)"


@dataclass(frozen=True)
class DataFiles:
    """A warehouse's data files: `root` on `filesystem` (an absolute local directory, or
    `bucket/prefix` on a store), which DuckLake names `uri` (the directory, or
    `s3://bucket/prefix`)."""

    filesystem: pafs.FileSystem
    root: str
    uri: str

    @classmethod
    def local(cls, directory: Path) -> DataFiles:
        return cls(pafs.LocalFileSystem(), str(directory), str(directory))

    @property
    def on_store(self) -> bool:
        return not isinstance(self.filesystem, pafs.LocalFileSystem)

    def path(self, relative: str) -> str:
        """The file `relative` (to the data path) as the file system names it."""
        return (
            posixpath.join(self.root, relative)
            if self.on_store
            else str(Path(self.root) / relative)
        )

    def where(self, relative: str) -> str:
        """The file `relative` as a message names it: its local path or its URI."""
        return f"{self.uri}/{relative}" if self.on_store else self.path(relative)

    def relative_of(self, filename: str) -> str | None:
        """The path below the data path of a file DuckLake names `filename`; None for a file
        elsewhere."""
        base = self.uri.rstrip("/") + "/"
        if self.on_store:
            return filename.removeprefix(base) if filename.startswith(base) else None
        path = Path(filename)
        if path.is_absolute() and path.is_relative_to(self.root):
            return str(path.relative_to(self.root))
        return None

    def sha256(self, relative: str) -> str:
        """The sha256 of the bytes of the file `relative` now; MISSING when there is none."""
        digest = hashlib.sha256()
        try:
            with self.filesystem.open_input_stream(self.path(relative)) as stream:
                while chunk := stream.read(HASH_CHUNK_BYTES):
                    digest.update(chunk)
        except FileNotFoundError:
            return MISSING
        return digest.hexdigest()


def _store_parts(uri: str, variable: str) -> tuple[str, str]:
    """The bucket and prefix of `uri` (`s3://bucket/prefix`), refused if it carries a key."""
    parts = urlsplit(uri)
    if parts.scheme != "s3" or not parts.netloc:
        raise ConfigError(f"{variable}={uri}: give the store as s3://bucket/prefix")
    if parts.username or parts.password or parts.query:
        raise ConfigError(
            f"{variable}: the URI carries credentials or options; give them only through the "
            "environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) or the instance role"
        )
    return parts.netloc, parts.path.strip("/")


def store_data_files(uri: str, filesystem: pafs.FileSystem) -> DataFiles:
    bucket, prefix = _store_parts(uri, WAREHOUSE_DATA_VARIABLE)
    root = posixpath.join(bucket, prefix) if prefix else bucket
    return DataFiles(filesystem, root, f"s3://{root}")


def _client(access_key: str | None, secret_key: str | None, token: str | None) -> pafs.FileSystem:
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or None
    return pafs.S3FileSystem(
        access_key=access_key,
        secret_key=secret_key,
        session_token=token,
        endpoint_override=endpoint,
        region=os.environ.get("AWS_REGION") or None,
    )


def recorded_store(warehouse: Path) -> str | None:
    """The store URI of the warehouse's data files (its DATA_POINTER); None when they are in
    its directory."""
    pointer = warehouse / DATA_POINTER
    if not pointer.is_file():
        return None
    uri: str = json.loads(pointer.read_text())["data_path"]
    return uri


def data_files_at(path: str) -> DataFiles:
    """The data files at DuckLake's data path `path` (a directory, or `s3://...` reached with
    the writer's credentials: the environment's, or the instance role's)."""
    if path.startswith("s3://"):
        return store_data_files(path.rstrip("/"), _client(None, None, None))
    return DataFiles.local(Path(path))


def writer_data_files(warehouse: Path, existing: bool) -> DataFiles:
    """Where the pipeline writes the warehouse's data files: where they are (an `existing`
    warehouse keeps its place), or for a new warehouse STEPLEDGER_WAREHOUSE_DATA's store,
    recorded in DATA_POINTER, else its directory. A variable naming another place than the
    warehouse's own is refused: its files would not be found."""
    recorded = recorded_store(warehouse)
    wanted = os.environ.get(WAREHOUSE_DATA_VARIABLE, "").rstrip("/") or None
    if recorded is None and wanted is not None and not existing:
        _store_parts(wanted, WAREHOUSE_DATA_VARIABLE)
        warehouse.mkdir(parents=True, exist_ok=True)
        (warehouse / DATA_POINTER).write_text(json.dumps({"data_path": wanted}, indent=2))
        recorded = wanted
    if wanted is not None and wanted != recorded:
        raise ConfigError(
            f"{WAREHOUSE_DATA_VARIABLE}={wanted}, but the warehouse {warehouse} keeps its data "
            f"files in {recorded or warehouse / DATA_FILES_DIR}: unset it, or give a new warehouse"
        )
    return data_files_at(recorded or str(warehouse / DATA_FILES_DIR))


def reader_data_files(warehouse: Path, environ: Mapping[str, str] | None = None) -> DataFiles:
    """Where finance reads the warehouse's data files: its directory, or its store through a
    client holding the reader's keys only (never the writer's)."""
    recorded = recorded_store(warehouse)
    if recorded is None:
        return DataFiles.local(warehouse / DATA_FILES_DIR)
    env = os.environ if environ is None else environ
    if not env.get(READER_ACCESS_KEY) or not env.get(READER_SECRET_KEY):
        raise ConfigError(
            f"{warehouse}: its data files are on {recorded}; finance reads them with reader "
            f"keys of its own: set {READER_ACCESS_KEY} and {READER_SECRET_KEY} (an identity "
            "the store lets get and list objects only)"
        )
    client = _client(env[READER_ACCESS_KEY], env[READER_SECRET_KEY], env.get(READER_SESSION_TOKEN))
    return store_data_files(recorded, client)


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def writer_secret_sql(name: str) -> str:
    """CREATE TEMPORARY SECRET giving DuckDB's httpfs the writer's keys from the environment.
    The statement holds the keys: run it, never log or show it."""
    missing = [v for v in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY") if not os.environ.get(v)]
    if missing:
        raise ConfigError(
            f"the warehouse's data files are on a store: the pipeline writes them with the "
            f"keys of {' and '.join(missing)}, which are not set"
        )
    fields = {
        "KEY_ID": os.environ["AWS_ACCESS_KEY_ID"],
        "SECRET": os.environ["AWS_SECRET_ACCESS_KEY"],
        "REGION": os.environ.get("AWS_REGION") or "us-east-1",
    }
    if os.environ.get("AWS_SESSION_TOKEN"):
        fields["SESSION_TOKEN"] = os.environ["AWS_SESSION_TOKEN"]
    listed = [f"{key} {_quoted(value)}" for key, value in fields.items()]
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        parts = urlsplit(endpoint)
        listed += [
            f"ENDPOINT {_quoted(parts.netloc)}",
            "URL_STYLE 'path'",
            f"USE_SSL {'true' if parts.scheme == 'https' else 'false'}",
        ]
    return f"CREATE TEMPORARY SECRET {name} (TYPE s3, {', '.join(listed)})"
