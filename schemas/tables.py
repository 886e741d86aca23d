"""Arrow schemas of the tables the pipeline passes between stages.

Every stage reads and writes these exact schemas, so a table written by the decoder can be
checked, stored as Parquet and read back by the allocator without guessing types. Time is
integer nanoseconds; money, from the allocator onward, is integer nano-dollars.
"""

from __future__ import annotations

import pyarrow as pa

# One row per step that the engine logged. `start_ns`/`end_ns` are the engine's monotonic
# clock; `start_utc_ns`/`end_utc_ns` place the step on the wall clock through the segment's
# (monotonic, wall) anchor pair, so a step can be put in its UTC hour.
STEPS = pa.schema(
    [
        ("pool", pa.string()),
        ("replica", pa.string()),
        ("segment_id", pa.string()),
        ("seq", pa.int64()),
        ("start_ns", pa.int64()),
        ("end_ns", pa.int64()),
        ("start_utc_ns", pa.int64()),
        ("end_utc_ns", pa.int64()),
        ("admission_blocked", pa.bool_()),
        ("free_blocks", pa.int32()),
        ("total_blocks", pa.int32()),
        ("num_slots", pa.int32()),
        ("num_holders", pa.int32()),
    ]
)

# One row per (step, request in the batch). `slot_index` is the position in the step, the
# allocator's deterministic tie-break.
SLOTS = pa.schema(
    [
        ("pool", pa.string()),
        ("replica", pa.string()),
        ("seq", pa.int64()),
        ("slot_index", pa.int32()),
        ("request_id", pa.string()),
        ("new_tokens", pa.int32()),
        ("context_tokens", pa.int32()),
        ("kv_blocks", pa.float64()),
        ("prompt_tokens", pa.int32()),
        ("prefix_hit_tokens", pa.int32()),
        ("spec_drafted", pa.int32()),
        ("spec_accepted", pa.int32()),
    ]
)

# One row per (step, request holding KV blocks outside the batch); its state is one of
# schemas.records.DECODED_HOLDER_STATES.
HOLDERS = pa.schema(
    [
        ("pool", pa.string()),
        ("replica", pa.string()),
        ("seq", pa.int64()),
        ("holder_index", pa.int32()),
        ("request_id", pa.string()),
        ("kv_blocks", pa.float64()),
        ("state", pa.string()),
    ]
)

# One row per segment file read: its header, and what it held.
SEGMENTS = pa.schema(
    [
        ("path", pa.string()),
        ("segment_id", pa.string()),
        ("format_version", pa.int32()),
        ("pool", pa.string()),
        ("replica", pa.string()),
        ("engine_name", pa.string()),
        ("engine_version", pa.string()),
        ("driver_version", pa.string()),
        ("model", pa.string()),
        ("gpu_type", pa.string()),
        ("gpus_per_replica", pa.int32()),
        ("kv_block_size", pa.int32()),
        ("mono_anchor_ns", pa.int64()),
        ("wall_anchor_ns", pa.int64()),
        ("first_seq", pa.int64()),
        ("last_seq", pa.int64()),
        ("steps", pa.int64()),
        ("dropped_steps", pa.int64()),
        ("bytes", pa.int64()),
    ]
)

# Damage found while decoding: what, where (file and byte offset) and which sequence
# numbers it may hide. `kind` is one of DAMAGE_KINDS.
DAMAGE_KINDS = (
    "torn_tail",
    "corrupt_frame",
    "unknown_version",
    "bad_header",
    "duplicate_segment",
    "divergent_copy",
)
DAMAGE = pa.schema(
    [
        ("path", pa.string()),
        ("kind", pa.string()),
        ("byte_offset", pa.int64()),
        ("byte_length", pa.int64()),
        ("first_seq", pa.int64()),
        ("last_seq", pa.int64()),
        ("detail", pa.string()),
    ]
)

# Steps the recorder dropped on purpose (its buffer was full), as written into the log.
DROPS = pa.schema(
    [
        ("pool", pa.string()),
        ("replica", pa.string()),
        ("first_seq", pa.int64()),
        ("last_seq", pa.int64()),
        ("steps", pa.int64()),
    ]
)


