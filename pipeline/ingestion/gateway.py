"""Gateway request context (tenant, feature, API key) into the warehouse `request_context` table.

The gateway writes one JSON object per request per line into `gateway/<YYYY-MM-DDTHH>.jsonl`.
API keys never reach the warehouse: each is replaced by a keyed hash (HMAC-SHA256 under the
salt in `STEPLEDGER_KEY_SALT`), which identifies a key across hours without revealing it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import duckdb
import polars as pl
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError

from pipeline.storage.warehouse import insert_frame, query_frame, transaction
from schemas.errors import DataError
from schemas.units import hour_key, instant_to_warehouse, utc_hour, warehouse_now

KEY_SALT_ENV = "STEPLEDGER_KEY_SALT"
# Used when STEPLEDGER_KEY_SALT is unset, so the demo runs out of the box. Anyone who knows it
# can test guessed keys against api_key_id: production must set its own secret salt.
DEMO_KEY_SALT = "stepledger-demo-key-salt"


class ContextError(DataError):
    """A gateway file is unreadable or malformed; the message names file, line and field."""


class _GatewayLine(BaseModel):
    # Unknown fields are ignored: the gateway may log more than stepledger needs. A line holds
    # a raw API key: a validation error must not echo the line into a log or an event.
    model_config = ConfigDict(extra="ignore", strict=False, hide_input_in_errors=True)

    request_id: str = Field(min_length=1)
    tenant: str = Field(min_length=1)
    feature: str = Field(min_length=1)
    api_key: str = Field(min_length=1)
    retry_of: str | None = None
    retry_cause: Literal["client_timeout", "platform_timeout"] | None = None
    received_at: AwareDatetime


@dataclass(frozen=True)
class LoadReport:
    loaded: list[Path]  # files (re)loaded into request_context
    unchanged: list[Path]  # files already loaded with identical content
    requests: int  # rows written by this call


def file_key(path: Path) -> str:
    """How a gateway file is known in the warehouse: `gateway/<name>`, relative to the data
    directory, so a data directory moved or restored from a backup is the same data."""
    return f"{path.parent.name}/{path.name}"


def key_salt() -> bytes:
    return os.environ.get(KEY_SALT_ENV, DEMO_KEY_SALT).encode()


def api_key_id(api_key: str, salt: bytes) -> str:
    """The stored identity of an API key: 'key-' + the first 128 bits of HMAC-SHA256, in hex."""
    return "key-" + hmac.new(salt, api_key.encode(), hashlib.sha256).hexdigest()[:32]


def _parse_line(line: str) -> _GatewayLine:
    try:
        return _GatewayLine.model_validate_json(line)
    except ValidationError as err:
        if err.errors()[0]["type"] != "json_invalid":
            raise
        strict_error = err
    # RFC 8259 forbids raw control characters (\x1c, a tab) inside strings, yet some gateways
    # write them: read such a line rather than refuse the hour's context. The lenient parser
    # runs only after the strict one failed, as it is half as fast.
    try:
        loose = json.loads(line, strict=False)
    except json.JSONDecodeError:
        raise strict_error from None
    return _GatewayLine.model_validate(loose)


def read_gateway_file(path: Path, salt: bytes) -> pl.DataFrame:
    """Validate a gateway file and return request_context rows (API keys hashed)."""
    try:
        # Bytes decoded as they are: read_text would also translate a lone "\r" into a line end.
        text = path.read_bytes().decode("utf-8")
    except OSError as err:
        raise ContextError(f"{path}: cannot read gateway file: {err.strerror}") from err
    except UnicodeDecodeError as err:
        raise ContextError(f"{path}: not UTF-8 text: {err}") from err
    columns: dict[str, list[Any]] = {name: [] for name in _GatewayLine.model_fields}
    first_line_of: dict[str, int] = {}
    # Lines end at "\n" only: str.splitlines also breaks at U+2028, U+0085 and \x1c-\x1e,
    # which gateways write raw inside JSON strings.
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        try:
            record = _parse_line(line)
        except ValidationError as err:
            first = err.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "(line)"
            raise ContextError(f"{path}:{number}: field {field}: {first['msg']}") from err
        if record.request_id in first_line_of:
            raise ContextError(
                f"{path}:{number}: field request_id: {record.request_id!r} repeats line "
                f"{first_line_of[record.request_id]}"
            )
        first_line_of[record.request_id] = number
        for name in columns:
            columns[name].append(getattr(record, name))
    received = [instant_to_warehouse(t) for t in columns["received_at"]]
    hashed = {key: api_key_id(key, salt) for key in set(columns["api_key"])}
    return pl.DataFrame(
        {
            "request_id": columns["request_id"],
            "tenant": columns["tenant"],
            "feature": columns["feature"],
            "api_key_id": [hashed[key] for key in columns["api_key"]],
            "retry_of": columns["retry_of"],
            "retry_cause": columns["retry_cause"],
            "received_at": received,
            "source_file": [file_key(path)] * len(received),
        },
        schema={
            "request_id": pl.String,
            "tenant": pl.String,
            "feature": pl.String,
            "api_key_id": pl.String,
            "retry_of": pl.String,
            "retry_cause": pl.String,
            "received_at": pl.Datetime("us"),
            "source_file": pl.String,
        },
    )


def gateway_files_for_hour(gateway_dir: Path, hour: datetime) -> list[Path]:
    """The gateway files that may hold context of requests running in `hour`: that hour's and
    the previous hour's (a request received at 04:59 still decodes at 05:00)."""
    hour = utc_hour(hour)
    names = [f"{hour_key(hour - timedelta(hours=1))}.jsonl", f"{hour_key(hour)}.jsonl"]
    return [gateway_dir / name for name in names if (gateway_dir / name).is_file()]


