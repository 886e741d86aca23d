"""`stepledger price`: JSON output, the table, the sweep figure and error exits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main

GOLDEN_ARGS = [
    "price",
    "--model",
    "deepseek-v3",
    "--gpu",
    "h200",
    "--tp",
    "8",
    "--dtype",
    "fp8",
    "--cache-dtype",
    "fp8",
    "--cudagraph",
    "PIECEWISE",
    "--decode-threshold",
    "8",
    "--compat",
    "go",
    "--context",
    "4096",
]


def test_json_reproduces_the_golden_step_at_32_requests():
    result = CliRunner().invoke(main, [*GOLDEN_ARGS, "--decode", "32", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    got = [
        payload[k]
        for k in ("sm_ms", "hbm_ms", "nvlink_ms", "nic_ms", "host_ms", "overlap_ms", "nooverlap_ms")
    ]
    assert got == pytest.approx([4.465, 16.507, 1.111, 0.0, 3.544, 24.115, 25.627], abs=0.001)
    assert payload["bottleneck"] == "hbm"
    assert payload["batch"] == {"decode_requests": 32, "context_tokens": 4096, "prefill_tokens": []}
    assert payload["per_kind_us"]["attn_moe"]["repeat"] == 58


def test_table_names_the_bottleneck():
    result = CliRunner().invoke(main, [*GOLDEN_ARGS, "--decode", "1"])
    assert result.exit_code == 0, result.output
    assert "host" in result.output
    assert "<- bottleneck" in result.output
    host_line = next(line for line in result.output.splitlines() if "<- bottleneck" in line)
    assert "host" in host_line
    assert "3.544" in host_line


def test_prefill_requests_join_the_batch():
    args = [
        "price",
        "--model",
        "llama-3.1-8b-instruct",
        "--gpu",
        "h100",
        "--decode",
        "4",
        "--context",
        "1000",
        "--prefill",
        "512",
        "--prefill",
        "128",
        "--json",
    ]
    payload = json.loads(CliRunner().invoke(main, args).output)
    assert payload["batch"]["prefill_tokens"] == [512, 128]
    assert payload["bottleneck"] in {"sm", "hbm"}


def test_sweep_writes_a_png(tmp_path: Path):
    out = tmp_path / "sweep.png"
    result = CliRunner().invoke(main, [*GOLDEN_ARGS, "--sweep", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bottleneck: host 1-2, sm 3-3, hbm 4-256" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "nope", "--gpu", "h100", "--decode", "1"], "unknown model 'nope'"),
        (["--model", "llama-3.1-8b-instruct", "--gpu", "x9", "--decode", "1"], "unknown chip 'x9'"),
        (
            ["--model", "llama-3.1-8b-instruct", "--gpu", "h100", "--tp", "6", "--decode", "1"],
            "group of 6 GPUs",
        ),
        (
            ["--model", "llama-3.1-8b-instruct", "--gpu", "h100", "--decode", "-3"],
            "--decode is negative (-3)",
        ),
        (
            ["--model", "llama-3.1-8b-instruct", "--gpu", "h100", "--prefill", "0"],
            "--prefill needs a positive",
        ),
        (
            ["--model", "llama-3.1-8b-instruct", "--gpu", "h100", "--tp", "0"],
            "tp: Input should be greater than 0",
        ),
        (["--model", "llama-3.1-8b-instruct", "--gpu", "h100", "--sweep"], "--sweep needs --out"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(args, message):
    result = CliRunner().invoke(main, ["price", *args])
    assert result.exit_code == 2
    assert message in result.output
