from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType

import dagster as dg
import pytest
import yaml
from click.testing import CliRunner

from assets.cli import main
from assets.cli.demo import DEMO_MARKER, prepare_out_dir
from pipeline import finance
from pipeline.simulator.faults import ENGINE_VERSION
from schemas.config import load_pools
from tests.helpers.fleets import small_pools

ROOT = Path(__file__).resolve().parents[2]


def test_run_then_costs_without_sql(
    simulated: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    data = tmp_path / "run"
    shutil.copytree(simulated, data)
    runner = CliRunner()
    ran = runner.invoke(main, ["run", "--data", str(data), "--hour", "2026-11-30T00"])
    assert ran.exit_code == 0, ran.output
    assert "2026-11-30T00 chat-8b: published" in ran.output
    rerun = runner.invoke(main, ["run", "--data", str(data), "--hour", "2026-11-30T00", "--json"])
    assert rerun.exit_code == 0, rerun.output
    runs = json.loads(rerun.stdout)
    assert [(r["hour"], r["pool"], r["success"], r["error"]) for r in runs] == [
        ("2026-11-30T00", pool.name, True, None) for pool in small_pools().pools
    ]
    # The short fixture hour warns (plausibility, calibration) without holding the hour back.
    assert all(isinstance(r["failed_checks"], list) for r in runs)
    # Both runs are in the data directory's instance, the one `stepledger dev` shows.
    with dg.DagsterInstance.from_config(str(data / "dagster")) as instance:
        recorded = [r.dagster_run for r in instance.get_run_records()]
    assert [(r.job_name, r.tags["dagster/partition"], r.status) for r in recorded] == [
        ("pool_hour_job", "2026-11-30-00:00|chat-8b", dg.DagsterRunStatus.SUCCESS)
    ] * 2
    report = json.loads(
        runner.invoke(main, ["costs", "--data", str(data), "--by", "feature", "--json"]).output
    )
    assert (
        sum(row["amount_nano"] for row in report["costs"])
        == 2 * small_pools().pool("chat-8b").nano_per_gpu_hour
    )
    assert report["held_back"] == []
    daily = json.loads(
        runner.invoke(main, ["costs", "--data", str(data), "--by", "day", "--json"]).output
    )
    assert {row["day"] for row in daily["costs"]} == {"2026-11-30"}
    table = runner.invoke(main, ["costs", "--data", str(data)])
    assert table.exit_code == 0
    assert "costs by tenant" in table.output


def test_run_names_the_file_line_and_field_that_failed(
    simulated: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the table and in --json, a failed step shows the error naming the file, line and
    field, not Dagster's wrapper nor the parser's error beneath it; pages printed by the
    default sink leave --json's standard output to the JSON."""
    monkeypatch.setenv("COLUMNS", "1000")
    for name in ("STEPLEDGER_ALERT_WEBHOOK_URL", "STEPLEDGER_ALERT_FILE"):
        monkeypatch.delenv(name, raising=False)
    data = tmp_path / "run"
    shutil.copytree(simulated, data)
    gateway = data / "gateway" / "2026-11-30T00.jsonl"
    number = len(gateway.read_text().splitlines()) + 1
    with gateway.open("a") as lines:
        lines.write('{"request_id": "r-1", "tenant": 5\n')
    cause = (
        f"pipeline.ingestion.gateway.ContextError: {gateway}:{number}: field (line): Invalid JSON"
    )
    table = CliRunner().invoke(main, ["run", "--data", str(data)])
    assert table.exit_code == 1
    assert f"2026-11-30T00 chat-8b: failed: {cause}" in table.stdout
    as_json = CliRunner().invoke(main, ["run", "--data", str(data), "--json"])
    assert as_json.exit_code == 1
    (run,) = json.loads(as_json.stdout)
    assert run["error"].startswith(cause)
    assert json.loads(as_json.stderr.splitlines()[0])["kind"] == "run_failed"


def test_run_refuses_a_misconfigured_alert_sink_before_billing(
    simulated: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STEPLEDGER_ALERT_FORMAT", "email")
    data = tmp_path / "run"
    shutil.copytree(simulated, data)
    result = CliRunner().invoke(main, ["run", "--data", str(data)])
    assert result.exit_code == 1
    assert "alert sink: STEPLEDGER_ALERT_FORMAT='email' is not one of pagerduty" in result.output
    assert not (data / "lake").exists()


def test_run_rejects_a_malformed_hour(simulated: Path) -> None:
    result = CliRunner().invoke(main, ["run", "--data", str(simulated), "--hour", "2026-11-30 00"])
    assert result.exit_code == 2
    assert "YYYY-MM-DDTHH" in result.output


def test_costs_without_a_warehouse_says_so(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["costs", "--data", str(tmp_path)])
    assert result.exit_code == 6
    assert "no warehouse" in result.output


def test_demo_replaces_only_an_earlier_demo(tmp_path: Path) -> None:
    earlier = tmp_path / "demo"
    prepare_out_dir(earlier)
    (earlier / "warehouse.duckdb").write_text("old")
    prepare_out_dir(earlier)
    assert sorted(p.name for p in earlier.iterdir()) == [DEMO_MARKER]
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data.txt").write_text("keep")
    with pytest.raises(Exception, match="is not an earlier demo run"):
        prepare_out_dir(precious)
    assert (precious / "data.txt").read_text() == "keep"


def sample_output() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "sample_output", ROOT / "docs" / "sample_output.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Its dataclass looks its module up by name.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_demo_calibrates_bills_and_writes_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo of the getting-started page: what it and the commands the pages run on it
    print is what the pages show (docs/sample_output.py writes them)."""
    samples = sample_output()
    for name in samples.UNSET:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", samples.COLUMNS)
    # Named like markup: the demo prints it as it is named.
    out = tmp_path / "[bold]demo"
    demo, *queries = samples.samples()
    assert demo.argv(out)[:3] == ["demo", "--out", str(out)]
    result = samples.run(demo, out)
    assert result.exit_code == 0, result.output
    stale = "shows other output: run `python docs/sample_output.py`"
    assert samples.shown(result.stdout, out) == demo.output, f"{demo.page} {stale}"
    lines = result.output.splitlines()
    assert lines[-1] == f"report: {out / 'report.html'}"
    page = (out / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert "reason-dsv3" in page
    assert "chat-8b" in page
    assert "2 of 2 pool-hours published, 0 held back." in result.output
    assert f"Query it with `stepledger sql --data {out}`" in result.output
    # Billed through Dagster on the output directory's own instance: its history stays there.
    with dg.DagsterInstance.from_config(str(out / "dagster")) as instance:
        runs = instance.get_runs()
        materialized = instance.get_materialized_partitions(dg.AssetKey("ledger"))
    assert sorted((r.job_name, r.status, r.tags["dagster/partition"]) for r in runs) == [
        ("pool_hour_job", dg.DagsterRunStatus.SUCCESS, "2026-11-30-00:00|chat-8b"),
        ("pool_hour_job", dg.DagsterRunStatus.SUCCESS, "2026-11-30-00:00|reason-dsv3"),
    ]
    assert materialized == {"2026-11-30-00:00|chat-8b", "2026-11-30-00:00|reason-dsv3"}
    # A span shorter than the hour leaves the GPUs' DCGM activity above the engine's (a
    # plausibility WARN); the fleet's own engine version is calibrated.
    assert "calibration:" not in result.output
    store = yaml.safe_load((out / "calibration.yaml").read_text())
    assert sorted((e["model"], e["gpu_type"], e["engine_version"]) for e in store["entries"]) == [
        ("deepseek-v3", "h200", ENGINE_VERSION),
        ("llama-3.1-8b-instruct", "h100", ENGINE_VERSION),
    ]
    with finance.connect(out) as con:
        assert con.execute(
            "SELECT count(*), bool_and(passed) FROM reconciliation WHERE check_name = 'calibration'"
        ).fetchone() == (5, True)
    # The pages' queries, on the same directory: its "[bold]" is no glob pattern to the lake's
    # table macro.
    assert len(queries) == 6
    for query in queries:
        printed = samples.run(query, out)
        assert printed.exit_code == 0, printed.output
        assert samples.shown(printed.stdout, out) == query.output, f"{query.page} {stale}"


def test_demo_json_is_one_object_on_stdout(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    result = CliRunner().invoke(
        main, ["demo", "--out", str(out), "--hours", "0.005", "--workers", "2", "--json"]
    )
    assert result.exit_code == 0, result.output
    demo = json.loads(result.stdout)
    assert demo["report"] == str(out / "report.html")
    assert [(r["hour"], r["pool"], r["success"]) for r in demo["runs"]] == [
        ("2026-11-30T00", "chat-8b", True),
        ("2026-11-30T00", "reason-dsv3", True),
    ]
    invoiced = sum(
        p.nano_per_gpu_hour * p.gpus_per_replica * len(p.replicas) for p in load_pools().pools
    )
    assert sum(row["amount_nano"] for row in demo["costs"]["costs"]) == invoiced
    assert {e["model"] for e in demo["calibration"]} == {"deepseek-v3", "llama-3.1-8b-instruct"}