def _table(*columns: tuple[str, pa.DataType, bool]) -> pa.Schema:
    # (name, type, nullable): the warehouse's NOT NULL columns are the non-nullable fields.
    return pa.schema(
        [pa.field(name, dtype, nullable=nullable) for name, dtype, nullable in columns]
    )


_TS = pa.timestamp("us")
_TSTZ = pa.timestamp("us", tz="UTC")
_STR, _I64, _I32, _BOOL = pa.string(), pa.int64(), pa.int32(), pa.bool_()

# The warehouse (DuckLake) tables, column for column as sql/schema.sql creates them.
WAREHOUSE_TABLES: dict[str, pa.Schema] = {
    "schema_version": _table(
        ("version", _I32, False), ("applied_at", _TS, False), ("schema_sha256", _STR, True)
    ),
    "invoices": _table(
        ("hour", _TS, False),
        ("pool", _STR, False),
        ("gpus", _I32, False),
        ("usd_per_gpu_hour", pa.float64(), False),
        ("amount_nano", _I64, False),
    ),
    "ledger_lines": _table(
        ("hour", _TS, False),
        ("pool", _STR, False),
        ("tenant", _STR, False),
        ("feature", _STR, False),
        ("line_kind", _STR, False),
        ("amount_nano", _I64, False),
        ("requests", _I64, False),
        ("new_tokens", _I64, False),
        ("cached_tokens", _I64, False),
        ("weights_version", _STR, False),
        ("policy_version", _STR, False),
    ),
    "request_costs": _table(
        ("hour", _TS, False),
        ("pool", _STR, False),
        ("request_id", _STR, False),
        ("tenant", _STR, True),
        ("feature", _STR, True),
        ("api_key_id", _STR, True),
        ("compute_nano", _I64, False),
        ("kv_nano", _I64, False),
        ("amount_nano", _I64, False),
        ("steps", _I64, False),
        ("new_tokens", _I64, False),
        ("cached_tokens", _I64, False),
        ("prompt_tokens", _I64, False),
        ("output_tokens", _I64, False),
        ("line_kind", _STR, True),
    ),
    "reconciliation": _table(
        ("hour", _TS, False),
        ("pool", _STR, False),
        ("replica", _STR, True),
        ("check_name", _STR, False),
        ("passed", _BOOL, False),
        ("expected", _STR, False),
        ("observed", _STR, False),
        ("detail", _STR, False),
        ("severity", _STR, False),
        ("blocking", _BOOL, False),
        ("finding", _STR, False),
        ("checked_at", _TS, False),
    ),
    "alerts": _table(
        ("raised_at", _TS, False),
        ("severity", _STR, False),
        ("kind", _STR, False),
        ("hour", _TS, True),
        ("pool", _STR, True),
        ("replica", _STR, True),
        ("detail", _STR, False),
        ("dedup_key", _STR, True),
    ),
    "reruns": _table(
        ("rerun_at", _TSTZ, False),
        ("hour", _TS, False),
        ("pool", _STR, False),
        ("tenant", _STR, False),
        ("previous_nano", _I64, False),
        ("amount_nano", _I64, False),
        ("delta_nano", _I64, False),
        ("reason", _STR, False),
        ("previous_snapshot", _I64, False),
    ),
    "closed_months": _table(
        ("month", pa.date32(), False), ("snapshot", _I64, False), ("closed_at", _TSTZ, False)
    ),
    "invoice_numbers": _table(
        ("month", pa.date32(), False),
        ("tenant", _STR, False),
        ("invoice_id", _STR, False),
        ("amount_nano", _I64, False),
    ),
    "invoice_adjustments": _table(
        ("recorded_at", _TSTZ, False),
        ("hour", _TS, False),
        ("pool", _STR, False),
        ("tenant", _STR, False),
        ("charge_month", pa.date32(), False),
        ("invoice_month", pa.date32(), False),
        ("corrects_invoice_id", _STR, True),
        ("amount_nano", _I64, False),
        ("reason", _STR, False),
        ("previous_snapshot", _I64, False),
    ),
}

