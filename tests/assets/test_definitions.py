from __future__ import annotations

import importlib
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import dagster as dg
import pytest

from assets.definitions import build_definitions
from assets.resources import StepledgerData
from schemas.config import load_pools
from tests.helpers.fleets import BLOCKING_CHECKS, small_pools
from tests.helpers.hours import SIMULATED_HOUR


def test_definitions_load(tmp_path: Path) -> None:
    # A directory with no data yet: its partitions start at the hour the definitions load.
    defs = build_definitions(
        load_pools(), tmp_path, clock=lambda: datetime(2026, 11, 1, 0, 40, tzinfo=UTC)
    )
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


def hour_partitions(defs: dg.Definitions, now: datetime) -> list[str]:
    partitions = defs.resolve_job_def("pool_hour_job").partitions_def
    assert partitions is not None
    return [str(k) for k in partitions.get_partition_keys(current_time=now)]


def test_partitions_span_the_data_directorys_hours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = data_with(tmp_path, *(f"gateway/2026-11-30T0{h}.jsonl" for h in (5, 4, 6)))
    # Long after its data stopped (a demo's directory): its hours exactly.
    now = datetime(2026, 12, 4, 21, 30, tzinfo=UTC)
    defs = build_definitions(small_pools(), data, clock=lambda: now)
    assert hour_partitions(defs, now) == [f"2026-11-30-0{h}:00|chat-8b" for h in (4, 5, 6)]
    # Hours about to be run by `stepledger run --hour` are partitions whatever the data.
    later = datetime(2026, 11, 30, 9, tzinfo=UTC)
    defs = build_definitions(small_pools(), data, clock=lambda: now, run_hours=[later])
    assert hour_partitions(defs, now)[-1] == "2026-11-30-09:00|chat-8b"
    assert len(hour_partitions(defs, now)) == 6
    # While the hour after its last data may still come, up to the current hour.
    live = datetime(2026, 11, 30, 8, 10, tzinfo=UTC)
    defs = build_definitions(small_pools(), data, clock=lambda: live)
    assert hour_partitions(defs, live) == [f"2026-11-30-0{h}:00|chat-8b" for h in range(4, 8)]
    monkeypatch.setenv("STEPLEDGER_FIRST_HOUR", "2026-11-30T03")
    defs = build_definitions(small_pools(), data, clock=lambda: now)
    assert hour_partitions(defs, now)[0] == "2026-11-30-03:00|chat-8b"
    monkeypatch.setenv("STEPLEDGER_FIRST_HOUR", "yesterday")
    with pytest.raises(
        ValueError, match="STEPLEDGER_FIRST_HOUR: hour 'yesterday' is not of the form"
    ):
        build_definitions(small_pools(), data)


def scheduled_partitions(
    delay_minutes: int, data: Path, at: datetime = datetime(2026, 11, 30, 6, 15, tzinfo=UTC)
) -> tuple[str, list[tuple[str | None, str | None]] | str]:
    """The schedule's cron, and the (partition, run key) pairs its tick at `at` requests, or
    why it skipped."""
    pools = small_pools()
    pools = pools.model_copy(
        update={
            "settings": pools.settings.model_copy(update={"late_file_delay_minutes": delay_minutes})
        }
    )
    defs = build_definitions(pools, data, clock=lambda: at)
    schedule = defs.resolve_schedule_def("hourly_ledger")
    tick = dg.build_schedule_context(
        scheduled_execution_time=at,
        repository_def=defs.get_repository_def(),
        resources={"data": StepledgerData(data_dir=str(data))},
    )
    result = schedule.evaluate_tick(tick)
    assert isinstance(schedule.cron_schedule, str)
    if result.skip_message is not None:
        return schedule.cron_schedule, result.skip_message
    assert result.run_requests is not None
    return schedule.cron_schedule, [(r.partition_key, r.run_key) for r in result.run_requests]


def data_with(tmp_path: Path, *files: str) -> Path:
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    return tmp_path


def test_schedule_targets_each_pool_after_the_late_file_delay(tmp_path: Path) -> None:
    data = data_with(tmp_path, "gateway/2026-11-30T05.jsonl")
    assert scheduled_partitions(15, data) == (
        "15 * * * *",
        [("2026-11-30-05:00|chat-8b", "2026-11-30T05|chat-8b")],
    )


def test_the_schedule_bills_only_hours_the_directory_has_data_for_or_expects(
    tmp_path: Path,
) -> None:
    # The hour after the feed's last gateway file is expected (a gap, billed and held back);
    # the hour after that, or an hour of a directory holding other hours only, is not.
    data = data_with(tmp_path, "gateway/2026-11-30T04.jsonl")
    assert scheduled_partitions(15, data)[1] == [
        ("2026-11-30-05:00|chat-8b", "2026-11-30T05|chat-8b")
    ]
    later = datetime(2026, 11, 30, 7, 15, tzinfo=UTC)
    assert scheduled_partitions(15, data, later)[1] == (
        f"{data} has no data for 2026-11-30T06 and expects none (no gateway file of the hour "
        "or the hour before, no DCGM scrape of the hour)"
    )
    data_with(tmp_path, "dcgm/gpu-node-01/2026-11-30T06.prom")
    assert scheduled_partitions(15, data, later)[1] == [
        ("2026-11-30-06:00|chat-8b", "2026-11-30T06|chat-8b")
    ]


def test_the_schedule_and_sensors_run_as_soon_as_a_daemon_loads_them(tmp_path: Path) -> None:
    defs = build_definitions(small_pools(), tmp_path)
    repository = defs.get_repository_def()
    assert [(s.name, s.default_status) for s in repository.schedule_defs] == [
        ("hourly_ledger", dg.DefaultScheduleStatus.RUNNING)
    ]
    assert {s.name: s.default_status for s in repository.sensor_defs} == dict.fromkeys(
        ("new_segments", "page_on_call", "deliver_alerts", "deadman", "verify_published"),
        dg.DefaultSensorStatus.RUNNING,
    )


def test_a_delay_past_the_hour_targets_an_earlier_hour(tmp_path: Path) -> None:
    data = data_with(tmp_path, "gateway/2026-11-30T04.jsonl")
    assert scheduled_partitions(75, data) == (
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
    from assets.partitions import HourRange, pool_hour_partitions
    from assets.reconciliation import build_reconciliation_checks

    partitions = pool_hour_partitions(["chat-8b"], HourRange(SIMULATED_HOUR, None))
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
