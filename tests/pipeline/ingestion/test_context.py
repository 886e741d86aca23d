from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.ingestion.gateway import (
    DEMO_KEY_SALT,
    ContextError,
    api_key_id,
    context_for_requests,
    gateway_files_for_hour,
    key_salt,
    load_gateway_files,
    read_gateway_file,
)
from pipeline.storage.warehouse import connect

SALT = b"test-salt"


def line(request_id: str, api_key: str = "sk-acme-01", **overrides) -> str:
    record = {
        "request_id": request_id,
        "tenant": "acme",
        "feature": "bot",
        "api_key": api_key,
        "retry_of": None,
        "retry_cause": None,
        "received_at": "2026-11-30T05:12:01.123456Z",
    }
    record.update(overrides)
    return json.dumps(record)


def write(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_api_keys_are_stored_only_as_keyed_hashes(tmp_path: Path) -> None:
    path = write(
        tmp_path / "2026-11-30T05.jsonl",
        [line("r1", "sk-secret-1"), line("r2", "sk-secret-1"), line("r3", "sk-other")],
    )
    with connect(tmp_path / "w.duckdb") as con:
        load_gateway_files(con, [path], SALT)
        stored = con.sql(
            "SELECT request_id, api_key_id FROM request_context ORDER BY request_id"
        ).fetchall()
    assert stored[0][1] == stored[1][1] != stored[2][1]
    assert (
        stored[0][1]
        == api_key_id("sk-secret-1", SALT)
        == "key-" + __import__("hmac").new(SALT, b"sk-secret-1", "sha256").hexdigest()[:32]
    )
    assert b"sk-secret" not in (tmp_path / "w.duckdb").read_bytes()
    assert api_key_id("sk-secret-1", b"another-salt") != stored[0][1]


def test_salt_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEPLEDGER_KEY_SALT", raising=False)
    assert key_salt() == DEMO_KEY_SALT.encode()
    monkeypatch.setenv("STEPLEDGER_KEY_SALT", "prod-secret")
    assert key_salt() == b"prod-secret"


def test_rows_keep_retry_and_time(tmp_path: Path) -> None:
    path = write(
        tmp_path / "g.jsonl",
        [
            line("r1"),
            "",
            line(
                "r2",
                retry_of="r1",
                retry_cause="platform_timeout",
                received_at="2026-11-30T07:00:00+02:00",
            ),
        ],
    )
    rows = read_gateway_file(path, SALT)
    assert rows.select("request_id", "retry_of", "retry_cause", "received_at").rows() == [
        ("r1", None, None, datetime(2026, 11, 30, 5, 12, 1, 123456)),
        ("r2", "r1", "platform_timeout", datetime(2026, 11, 30, 5, 0)),
    ]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", r"g.jsonl:2: field \(line\)"),
        (line("r2", tenant=""), "g.jsonl:2: field tenant"),
        (line("r2", retry_cause="gremlins"), "g.jsonl:2: field retry_cause"),
        (line("r2", received_at="2026-11-30T05:00:00"), "g.jsonl:2: field received_at"),
        (
            json.dumps(
                {
                    "request_id": "r2",
                    "tenant": "a",
                    "feature": "f",
                    "received_at": "2026-11-30T05:00:00Z",
                }
            ),
            "g.jsonl:2: field api_key",
        ),
        (line("r1"), "g.jsonl:2: field request_id: 'r1' repeats line 1"),
    ],
)
def test_malformed_lines_name_file_line_and_field(tmp_path: Path, bad: str, message: str) -> None:
    path = write(tmp_path / "g.jsonl", [line("r1"), bad])
    with pytest.raises(ContextError, match=message):
        read_gateway_file(path, SALT)


