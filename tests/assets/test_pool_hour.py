from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import dagster as dg
import duckdb
import pytest

from assets.definitions import build_definitions
from assets.partitions import partition_key, range_tags
from assets.resources import StepledgerData
from assets.runner import QUIET_RUN_CONFIG as QUIET
from assets.sensors import build_new_segments_sensor
from pipeline import finance
from pipeline.ingestion.ingest import segment_files
from pipeline.reconcile import CHECKS
from pipeline.storage.warehouse import STATE_FILE, connect
from schemas.config import load_pools
from tests.helpers.fleets import small_pools
from tests.helpers.hours import SIMULATED_HOUR
from tests.helpers.segment_bytes import resealed


def run_hour(data: Path, instance: dg.DagsterInstance) -> dg.ExecuteInProcessResult:
    defs = build_definitions(small_pools(), data)
    return defs.resolve_job_def("pool_hour_job").execute_in_process(
        partition_key=partition_key(SIMULATED_HOUR, "chat-8b"),
        instance=instance,
        run_config=QUIET,
        raise_on_error=False,
    )


def snapshot(data: Path) -> dict[str, list[tuple[Any, ...]]]:
    with connect(data / STATE_FILE) as con:
        return {
            table: con.execute(
                f"SELECT * EXCLUDE ({excluded}) FROM {table} ORDER BY ALL"
            ).fetchall()
            for table, excluded in (
                ("invoices", "gpus"),
                ("ledger_lines", "weights_version"),
                ("request_costs", "steps"),
                ("reconciliation", "checked_at"),
                ("segments", "batch_id"),
                ("request_context", "received_at"),
            )
        }


def one_row(con: duckdb.DuckDBPyConnection, sql: str) -> tuple[Any, ...]:
    row = con.execute(sql).fetchone()
    assert row is not None, sql
    return row


def run_key(request: dg.RunRequest) -> str:
    assert request.run_key is not None
    return request.run_key


def multi_partition_key(request: dg.RunRequest) -> dg.MultiPartitionKey:
    assert isinstance(request.partition_key, dg.MultiPartitionKey)
    return request.partition_key


