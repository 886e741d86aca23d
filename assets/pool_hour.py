"""The hourly chain of one pool: step log -> request context -> attribution -> ledger.

Each asset is a thin call into `pipeline/`. With the embedded state (a DuckDB file, one writer),
every asset that touches it runs in the `duckdb` concurrency pool (limit 1 in
dagster_home/dagster.yaml); `attribution`, the longest step, reads only the lake and runs
outside it. With the state in PostgreSQL there is no such pool: pool-hours run side by side,
each transaction locking its own rows, and a transaction that meets another's is run again
(`retry_conflicts`).
"""

# No `from __future__ import annotations`: Dagster checks the `context` annotation as an
# object, and a postponed (string) annotation fails that check.

import os
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any

import dagster as dg
import polars as pl
from dagster_duckdb import DuckDBResource

from assets.partitions import BACKFILL_POLICY, pool_hours
from assets.resources import DUCKDB_POOL, StepledgerData, open_warehouse
from pipeline.attribution.attribute import attribute_pool_hour, gather_inputs
from pipeline.attribution.ledger import LINE_KINDS, HourLedger
from pipeline.attribution.weights import weight_source
from pipeline.ingestion import gateway
from pipeline.ingestion.ingest import ingest_outbox
from pipeline.report.money import usd
from pipeline.ship.store import store_from_env
from pipeline.storage import lake
from pipeline.storage.integrity import require_lake_files
from pipeline.storage.publish import publish_hour
from pipeline.storage.warehouse import retry_conflicts
from schemas.config import PoolsFile
from schemas.units import hour_key

GROUP = "pool_hour"
# Hours a backfill's attribution works on at once: a busy hour holds up to 3.5 GiB while it
# is attributed (docs/scale-out.md), so not one per core on a many-core machine.
ATTRIBUTION_THREADS = min(2, os.cpu_count() or 1)
# Tenants listed in the ledger's metadata table; the warehouse has them all.
TOP_TENANTS = 10


def top_tenants_table(
    ledger_lines: pl.DataFrame, invoice_nano: int, limit: int = TOP_TENANTS
) -> str:
    """Markdown: the hour's tenants by what they pay (every line kind), largest first."""
    tenants = (
        ledger_lines.group_by(pl.col("tenant").fill_null("(no tenant)"))
        .agg(
            pl.col("amount_nano").sum(),
            pl.col("requests").sum(),
            pl.col("new_tokens").sum(),
            pl.col("line_kind").unique().sort().str.join(", ").alias("line_kinds"),
        )
        .sort(["amount_nano", "tenant"], descending=[True, False])
    )
    rows = [
        f"| {tenant} | {usd(amount)} | {f'{amount / invoice_nano:.1%}' if invoice_nano else '-'} | {requests:,} | "
        f"{new_tokens:,} | {kinds} |"
        for tenant, amount, requests, new_tokens, kinds in tenants.head(limit).iter_rows()
    ]
    more = [f"| and {tenants.height - limit} more | | | | | |"] if tenants.height > limit else []
    header = [
        "| tenant | amount | share of invoice | requests | new tokens | line kinds |",
        "|---|---:|---:|---:|---:|---|",
    ]
    return "\n".join(header + rows + more)


def ledger_metadata(ledger: HourLedger) -> dict[str, Any]:
    """What the hour's published ledger holds: row counts, money totals by line kind (integer
    nano-dollars, and dollars to read), and the top tenants."""
    lines = ledger.ledger_lines
    by_kind = dict(lines.group_by("line_kind").agg(pl.col("amount_nano").sum()).iter_rows())
    ledger_nano = int(lines["amount_nano"].sum())
    return {
        "invoice_nano": ledger.amount_nano,
        "invoice_usd": usd(ledger.amount_nano),
        "ledger_nano": ledger_nano,
        "balanced": ledger_nano == ledger.amount_nano,
        **{f"{kind}_nano": int(by_kind.get(kind, 0)) for kind in LINE_KINDS},
        "invoice_rows": ledger.invoices.height,
        "ledger_line_rows": lines.height,
        "request_cost_rows": ledger.request_costs.height,
        "top_tenants": dg.MetadataValue.md(top_tenants_table(lines, ledger.amount_nano)),
    }


