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

# One row per (step, request holding KV blocks outside the batch).
HOLDER_STATES = ("waiting", "preempted")
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
