"""A small simulated fleet, and ways to bill it through the Dagster definitions."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from assets.runner import QUIET_RUN_CONFIG as QUIET
from schemas.config import PoolsFile, load_pools
from schemas.records import SLOT_COLUMNS
from tests.helpers.hours import SIMULATED_HOUR

if TYPE_CHECKING:
    import dagster as dg

# Three simulated minutes: enough traffic for every kind of ledger line.
SIMULATED_HOURS = 0.05


def small_pools(
    tenant_names: list[str] | None = None, feature_names: list[str] | None = None
) -> PoolsFile:
    """The default chat pool cut to two replicas; tenants and features renamed when given."""
    pools = load_pools()
    chat = pools.pool("chat-8b")
    workload = chat.workload
    assert workload is not None
    tenants = workload.tenants
    if tenant_names is not None:
        tenants = [
            tenant.model_copy(
                update={
                    "name": tenant_names[i],
                    "features": [
                        f.model_copy(update={"name": feature_names[i] if feature_names else f.name})
                        for f in tenant.features
                    ],
                }
            )
            for i, tenant in enumerate(tenants)
        ]
    chat = chat.model_copy(
        update={
            "replicas": chat.replicas[:2],
            "workload": workload.model_copy(update={"tenants": tenants}),
        }
    )
    return pools.model_copy(update={"pools": [chat]})


def simulate_small(out: Path, pools: PoolsFile | None = None, **options) -> Path:
    from pipeline.simulator import simulate

    simulate(out, pools or small_pools(), hours=SIMULATED_HOURS, seed=7, **options)
    return out


def bill(
    data: Path,
    pools: PoolsFile,
    instance: dg.DagsterInstance,
    hour: datetime = SIMULATED_HOUR,
    run_config: Mapping[str, Any] = QUIET,
) -> list[dg.ExecuteInProcessResult]:
    """Materialize every pool of `hour` through the pool-hour job; the run results."""
    from assets.definitions import build_definitions
    from assets.partitions import partition_key

    warnings.filterwarnings("ignore", module="dagster")
    job = build_definitions(pools, data, run_hours=[hour]).resolve_job_def("pool_hour_job")
    return [
        job.execute_in_process(
            partition_key=partition_key(hour, pool.name),
            instance=instance,
            run_config=run_config,
            raise_on_error=False,
        )
        for pool in pools.pools
    ]


def page_on_call(
    defs: dg.Definitions, instance: dg.DagsterInstance, result: dg.ExecuteInProcessResult
) -> None:
    """Evaluate the run-failure sensor for a failed run, as the daemon would."""
    import dagster as dg

    # A context manager, as the daemon opens it: the pool-hour lock among the resources is one.
    with dg.build_run_status_sensor_context(
        sensor_name="page_on_call",
        dagster_instance=instance,
        dagster_run=result.dagster_run,
        dagster_event=result.get_run_failure_event(),
        resources=defs.resources,
    ) as context:
        defs.resolve_sensor_def("page_on_call")(context.for_run_failure())


def costs(data: Path) -> dict[str, list[tuple[Any, ...]]]:
    """What finance sees: published money by tenant, feature and line kind; the held-back hours."""
    from pipeline.storage.warehouse import STATE_FILE, connect_read_only

    with connect_read_only(data / STATE_FILE) as con:
        published = con.execute(
            "SELECT tenant, feature, line_kind, sum(amount_nano)::BIGINT FROM published_ledger_lines "
            "GROUP BY ALL ORDER BY ALL"
        ).fetchall()
        held = con.execute("SELECT pool, reason FROM held_back_hours").fetchall()
    return {"published": published, "held_back": held}


def rerecord(
    data: Path, rename=lambda request_id: request_id, rotate_bytes: int | None = None
) -> None:
    """Rewrite a run directory so every request id becomes `rename(id)`: each segment is
    decoded and recorded again through the StepRecorder (same header, anchors and sequence
    numbers; split into segments of `rotate_bytes` when given), and the gateway files are
    rewritten line by line."""
    import json

    for path in sorted((data / "outbox").glob("*/*.seg")):
        record_again(path, rename, rotate_bytes)
    for path in sorted((data / "gateway").glob("*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines() if line]
        for record in records:
            record["request_id"] = rename(record["request_id"])
            if record["retry_of"] is not None:
                record["retry_of"] = rename(record["retry_of"])
        path.write_text("".join(json.dumps(record) + "\n" for record in records))


def record_again(
    path: Path,
    rename=lambda request_id: request_id,
    rotate_bytes: int | None = None,
    *,
    reboot_wall_shift_ns: int | None = None,
) -> None:
    """Decode one segment and record its steps again through the StepRecorder in its place
    (same header and sequence numbers). `reboot_wall_shift_ns`: as if the host rebooted just
    before the segment (its monotonic clock restarted at one second) with the wall clock set
    that far off, so nothing in the log says the segment's wall clock is wrong."""
    from dataclasses import fields

    import numpy as np

    from pipeline.hook.recorder import MAX_SEGMENT_BYTES, StepRecorder
    from pipeline.ingestion.decoder import read_segments
    from schemas.records import SegmentHeader

    decoded = read_segments([path])
    assert decoded.damage.num_rows == 0, path
    assert decoded.drops.num_rows == 0, path
    (segment,) = decoded.segments.to_pylist()
    names = {field.name for field in fields(SegmentHeader)}
    header = SegmentHeader.from_mapping({k: v for k, v in segment.items() if k in names})
    steps = decoded.steps.to_pylist()
    slots = decoded.slots.to_pydict()
    holders = decoded.holders.to_pydict()
    slot_bounds = np.cumsum([0] + [s["num_slots"] for s in steps])
    holder_bounds = np.cumsum([0] + [s["num_holders"] for s in steps])
    mono_shift = wall_shift = 0
    if reboot_wall_shift_ns is not None:
        mono_shift, wall_shift = 1_000_000_000 - segment["mono_anchor_ns"], reboot_wall_shift_ns
    mono_anchor: int = segment["mono_anchor_ns"] + mono_shift
    wall_anchor: int = segment["wall_anchor_ns"] + wall_shift
    path.unlink()
    with StepRecorder(
        path.parent,
        header,
        overflow="block",
        rotate_bytes=rotate_bytes or MAX_SEGMENT_BYTES,
        first_seq=segment["first_seq"],
        mono_clock=lambda: mono_anchor,
        wall_clock=lambda: wall_anchor,
    ) as recorder:
        for index, step in enumerate(steps):
            s = slice(slot_bounds[index], slot_bounds[index + 1])
            h = slice(holder_bounds[index], holder_bounds[index + 1])
            recorder.record_step(
                step["start_ns"] + mono_shift,
                step["end_ns"] + mono_shift,
                [rename(r) for r in slots["request_id"][s]],
                *(slots[name][s] for name in SLOT_COLUMNS),
                holder_ids=[rename(r) for r in holders["request_id"][h]],
                holder_blocks=holders["kv_blocks"][h],
                holder_states=holders["state"][h],
                admission_blocked=step["admission_blocked"],
                free_blocks=step["free_blocks"],
                total_blocks=step["total_blocks"],
            )


# Reconciliation check -> whether Dagster labels it blocking: only the checks whose failure
# holds an hour back from the finance views.
BLOCKING_CHECKS = {
    "sequence": True,
    "time": True,
    "money": True,
    "plausibility": False,
    "unattributed": False,
    "calibration": False,
    "calibration_drift": False,
    "clock": False,
    "silence": True,
    "conservation": True,
}
