"""The step log's binary layout: one source of truth for the writer, the decoder and the docs.

A segment file is a 16-byte preamble (magic, format version) followed by frames. Every frame is
a 16-byte prefix (marker, kind, payload length, CRC32) and a payload. The first frame is the
segment header (JSON, so it can name its own field layout); the others are steps and drops.
Fixed-size packed records (little-endian) carry the numbers, so the decoder can read a whole
segment's slots with one `np.frombuffer`. `schemas/STEP_RECORDS.md` describes it byte by byte.
"""

from __future__ import annotations

import struct
from enum import IntEnum

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

FILE_MAGIC = b"STEPLOG\x00"
FORMAT_VERSION = 1
# magic, format version, 4 reserved bytes that must be zero.
PREAMBLE = struct.Struct("<8sI4x")

FRAME_MARKER = b"\xf5SLF"
# marker, kind, flags (0), reserved (0), payload length, CRC32 of prefix bytes 0..11 + payload.
FRAME_PREFIX = struct.Struct("<4sBBHII")
FRAME_CHECKED_BYTES = 12
# No legitimate frame comes near this; a larger length field is damage, not a reason to scan.
MAX_FRAME_PAYLOAD = 1 << 30


class FrameKind(IntEnum):
    HEADER = 1
    STEP = 2
    DROP = 3


# (field name, struct code). Struct codes map onto numpy dtypes so writer and decoder agree.
Layout = tuple[tuple[str, str], ...]

STEP_FIELDS: Layout = (
    ("seq", "q"),
    ("start_ns", "q"),
    ("end_ns", "q"),
    ("free_blocks", "i"),
    ("total_blocks", "i"),
    ("num_slots", "I"),
    ("num_holders", "I"),
    ("request_id_bytes", "I"),
    ("holder_id_bytes", "I"),
    ("admission_blocked", "B"),
)
SLOT_FIELDS: Layout = (
    ("request_id_len", "I"),
    ("new_tokens", "i"),
    ("context_tokens", "i"),
    ("prompt_tokens", "i"),
    ("prefix_hit_tokens", "i"),
    ("spec_drafted", "i"),
    ("spec_accepted", "i"),
    ("kv_blocks", "d"),
)
HOLDER_FIELDS: Layout = (
    ("request_id_len", "I"),
    ("state", "B"),
    ("kv_blocks", "d"),
)
# A slot's measured numbers by name, in the order the hook passes them to
# `StepRecorder.record_step` (after the request id) and the lake's slot table holds them.
SLOT_COLUMNS = (
    "new_tokens",
    "context_tokens",
    "kv_blocks",
    "prompt_tokens",
    "prefix_hit_tokens",
    "spec_drafted",
    "spec_accepted",
)
DROP_FIELDS: Layout = (
    ("first_seq", "q"),
    ("last_seq", "q"),
)

_NUMPY_CODES = {"q": "<i8", "i": "<i4", "I": "<u4", "B": "u1", "d": "<f8"}


def struct_of(layout: Layout) -> struct.Struct:
    return struct.Struct("<" + "".join(code for _, code in layout))


def dtype_of(layout: Layout) -> np.dtype:
    """A packed structured dtype with the same bytes as `struct_of(layout)`."""
    return np.dtype([(name, _NUMPY_CODES[code]) for name, code in layout])


STEP_STRUCT = struct_of(STEP_FIELDS)
DROP_STRUCT = struct_of(DROP_FIELDS)
STEP_DTYPE = dtype_of(STEP_FIELDS)
SLOT_DTYPE = dtype_of(SLOT_FIELDS)
HOLDER_DTYPE = dtype_of(HOLDER_FIELDS)

# The layout a version-1 header must declare, as it appears in the header JSON.
LAYOUT = {
    "step": [list(field) for field in STEP_FIELDS],
    "slot": [list(field) for field in SLOT_FIELDS],
    "holder": [list(field) for field in HOLDER_FIELDS],
    "drop": [list(field) for field in DROP_FIELDS],
}

INT32_MAX = 2**31 - 1


class SegmentHeader(BaseModel):
    """What a replica says about itself once per segment."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pool: str = Field(min_length=1)
    replica: str = Field(min_length=1)
    engine_name: str
    engine_version: str
    driver_version: str
    model: str
    gpu_type: str
    gpus_per_replica: int = Field(gt=0, le=INT32_MAX)
    kv_block_size: int = Field(gt=0, le=INT32_MAX)
    # What the engine itself reports, beside the pool's names above (which pricing and
    # calibration key on): the model it loaded and its GPU (None where it names none, and in
    # segments written before these fields existed).
    engine_model: str | None = None
    engine_device: str | None = None


class HeaderFrame(SegmentHeader):
    """The header frame's JSON: the replica's header plus what identifies and anchors the segment."""

    format_version: int
    segment_id: str = Field(min_length=1)
    # Sequence number of the segment's first frame (step or drop): bounds damage at its start.
    first_seq: int
    # Read from the monotonic and wall clocks together when the segment opened: a step's UTC
    # time is wall_anchor_ns + (start_ns - mono_anchor_ns).
    mono_anchor_ns: int
    wall_anchor_ns: int
    layout: dict[str, list[list[str]]]
