"""An error a user can fix ends `stepledger` with its kind's exit code and one line on stderr
naming the file, record or field; a bug ends it with its traceback and exit code 70. The
codes are the table in docs/getting-started.md."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from assets.cli import main
from pipeline.cli import COMMANDS, command_line
from schemas.config import DEFAULT_POOLS_PATH
from schemas.errors import (
    ConfigError,
    DataError,
    ExternalError,
    InputError,
    StateError,
    StepledgerError,
)

ROOT = Path(__file__).resolve().parents[3]


def stepledger(*args: str):
    return CliRunner().invoke(main, list(args))


def assert_one_line_error(result, code: int, message: str) -> None:
    assert result.exit_code == code
    assert result.stderr == f"Error: {message}\n"
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", ["run", "report"])
def test_a_pools_file_with_a_typo_is_a_config_error(tmp_path: Path, command: str) -> None:
    # An hour for `run` to bill, so that it reads the pools.
    (tmp_path / "gateway").mkdir()
    (tmp_path / "gateway" / "2026-11-30T00.jsonl").touch()
    pools = tmp_path / "pools.yaml"
    pools.write_text(
        DEFAULT_POOLS_PATH.read_text().replace("usd_per_gpu_hour", "usd_per_gpu_hr", 1)
    )
    # A missing field is reported at the line of the mapping that lacks it: the first pool.
    line = pools.read_text().splitlines().index("  - name: chat-8b") + 1
    result = stepledger(command, "--data", str(tmp_path))
    assert_one_line_error(
        result,
        4,
        f"{pools}:{line}: field pools.0.usd_per_gpu_hour: Field required (and 1 more)",
    )


def test_a_missing_input_file_is_an_input_error(tmp_path: Path) -> None:
    missing = tmp_path / "step.json"
    result = stepledger("explain-step", str(missing))
    assert_one_line_error(result, 3, f"{missing}: cannot read: No such file or directory")


def test_a_damaged_calibration_store_is_a_data_error(tmp_path: Path) -> None:
    (tmp_path / "a.seg").write_bytes(b"not a segment")
    store = tmp_path / "store.yaml"
    store.write_text("entries: 7\n")
    result = stepledger("calibrate", "--data", str(tmp_path), "--store", str(store))
    assert_one_line_error(result, 5, f"{store}: expected a mapping with an 'entries' list")


def test_costs_before_any_billing_is_a_state_error(tmp_path: Path) -> None:
    result = stepledger("costs", "--data", str(tmp_path))
    catalog = tmp_path.resolve() / "warehouse" / "catalog.sqlite"
    assert_one_line_error(
        result, 6, f"{catalog}: no warehouse (run `stepledger demo` or `stepledger run` first)"
    )


# Raised by a command registered as the test's own, through the same command line.
RAISED: dict[str, BaseException] = {
    "input": InputError("step.json: step 3: field tokens: not an integer"),
    "config": ConfigError("pools.yaml:7: field pools.0.gpu_type: unknown chip"),
    "data": DataError("outbox/r0/7.seg: frame 12: checksum mismatch"),
    "state": StateError("DATA/warehouse: schema version [1], this stepledger reads version 3"),
    "external": ExternalError("alert sink https://hooks.example: refused for 20 minutes"),
    "bug": KeyError("slots"),
}


@click.command("fail")
@click.argument("kind")
def fail_command(kind: str) -> None:
    raise RAISED[kind]


def stepledger_with_fail(*args: str):
    group = command_line({**COMMANDS, "fail": f"{__name__}:fail_command"})
    return CliRunner().invoke(group, list(args))


@pytest.mark.parametrize(
    ("kind", "code"), [("input", 3), ("config", 4), ("data", 5), ("state", 6), ("external", 7)]
)
def test_each_kind_has_its_exit_code_and_one_line(kind: str, code: int) -> None:
    result = stepledger_with_fail("fail", kind)
    assert_one_line_error(result, code, str(RAISED[kind]))


def test_a_bug_shows_its_traceback_and_exits_70() -> None:
    result = stepledger_with_fail("fail", "bug")
    assert result.exit_code == 70
    assert re.search(
        r"Traceback \(most recent call last\):\n.*KeyError: 'slots'\n", result.stderr, re.S
    )
    assert result.stderr.endswith(
        "Error: this is a bug in stepledger (the traceback above); please report it\n"
    )


def test_debug_lets_a_users_error_raise_with_its_traceback() -> None:
    result = stepledger_with_fail("--debug", "fail", "data")
    assert result.exception is RAISED["data"]
    assert isinstance(result.exception, StepledgerError)


def test_the_documented_exit_codes_are_those_the_command_line_uses() -> None:
    doc = (ROOT / "docs" / "getting-started.md").read_text()
    documented = dict(re.findall(r"^\| (\d+) \| `?(\w+)`? \|", doc, re.M))
    assert documented == {
        "0": "success",
        "1": "failure",
        "2": "usage",
        "3": "InputError",
        "4": "ConfigError",
        "5": "DataError",
        "6": "StateError",
        "7": "ExternalError",
        "70": "bug",
    }
