"""The hourly chain of one pool: step log -> request context -> charges -> ledger.

Each asset is a thin call into `pipeline/`. Every asset that touches the DuckDB file runs in
the `duckdb` concurrency pool (limit 1 in dagster_home/dagster.yaml): DuckDB has one writer.
"""

# No `from __future__ import annotations`: Dagster checks the `context` annotation as an
# object, and a postponed (string) annotation fails that check.

import dagster as dg
from dagster_duckdb import DuckDBResource

from assets.partitions import hour_and_pool
from assets.resources import StepledgerData, open_warehouse
from pipeline import context as gateway_context
from pipeline import hourly
from pipeline.ingest import ingest_outbox
from pipeline.warehouse import hour_key
from schemas.config import PoolsFile

GROUP = "pool_hour"
DUCKDB_POOL = "duckdb"


def build_pool_hour_assets(partitions: dg.PartitionsDefinition, pools: PoolsFile) -> list[dg.AssetsDefinition]:
    @dg.asset(partitions_def=partitions, group_name=GROUP, pool=DUCKDB_POOL)
    def step_log(context: dg.AssetExecutionContext, data: StepledgerData, warehouse: DuckDBResource) -> dg.MaterializeResult:
        """New step-log segments of the pool's replicas, decoded into the Parquet lake (each
        segment once, however often it is delivered); damage and drops recorded."""
        _, pool_name = hour_and_pool(context)
        replicas = [r.id for r in pools.pool(pool_name).replicas]
        with open_warehouse(warehouse) as con:
            report = ingest_outbox(con, data.outbox, data.lake, replicas=replicas)
        return dg.MaterializeResult(
            metadata={
                "ingested_files": len(report.ingested_files),
                "duplicate_files": len(report.duplicate_files),
                "steps": report.steps,
                "damage": report.damage,
                "hours": sorted(h for p, h in report.partitions),
            }
        )

    @dg.asset(partitions_def=partitions, group_name=GROUP, pool=DUCKDB_POOL, deps=[step_log])
    def request_context(context: dg.AssetExecutionContext, data: StepledgerData, warehouse: DuckDBResource) -> dg.MaterializeResult:
        """The gateway's request context for the hour, API keys stored only as keyed hashes."""
        hour, _ = hour_and_pool(context)
        files = gateway_context.gateway_files_for_hour(data.gateway, hour)
        with open_warehouse(warehouse) as con:
            report = gateway_context.load_gateway_files(con, files, gateway_context.key_salt())
        return dg.MaterializeResult(
            metadata={"loaded_files": len(report.loaded), "unchanged_files": len(report.unchanged), "requests": report.requests}
        )

    @dg.asset(partitions_def=partitions, group_name=GROUP, pool=DUCKDB_POOL, deps=[request_context])
    def charges(context: dg.AssetExecutionContext, data: StepledgerData, warehouse: DuckDBResource) -> dg.MaterializeResult:
        """Every measured step of the hour split among its requests, idle and headroom
        labelled, under the pool's policies; saved to the lake."""
        hour, pool_name = hour_and_pool(context)
        pool = pools.pool(pool_name)
        with open_warehouse(warehouse) as con:
            result = hourly.charge_hour(con, data.lake, pool, hour, hourly.weight_source(con, pool, data.root))
        hourly.save_charges(data.lake, result)
        return dg.MaterializeResult(
            metadata={
                "invoice_nano": result.amount_nano,
                "requests": result.request_costs.height,
                "ledger_lines": result.ledger_lines.height,
            }
        )

    @dg.asset(partitions_def=partitions, group_name=GROUP, pool=DUCKDB_POOL, deps=[charges])
    def ledger(context: dg.AssetExecutionContext, data: StepledgerData, warehouse: DuckDBResource) -> dg.MaterializeResult:
        """The hour's invoice, ledger lines and request costs in the warehouse, replacing any
        earlier run of the hour in one transaction."""
        hour, pool_name = hour_and_pool(context)
        result = hourly.load_charges(data.lake, pool_name, hour)
        with open_warehouse(warehouse) as con:
            hourly.publish_hour(con, result)
        context.log.info(f"pool {pool_name} hour {hour_key(hour)}: {result.amount_nano} nano-dollars published")
        return dg.MaterializeResult(metadata={"amount_nano": result.amount_nano})

    return [step_log, request_context, charges, ledger]