# What the live path (pipeline.live) stamps on each row it prices.
_PRICED = (("batch_id", _STR, False), ("priced_at", _TS, False))
WAREHOUSE_TABLES["provisional_request_costs"] = pa.schema(
    [
        *WAREHOUSE_TABLES["request_costs"].remove(
            WAREHOUSE_TABLES["request_costs"].get_field_index("line_kind")
        ),
        pa.field("line_kind", _STR, nullable=False),
        pa.field("last_step_end_utc_ns", _I64, nullable=False),
        *_table(*_PRICED),
    ]
)
WAREHOUSE_TABLES["provisional_lines"] = pa.schema(
    [
        *WAREHOUSE_TABLES["ledger_lines"].remove(
            WAREHOUSE_TABLES["ledger_lines"].get_field_index("requests")
        ),
        *_table(*_PRICED),
    ]
)
WAREHOUSE_TABLES["live_segments"] = _table(
    ("path", _STR, False),
    ("segment_id", _STR, False),
    ("pool", _STR, False),
    ("replica", _STR, False),
    ("steps", _I64, False),
    *_PRICED,
)
WAREHOUSE_TABLES["published_digests"] = _table(
    ("hour", _TS, False), ("pool", _STR, False), ("rows_sha256", _STR, False)
)
WAREHOUSE_TABLES["published_files"] = _table(
    ("hour", _TS, False),
    ("pool", _STR, False),
    ("table_name", _STR, False),
    ("path", _STR, False),
    ("sha256", _STR, False),
)

# The pipeline's bookkeeping tables (sql/pipeline_state.sql), in its own DuckDB file.
PIPELINE_STATE_TABLES: dict[str, pa.Schema] = {
    "state_schema": _table(("sha256", _STR, False), ("applied_at", _TS, False)),
    "request_context": _table(
        ("request_id", _STR, False),
        ("tenant", _STR, False),
        ("feature", _STR, False),
        ("api_key_id", _STR, False),
        ("retry_of", _STR, True),
        ("retry_cause", _STR, True),
        ("received_at", _TS, False),
        ("source_file", _STR, False),
    ),
    "context_files": _table(
        ("path", _STR, False),
        ("sha256", _STR, False),
        ("requests", _I64, False),
        ("loaded_at", _TS, False),
    ),
    "segment_files": _table(
        ("path", _STR, False),
        ("sha256", _STR, False),
        ("bytes", _I64, False),
        ("status", _STR, False),
        ("batch_id", _STR, False),
        ("ingested_at", _TS, False),
    ),
    "segments": _table(
        ("path", _STR, False),
        ("segment_id", _STR, False),
        ("sha256", _STR, False),
        *((f.name, f.type, False) for f in SEGMENTS if f.name not in ("path", "segment_id")),
        ("batch_id", _STR, False),
    ),
    "damage": _table(
        *((f.name, f.type, f.name not in ("path", "kind", "detail")) for f in DAMAGE),
        ("batch_id", _STR, False),
    ),
    "drops": _table(*((f.name, f.type, False) for f in DROPS), ("batch_id", _STR, False)),
    "clock_jumps": _table(
        ("segment_id", _STR, False),
        ("path", _STR, False),
        ("pool", _STR, False),
        ("replica", _STR, False),
        ("first_seq", _I64, False),
        ("previous_segment_id", _STR, False),
        ("placed_shift_ns", _I64, False),
        ("jump_ns", _I64, False),
        ("first_start_utc_ns", _I64, False),
        ("batch_id", _STR, False),
    ),
    "lake_files": _table(
        ("path", _STR, False),
        ("sha256", _STR, False),
        ("batch_id", _STR, False),
    ),
    "alert_outbox": _table(
        ("dedup_key", _STR, False),
        ("alert", _STR, False),
        ("enqueued_at", _TS, False),
        ("attempts", _I64, False),
        ("next_attempt_at", _TS, False),
        ("last_error", _STR, True),
        ("delivered_at", _TS, True),
    ),
}