def load_gateway_files(
    con: duckdb.DuckDBPyConnection, paths: list[Path], salt: bytes
) -> LoadReport:
    """Load gateway files into request_context, replacing each file's earlier rows exactly.

    A file whose content hash is already recorded is skipped, so loading is idempotent and
    cheap to repeat for every pool of an hour.
    """
    loaded: list[Path] = []
    unchanged: list[Path] = []
    written = 0
    for path in paths:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        known = con.execute(
            "SELECT sha256 FROM context_files WHERE path = ?", [file_key(path)]
        ).fetchone()
        if known is not None and known[0] == digest:
            unchanged.append(path)
            continue
        rows = read_gateway_file(path, salt)
        with transaction(con):
            con.execute("DELETE FROM request_context WHERE source_file = ?", [file_key(path)])
            incoming_ids = rows.select("request_id").to_arrow()  # noqa: F841 (scanned by name)
            clash = con.execute(
                "SELECT c.request_id, c.source_file FROM request_context c JOIN incoming_ids USING (request_id) LIMIT 1"
            ).fetchone()
            if clash is not None:
                raise ContextError(
                    f"{path}: field request_id: {clash[0]!r} was already logged in {clash[1]}"
                )
            insert_frame(con, "request_context", rows)
            con.execute(
                "INSERT OR REPLACE INTO context_files VALUES (?, ?, ?, ?)",
                [file_key(path), digest, rows.height, warehouse_now()],
            )
        loaded.append(path)
        written += rows.height
    return LoadReport(loaded=loaded, unchanged=unchanged, requests=written)


CONTEXT_COLUMNS = ("request_id", "tenant", "feature", "api_key_id", "retry_of", "retry_cause")


def context_for_requests(con: duckdb.DuckDBPyConnection, request_ids: pl.Series) -> pl.DataFrame:
    """request_context rows of the given requests (requests without context are absent)."""
    columns = ", ".join(f"c.{name}" for name in CONTEXT_COLUMNS)
    # Joined as an Arrow table: a busy hour has a few hundred thousand ids, which a Python list
    # parameter would build and DuckDB unnest one object at a time.
    wanted = request_ids.unique().cast(pl.String).rename("request_id").to_frame().to_arrow()
    con.register("wanted_requests", wanted)
    try:
        return query_frame(
            con,
            f"SELECT {columns} FROM request_context c JOIN wanted_requests USING (request_id) "
            "ORDER BY c.request_id",
        )
    finally:
        con.unregister("wanted_requests")