# Materialization metadata: the sha256 of each lake file an asset wrote (path relative to the
# lake), which the next asset verifies before reading it. It lives in Dagster's event log, out
# of reach of whoever can write the lake.
WRITTEN = "lake_files_sha256"


def written_by(context: dg.AssetExecutionContext, asset: str, partition: str) -> dict[str, str]:
    """The lake files the latest materialization of `asset` for `partition` wrote, with their
    sha256."""
    records = context.instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition]),
        limit=1,
    ).records
    materialization = records[0].asset_materialization if records else None
    if materialization is None or WRITTEN not in materialization.metadata:
        raise lake.LakeFileChanged(
            f"no record of the lake files {asset} wrote for {partition}, so they cannot be "
            f"verified: materialize {asset} for the partition again"
        )
    return dict(materialization.metadata[WRITTEN].value)


def ingest_step_log(
    context: dg.AssetExecutionContext,
    data: StepledgerData,
    warehouse: DuckDBResource,
    pools: PoolsFile,
) -> dg.MaterializeResult[None]:

    pool_names = sorted({pool_hour.pool for pool_hour in pool_hours(context)})
    replicas = [r.id for name in pool_names for r in pools.pool(name).streams]
    with open_warehouse(warehouse, ledger=False) as con:
        report = retry_conflicts(
            lambda: ingest_outbox(
                con, data.layout.outbox, data.layout.lake, replicas=replicas, store=store_from_env()
            ),
            f"ingest {', '.join(pool_names)}",
        )
    return dg.MaterializeResult(
        metadata={
            "ingested_files": len(report.ingested_files),
            "duplicate_files": len(report.duplicate_files),
            "steps": report.steps,
            "damage": report.damage,
            "hours": sorted(h for p, h in report.partitions),
        }
    )


def load_request_context(
    context: dg.AssetExecutionContext,
    data: StepledgerData,
    warehouse: DuckDBResource,
    pools: PoolsFile,
) -> dg.MaterializeResult[None]:

    runs = pool_hours(context)
    # An hour's context comes from its own file and the one before: a range of hours
    # shares files, each loaded once, oldest first.
    hours = sorted({run.hour for run in runs})
    files = list(
        dict.fromkeys(
            path
            for hour in hours
            for path in gateway.gateway_files_for_hour(data.layout.gateway, hour)
        )
    )
    with open_warehouse(warehouse, ledger=False) as con:
        # Gateway files hold every pool's requests: another pool's run may load one at once.
        report = retry_conflicts(
            lambda: gateway.load_gateway_files(con, files, gateway.key_salt()), "gateway files"
        )
        for hour, pool_name, key in runs:
            inputs = gather_inputs(con, data.layout.lake, pools.pool(pool_name), hour)
            require_lake_files(data.layout.lake, pool_name, hour, inputs.lake_hashes)
            saved = lake.save_inputs(data.layout.lake, inputs)
            context.add_asset_metadata(
                {
                    WRITTEN: dg.MetadataValue.json(lake.written_hashes(data.layout.lake, [saved])),
                    "requests_of_hour": inputs.context.height,
                },
                partition_key=key,
            )
    return dg.MaterializeResult(
        metadata={
            "loaded_files": len(report.loaded),
            "unchanged_files": len(report.unchanged),
            "requests": report.requests,
        }
    )


def attribute_hours(
    context: dg.AssetExecutionContext, data: StepledgerData, pools: PoolsFile
) -> dg.MaterializeResult[None]:

    runs = pool_hours(context)
    inputs_written = {key: written_by(context, "request_context", key) for *_, key in runs}

    def attribute(hour: datetime, pool_name: str, key: str) -> dict[str, Any]:
        pool = pools.pool(pool_name)
        inputs = lake.load_inputs(data.layout.lake, pool_name, hour, inputs_written[key])
        weights = weight_source(pool, inputs.engine, data.layout.calibration_file)
        result = attribute_pool_hour(data.layout.lake, pool, inputs, weights).ledger
        lake.save_ledger(data.layout.lake, result)
        written = lake.written_hashes(
            data.layout.lake, lake.ledger_files(data.layout.lake, pool_name, hour)
        )
        return {
            WRITTEN: dg.MetadataValue.json(written),
            "invoice_nano": result.amount_nano,
            "requests": result.request_costs.height,
            "ledger_lines": result.ledger_lines.height,
        }

    # Hours are independent and much of their work (numpy, polars, Parquet) runs without
    # the GIL, so a backfill attributes ATTRIBUTION_THREADS hours at a time.
    with ThreadPoolExecutor(max_workers=min(ATTRIBUTION_THREADS, len(runs))) as workers:
        for (*_, key), metadata in zip(
            runs, workers.map(lambda run: attribute(*run), runs), strict=True
        ):
            context.add_asset_metadata(metadata, partition_key=key)
    return dg.MaterializeResult()