def test_line_numbers_count_newlines_only(tmp_path: Path) -> None:
    # U+2028, U+0085 and a raw \x1e inside strings, and Windows line ends, are no line breaks.
    path = tmp_path / "g.jsonl"
    lines = [
        line("r1", tenant="acme\u2028emea"),
        line("r2", feature="a\x85b"),
        line("r3", tenant="x\x1ey"),
    ]
    # json.dumps escapes control characters whatever ensure_ascii says: unescape \x1e by hand.
    raw = [
        json.dumps(json.loads(text), ensure_ascii=False).replace("\\u001e", "\x1e")
        for text in lines
    ]
    path.write_bytes(("\r\n".join(raw) + "\r\n").encode())
    assert path.read_bytes().count(b"\x1e") == 1
    rows = read_gateway_file(path, SALT)
    assert rows.select("request_id", "tenant", "feature").rows() == [
        ("r1", "acme\u2028emea", "bot"),
        ("r2", "acme", "a\x85b"),
        ("r3", "x\x1ey", "bot"),
    ]
    path.write_bytes(path.read_bytes() + b"{not json\r\n")
    with pytest.raises(
        ContextError,
        match=r"g.jsonl:4: field \(line\): Invalid JSON: key must be a string at line 1 column 2",
    ):
        read_gateway_file(path, SALT)


def test_loading_is_idempotent_and_replaces_a_changed_file(tmp_path: Path) -> None:
    path = write(tmp_path / "2026-11-30T05.jsonl", [line("r1"), line("r2")])
    with connect(tmp_path / "w.duckdb") as con:
        first = load_gateway_files(con, [path], SALT)
        again = load_gateway_files(con, [path], SALT)
        assert (first.requests, again.requests, again.unchanged) == (2, 0, [path])
        write(path, [line("r1", tenant="globex"), line("r3")])
        changed = load_gateway_files(con, [path], SALT)
        assert changed.loaded == [path]
        rows = con.sql(
            "SELECT request_id, tenant FROM request_context ORDER BY request_id"
        ).fetchall()
    assert rows == [("r1", "globex"), ("r3", "acme")]


def test_a_request_logged_in_two_files_is_refused(tmp_path: Path) -> None:
    first = write(tmp_path / "2026-11-30T04.jsonl", [line("r1")])
    second = write(tmp_path / "2026-11-30T05.jsonl", [line("r2"), line("r1")])
    with connect(tmp_path / "w.duckdb") as con:
        load_gateway_files(con, [first], SALT)
        with pytest.raises(
            ContextError, match="2026-11-30T05.jsonl: field request_id: 'r1' was already logged in"
        ):
            load_gateway_files(con, [second], SALT)
        assert con.execute("SELECT count(*) FROM request_context").fetchone() == (1,)


def test_context_for_requests_and_hour_files(tmp_path: Path) -> None:
    gateway = tmp_path / "gateway"
    write(gateway / "2026-11-30T04.jsonl", [line("early")])
    write(gateway / "2026-11-30T05.jsonl", [line("r1", tenant="globex", feature="search")])
    write(gateway / "2026-11-30T07.jsonl", [line("late")])
    files = gateway_files_for_hour(gateway, datetime(2026, 11, 30, 5, tzinfo=UTC))
    assert [f.name for f in files] == ["2026-11-30T04.jsonl", "2026-11-30T05.jsonl"]
    with connect(tmp_path / "w.duckdb") as con:
        load_gateway_files(con, files, SALT)
        found = context_for_requests(con, pl.Series(["r1", "r1", "missing", "early"]))
    assert found.columns == [
        "request_id",
        "tenant",
        "feature",
        "api_key_id",
        "retry_of",
        "retry_cause",
    ]
    assert found.select("request_id", "tenant", "feature").rows() == [
        ("early", "acme", "bot"),
        ("r1", "globex", "search"),
    ]


@settings(max_examples=30, deadline=None)
@given(st.text(min_size=1, max_size=40), st.text(min_size=1, max_size=40))
def test_distinct_keys_get_distinct_ids(first: str, second: str) -> None:
    assert (api_key_id(first, SALT) == api_key_id(second, SALT)) == (first == second)