@pytest.fixture
def data(simulated: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(simulated, copy)
    return copy


def test_a_simulated_hour_end_to_end(data: Path) -> None:
    result = run_hour(data, dg.DagsterInstance.ephemeral())
    assert result.success
    evaluations = result.get_asset_check_evaluations()
    checks = {e.check_name: e.passed for e in evaluations}
    assert checks["money"]
    assert checks["sequence"]
    assert checks["time"]
    # One evaluation per check, of this pool-hour.
    assert sorted((e.check_name, e.partition) for e in evaluations) == sorted(
        (name, "2026-11-30-00:00|chat-8b") for name in CHECKS
    )
    with finance.connect(data) as con:
        invoice = con.execute("SELECT gpus, amount_nano FROM invoices").fetchall()
        (lines_total,) = one_row(con, "SELECT sum(amount_nano) FROM ledger_lines")
        kinds = {
            r[0] for r in con.execute("SELECT DISTINCT line_kind FROM ledger_lines").fetchall()
        }
        (requests_total,) = one_row(con, "SELECT sum(amount_nano) FROM request_costs")
        (charged,) = one_row(
            con,
            "SELECT sum(amount_nano) FROM ledger_lines WHERE line_kind IN ('usage', 'unattributed', 'platform_retry')",
        )
        (published,) = one_row(con, "SELECT sum(amount_nano) FROM tenant_costs_hourly")
        focus = one_row(con, "SELECT sum(x_AmountNano), min(ChargePeriodStart) FROM focus_costs")
    # Two one-GPU replicas for the hour, at the pool's GPU-hour price, to the nano-dollar.
    expected = 2 * small_pools().pool("chat-8b").nano_per_gpu_hour
    assert invoice == [(2, expected)]
    assert lines_total == published == focus[0] == expected
    assert focus[1] == SIMULATED_HOUR  # FOCUS timestamps carry their zone
    assert {"usage", "idle"} <= kinds
    assert 0 < charged == requests_total < expected


def test_rerunning_an_hour_and_redelivering_a_segment_change_nothing(data: Path) -> None:
    instance = dg.DagsterInstance.ephemeral()
    assert run_hour(data, instance).success
    before = snapshot(data)
    assert run_hour(data, instance).success
    assert snapshot(data) == before
    segment = segment_files(data / "outbox", ["chat-8b-r0"])[0]
    shutil.copy(segment, segment.with_name("redelivered-" + segment.name))
    assert run_hour(data, instance).success
    assert snapshot(data) == before
    with connect(data / STATE_FILE) as con:
        assert con.execute(
            "SELECT count(*) FROM segment_files WHERE status = 'duplicate'"
        ).fetchone() == (1,)


def sense(data: Path, cursor: str | None = None) -> dg.SensorResult | dg.SkipReason:
    """The new-segments sensor's tick on `data` after `cursor`."""
    sensor = build_new_segments_sensor(small_pools())
    resources = {"data": StepledgerData(data_dir=str(data))}
    with dg.build_sensor_context(cursor=cursor, resources=resources) as context:
        result = sensor(context)
    assert isinstance(result, dg.SensorResult | dg.SkipReason)
    return result


def test_sensor_requests_ingestion_for_new_segments_labelled_with_their_datas_hour(
    data: Path,
) -> None:
    # A file named like a segment without a header tells no hour; ingestion reports it.
    replica = segment_files(data / "outbox")[0].parent
    (replica / f"{replica.name}.000009999999.0badc0de.seg").write_bytes(b"not a segment")
    first = sense(data)
    assert isinstance(first, dg.SensorResult)
    assert first.run_requests is not None
    assert [run_key(r).split("|")[0] for r in first.run_requests] == ["chat-8b"]
    # The simulated hour its records belong to, whenever the files were written and sensed.
    assert [multi_partition_key(r).keys_by_dimension for r in first.run_requests] == [
        {"hour": "2026-11-30-00:00", "pool": "chat-8b"}
    ]
    newest = max(p.stat().st_mtime_ns for p in segment_files(data / "outbox"))
    assert first.cursor == str(newest)
    assert isinstance(sense(data, first.cursor), dg.SkipReason)


def test_new_segments_over_several_hours_are_one_run_over_their_range(data: Path) -> None:
    from schemas.records import FRAME_PREFIX, PREAMBLE, HeaderFrame

    first = sense(data)
    assert isinstance(first, dg.SensorResult)
    # A segment of the next hour: a recorded one whose header's wall clock is an hour later.
    segment = segment_files(data / "outbox")[0]
    raw = segment.read_bytes()
    length = FRAME_PREFIX.unpack_from(raw, PREAMBLE.size)[4]
    start = PREAMBLE.size + FRAME_PREFIX.size
    header = HeaderFrame.from_json(raw[start : start + length])
    later = dataclasses.replace(header, wall_anchor_ns=header.wall_anchor_ns + 3_600 * 10**9)
    next_hour = segment.with_name(segment.name.replace(".seg", "0.seg"))
    next_hour.write_bytes(resealed(raw, PREAMBLE.size, later.to_json()))
    again_result = sense(data, first.cursor)
    assert isinstance(again_result, dg.SensorResult)
    (again,) = again_result.run_requests or []
    assert multi_partition_key(again).keys_by_dimension == {
        "hour": "2026-11-30-01:00",
        "pool": "chat-8b",
    }
    both_result = sense(data)
    assert isinstance(both_result, dg.SensorResult)
    (both,) = both_result.run_requests or []
    assert both.partition_key is None
    assert both.tags == range_tags(SIMULATED_HOUR, SIMULATED_HOUR + timedelta(hours=1), "chat-8b")


def test_the_ledger_materialization_tells_the_hour(data: Path) -> None:
    result = run_hour(data, dg.DagsterInstance.ephemeral())
    (materialization,) = result.asset_materializations_for_node("ledger")
    metadata = {key: value.value for key, value in materialization.metadata.items()}
    with finance.connect(data) as con:
        by_kind = dict(
            con.execute(
                "SELECT line_kind, sum(amount_nano)::BIGINT FROM ledger_lines GROUP BY ALL"
            ).fetchall()
        )
        rows = [
            one_row(con, f"SELECT count(*) FROM {t}")[0]
            for t in ("invoices", "ledger_lines", "request_costs")
        ]
        tenants = con.execute(
            "SELECT coalesce(tenant, '(no tenant)'), sum(amount_nano)::BIGINT, sum(requests)::BIGINT "
            "FROM ledger_lines GROUP BY ALL ORDER BY 2 DESC, 1"
        ).fetchall()
    invoice = 2 * small_pools().pool("chat-8b").nano_per_gpu_hour
    assert invoice == 7_200_000_000
    assert {k: v for k, v in metadata.items() if k != "top_tenants"} == {
        "invoice_nano": invoice,
        "invoice_usd": "$7.200000",
        "ledger_nano": invoice,
        "balanced": True,
        **{
            f"{kind}_nano": by_kind.get(kind, 0)
            for kind in (
                "usage",
                "idle",
                "headroom",
                "unattributed",
                "platform_retry",
                "cache_credit",
            )
        },
        "invoice_rows": rows[0],
        "ledger_line_rows": rows[1],
        "request_cost_rows": rows[2],
    }
    top_tenants = metadata["top_tenants"]
    assert isinstance(top_tenants, str)
    table = top_tenants.splitlines()
    assert table[:2] == [
        "| tenant | amount | share of invoice | requests | new tokens | line kinds |",
        "|---|---:|---:|---:|---:|---|",
    ]
    assert [line.split(" | ")[0].removeprefix("| ") for line in table[2:]] == [
        t for t, _, _ in tenants
    ]
    top, amount, requests = tenants[0]
    assert table[2].startswith(
        f"| {top} | ${amount / 1e9:,.6f} | {amount / invoice:.1%} | {requests:,} | "
    )
    checks = {e.check_name: e.metadata for e in result.get_asset_check_evaluations()}
    results_table = checks["money"]["results_table"].value
    assert isinstance(results_table, str)
    money = results_table.splitlines()
    assert money[0] == "| scope | status | expected | observed | detail |"
    assert money[2].startswith(
        f"| chat-8b | passed | {invoice} nano-dollars (invoice) | {invoice} nano-dollars in "
    )


def test_a_backfill_range_bills_each_hour_as_its_hourly_run_does(
    simulated: Path, tmp_path: Path
) -> None:
    # The simulated minutes and the hour after them, when the replicas logged nothing.
    hours = [SIMULATED_HOUR, SIMULATED_HOUR + timedelta(hours=1)]
    keys = [str(partition_key(hour, "chat-8b")) for hour in hours]
    hourly, ranged = tmp_path / "hourly", tmp_path / "ranged"
    for copy in (hourly, ranged):
        shutil.copytree(simulated, copy)
    hourly_job = build_definitions(small_pools(), hourly, run_hours=hours).resolve_job_def(
        "pool_hour_job"
    )
    hourly_results = [
        hourly_job.execute_in_process(
            partition_key=partition_key(hour, "chat-8b"),
            instance=dg.DagsterInstance.ephemeral(),
            run_config=QUIET,
            raise_on_error=False,
        )
        for hour in hours
    ]
    job = build_definitions(small_pools(), ranged, run_hours=hours).resolve_job_def("pool_hour_job")
    result = job.execute_in_process(
        tags=range_tags(hours[0], hours[1], "chat-8b"),
        instance=dg.DagsterInstance.ephemeral(),
        run_config=QUIET,
        raise_on_error=False,
    )
    # The hour after holds neither steps nor DCGM samples: it is held back (silence), never
    # billed as idle, and fails its run and the range's alike.
    assert [r.success for r in [result, *hourly_results]] == [False, True, False]
    assert snapshot(ranged) == snapshot(hourly)
    with finance.connect(ranged) as con:
        assert con.execute("SELECT hour, amount_nano FROM invoices ORDER BY hour").fetchall() == [
            (hour.replace(tzinfo=None), 7_200_000_000) for hour in hours
        ]
    # Each hour has its own check evaluations and its own ledger figures, as hourly runs give.
    evaluations = result.get_asset_check_evaluations()
    assert sorted((e.check_name, e.partition) for e in evaluations) == sorted(
        (name, key) for name in CHECKS for key in keys
    )
    hourly_evaluations = [e for r in hourly_results for e in r.get_asset_check_evaluations()]
    assert {(e.check_name, e.partition, e.passed) for e in evaluations} == {
        (e.check_name, e.partition, e.passed) for e in hourly_evaluations
    }

    def ledger_figures(
        materializations: Sequence[dg.AssetMaterialization],
    ) -> dict[str, dict[str, object]]:
        return {
            str(m.partition): {k: v.value for k, v in m.metadata.items() if k != "top_tenants"}
            for m in materializations
        }

    assert ledger_figures(result.asset_materializations_for_node("ledger")) == ledger_figures(
        [m for r in hourly_results for m in r.asset_materializations_for_node("ledger")]
    )


def test_a_days_backfill_of_the_default_pools_is_one_run_per_pool(tmp_path: Path) -> None:
    from dagster._core.definitions.automation_tick_evaluation_context import (
        build_run_requests_with_backfill_policies,
    )
    from dagster._core.definitions.events import AssetKeyPartitionKey

    pools = load_pools()
    # A directory with no data yet, whose partitions start at the day backfilled.
    defs = build_definitions(pools, tmp_path, clock=lambda: SIMULATED_HOUR)
    hours = [SIMULATED_HOUR + timedelta(hours=h) for h in range(24)]
    selection = [
        AssetKeyPartitionKey(dg.AssetKey(asset), partition_key(hour, pool.name))
        for asset in ("step_log", "request_context", "attribution", "ledger")
        for hour in hours
        for pool in pools.pools
    ]
    with dg.DagsterInstance.ephemeral() as instance:
        requests = build_run_requests_with_backfill_policies(
            selection, defs.resolve_asset_graph(), instance
        )
    per_pool = sorted(
        tuple(range_tags(hours[0], hours[-1], pool.name).values()) for pool in pools.pools
    )
    # An asset backfill (partitions selected in the UI) ...
    assert (
        sorted(
            (
                request.tags["dagster/asset_partition_range_start"],
                request.tags["dagster/asset_partition_range_end"],
            )
            for request in requests
        )
        == per_pool
    )
    assert all(len(request.asset_selection or []) == 4 for request in requests)
    # ... and a backfill of the job, which splits the job's partitions the same way.
    job = defs.resolve_job_def("pool_hour_job")
    assert job.backfill_policy == dg.BackfillPolicy.single_run()
    partitions = job.partitions_def
    assert partitions is not None
    keys = [str(partition_key(hour, pool.name)) for hour in hours for pool in pools.pools]
    ranges = partitions.subset_with_partition_keys(keys).get_partition_key_ranges(partitions)
    assert sorted((r.start, r.end) for r in ranges) == per_pool