def publish_ledgers(
    context: dg.AssetExecutionContext, data: StepledgerData, warehouse: DuckDBResource
) -> dg.MaterializeResult[None]:

    with open_warehouse(warehouse) as con:
        for hour, pool_name, key in pool_hours(context):
            result = lake.load_ledger(
                data.layout.lake, pool_name, hour, written_by(context, "attribution", key)
            )
            publish_hour(con, result)
            context.log.info(
                f"pool {pool_name} hour {hour_key(hour)}: {result.amount_nano} nano-dollars "
                "published"
            )
            context.add_asset_metadata(ledger_metadata(result), partition_key=key)
    return dg.MaterializeResult()


def build_pool_hour_assets(
    partitions: dg.PartitionsDefinition, pools: PoolsFile, state_pool: str | None = DUCKDB_POOL
) -> list[dg.AssetsDefinition]:
    # Every step requires `pool_hour_lock` (assets.resources.pool_hour_lock): the run holds its
    # pool-hours' lock from its first step to its last.
    # Each asset works through the run's pool-hours in order (one for an hourly run, a range
    # for a backfill) and reports each hour's figures on that hour's own materialization.
    def hourly_asset(**options: Any) -> Callable[[Callable[..., Any]], dg.AssetsDefinition]:
        def decorate(compute: Callable[..., Any]) -> dg.AssetsDefinition:
            # `backfill_policy` is a beta parameter in Dagster 1.13 (pinned); the tests assert
            # the runs a backfill plans with it.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", dg.BetaWarning)
                asset: dg.AssetsDefinition = dg.asset(
                    partitions_def=partitions,
                    backfill_policy=BACKFILL_POLICY,
                    group_name=GROUP,
                    **options,
                )(compute)
            return asset

        return decorate

    @hourly_asset(pool=state_pool)
    def step_log(
        context: dg.AssetExecutionContext,
        data: StepledgerData,
        warehouse: DuckDBResource,
        pool_hour_lock: dg.ResourceParam[None],
    ) -> dg.MaterializeResult[None]:
        """New step-log segments of the pool's replicas, decoded into the Parquet lake (each
        segment once, however often it is delivered); damage and drops recorded."""
        return ingest_step_log(context, data, warehouse, pools)

    @hourly_asset(pool=state_pool, deps=[step_log])
    def request_context(
        context: dg.AssetExecutionContext,
        data: StepledgerData,
        warehouse: DuckDBResource,
        pool_hour_lock: dg.ResourceParam[None],
    ) -> dg.MaterializeResult[None]:
        """The gateway's request context for the hour, API keys stored only as keyed hashes;
        then what the hour's attribution needs from the warehouse, saved to the lake."""
        return load_request_context(context, data, warehouse, pools)

    # Never in the state's pool: it reads only the lake, so the attribution of one pool-hour runs
    # while another pool-hour holds the warehouse.
    @hourly_asset(deps=[request_context])
    def attribution(
        context: dg.AssetExecutionContext,
        data: StepledgerData,
        pool_hour_lock: dg.ResourceParam[None],
    ) -> dg.MaterializeResult[None]:
        """Every measured step of the hour split among its requests, idle and headroom
        labelled, under the pool's policies: the hour's ledger, saved to the lake."""
        return attribute_hours(context, data, pools)

    @hourly_asset(pool=state_pool, deps=[attribution])
    def ledger(
        context: dg.AssetExecutionContext,
        data: StepledgerData,
        warehouse: DuckDBResource,
        pool_hour_lock: dg.ResourceParam[None],
    ) -> dg.MaterializeResult[None]:
        """The hour's invoice, ledger lines and request costs in the warehouse, replacing any
        earlier run of the hour in one transaction per hour."""
        return publish_ledgers(context, data, warehouse)

    return [step_log, request_context, attribution, ledger]
