from __future__ import annotations

import importlib
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import dagster as dg
import pytest

from assets.definitions import build_definitions
from schemas.config import load_pools
from tests.helpers.fleets import BLOCKING_CHECKS, small_pools


def test_definitions_load(tmp_path: Path) -> None:
    defs = build_definitions(load_pools(), tmp_path)
    dg.Definitions.validate_loadable(defs)
    job = defs.resolve_job_def("pool_hour_job")
    # Every step that opens the DuckDB file is in the single-writer pool; the attribution
    # reads only the lake, so pool-hours can attribute while another holds the warehouse.
    nodes: dict[str, dg.OpDefinition] = {}
    for node in job.nodes_in_topological_order:
        assert isinstance(node.definition, dg.OpDefinition), node.name
        nodes[node.name] = node.definition
    assert {name: node.pool for name, node in nodes.items()} == {
        "step_log": "duckdb",
        "request_context": "duckdb",
        "attribution": None,
        "ledger": "duckdb",
        "reconciliation": "duckdb",
    }
    assert {name for name, node in nodes.items() if "warehouse" in node.required_resource_keys} == {
        "step_log",
        "request_context",
        "ledger",
        "reconciliation",
    }
    assert job.partitions_def is not None
    keys = job.partitions_def.get_partition_keys(current_time=datetime(2026, 11, 1, 2, tzinfo=UTC))
    assert [str(k) for k in keys] == [
        "2026-11-01-00:00|chat-8b",
        "2026-11-01-00:00|reason-dsv3",
        "2026-11-01-01:00|chat-8b",
        "2026-11-01-01:00|reason-dsv3",
    ]


def test_lazy_definitions_read_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "pools.yaml").write_text(
        (Path(__file__).parents[2] / "pipeline" / "data" / "pools.yaml")
        .read_text()
        .replace("chat-8b", "chat-small")
    )
    monkeypatch.setenv("STEPLEDGER_DATA", str(tmp_path))
    module = importlib.reload(importlib.import_module("assets.definitions"))
    defs = module.defs()
    dg.Definitions.validate_loadable(defs)
    pool_keys = defs.resolve_job_def(
        "pool_hour_job"
    ).partitions_def.get_partitions_def_for_dimension("pool")
    assert pool_keys.get_partition_keys() == ["chat-small", "reason-dsv3"]
    assert defs.resources["warehouse"].database == str(tmp_path / "pipeline.duckdb")


def test_importing_the_code_location_does_no_io(tmp_path: Path) -> None:
    # A data directory that does not exist: import must still succeed (nothing is read).
    script = (
        "import os; os.environ['STEPLEDGER_DATA'] = '/nonexistent/stepledger'\n"
        "import builtins; opened = []; real = builtins.open\n"
        "builtins.open = lambda f, *a, **k: (opened.append(str(f)), real(f, *a, **k))[1]\n"
        "import assets.definitions\n"
        "print([f for f in opened if 'stepledger' in f or f.endswith(('.yaml', '.duckdb'))])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert out.stdout.strip() == "[]"


def scheduled_partitions(
    delay_minutes: int, tmp_path: Path
) -> tuple[str, list[tuple[str | None, str | None]]]:
    """The schedule's cron, and the (partition, run key) pairs its 06:15 UTC tick requests."""
    pools = small_pools()
    pools = pools.model_copy(
        update={
            "settings": pools.settings.model_copy(update={"late_file_delay_minutes": delay_minutes})
        }
    )
    defs = build_definitions(pools, tmp_path)
    schedule = defs.resolve_schedule_def("hourly_ledger")
    tick = dg.build_schedule_context(
        scheduled_execution_time=datetime(2026, 11, 30, 6, 15, tzinfo=UTC),
        repository_def=defs.get_repository_def(),
    )
    requests = schedule.evaluate_tick(tick).run_requests
    assert requests is not None
    assert isinstance(schedule.cron_schedule, str)
    return schedule.cron_schedule, [(r.partition_key, r.run_key) for r in requests]


def test_schedule_targets_each_pool_after_the_late_file_delay(tmp_path: Path) -> None:
    assert scheduled_partitions(15, tmp_path) == (
        "15 * * * *",
        [("2026-11-30-05:00|chat-8b", "2026-11-30T05|chat-8b")],
    )


def test_the_schedule_and_sensors_run_as_soon_as_a_daemon_loads_them(tmp_path: Path) -> None:
    defs = build_definitions(small_pools(), tmp_path)
    repository = defs.get_repository_def()
    assert [(s.name, s.default_status) for s in repository.schedule_defs] == [
        ("hourly_ledger", dg.DefaultScheduleStatus.RUNNING)
    ]
    assert {s.name: s.default_status for s in repository.sensor_defs} == dict.fromkeys(
        ("new_segments", "page_on_call", "deliver_alerts", "deadman"),
        dg.DefaultSensorStatus.RUNNING,
    )


def test_a_delay_past_the_hour_targets_an_earlier_hour(tmp_path: Path) -> None:
    assert scheduled_partitions(75, tmp_path) == (
        "15 * * * *",
        [("2026-11-30-04:00|chat-8b", "2026-11-30T04|chat-8b")],
    )


def test_the_warehouse_directory_is_created_on_first_use(tmp_path: Path) -> None:
    # DuckDBResource alone would retry a connect into a missing directory for ~100 s.
    from dagster_duckdb import DuckDBResource

    from assets.resources import open_warehouse

    resource = DuckDBResource(database=str(tmp_path / "not" / "yet" / "warehouse.duckdb"))
    with open_warehouse(resource) as con:
        assert con.execute("SELECT count(*) FROM invoices").fetchone() == (0,)
    assert (tmp_path / "not" / "yet" / "warehouse.duckdb").is_file()


def description(spec: dg.AssetCheckSpec) -> str:
    assert spec.description is not None, spec.name
    return spec.description


def test_checks_are_per_pool_hour_described_and_only_those_holding_an_hour_back_block() -> None:
    from assets.partitions import pool_hour_partitions
    from assets.reconciliation import build_reconciliation_checks

    partitions = pool_hour_partitions(["chat-8b"])
    (checks,) = build_reconciliation_checks(small_pools(), partitions)
    specs = {spec.name: spec for spec in checks.check_specs}
    assert {name: spec.blocking for name, spec in specs.items()} == BLOCKING_CHECKS
    assert all(spec.partitions_def == partitions for spec in specs.values())
    assert {name: description(spec).split(".")[-2] for name, spec in specs.items()} == {
        "sequence": " A failure holds the hour back",
        "time": " A failure holds the hour back",
        "money": " A failure holds the hour back",
        "plausibility": " The hour is published either way",
        "unattributed": " The hour is published either way",
        "calibration": " The hour is published either way",
        "calibration_drift": " The hour is published either way",
        "clock": " The hour is published either way",
        "silence": " A failure holds the hour back",
        "conservation": " A failure holds the hour back",
    }
