"""The step log's binary layout: one source of truth for the writer, the decoder and the docs.

A segment file is a 16-byte preamble (magic, format version) followed by frames. Every frame is
a 16-byte prefix (marker, kind, payload length, CRC32) and a payload. The first frame is the
segment header (JSON, so it can name its own field layout); the others are steps and drops.
Fixed-size packed records (little-endian) carry the numbers, so the decoder can read a whole
segment's slots with one `np.frombuffer`. `schemas/STEP_RECORDS.md` describes it byte by byte.

The engine's process loads this module with the hook (pipeline/hook), so it imports the
standard library and numpy only (tests/test_layering.py): the header is a checked dataclass,
not a pydantic model.
"""

from __future__ import annotations

import json
import reprlib
import struct
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from enum import IntEnum
from types import MappingProxyType
from typing import Any, Self, TypeGuard

import numpy as np

from schemas.errors import InputError

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

# A holder's state is stored as its code, the position in DECODED_HOLDER_STATES. A recorder
# writes HOLDER_STATES only: vLLM frees a preempted request's blocks, so a preempted request
# holds nothing. "preempted" (code 1) is legacy, read from segments already written and never
# written again.
HOLDER_STATES = ("waiting",)
DECODED_HOLDER_STATES = (*HOLDER_STATES, "preempted")


class FieldError(InputError):
    """A JSON record (segment header, replica descriptor) misses a field, has one it does not
    know, or holds a value of the wrong kind; the message names the field."""


@dataclass(frozen=True)
class FieldKind:
    """What a field of a JSON record must hold, and how its error says so."""

    wanted: str
    accepts: Callable[[object], bool]
    # Left out of the JSON while null: a field added after records without it were read by
    # decoders that refuse an unknown one.
    omitted_when_null: bool = False


def _is_text(value: object) -> bool:
    # Lone surrogates decode from JSON escapes but cannot be written back as UTF-8.
    if not isinstance(value, str):
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def _is_integer(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_layout(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(part, str)
        and isinstance(pairs, list)
        and all(isinstance(p, list) and all(isinstance(s, str) for s in p) for p in pairs)
        for part, pairs in value.items()
    )


def field_kind(
    wanted: str, accepts: Callable[[object], bool], *, omitted_when_null: bool = False
) -> Mapping[str, FieldKind]:
    """`dataclasses.field` metadata giving a JSON record's field its kind."""
    return MappingProxyType({"kind": FieldKind(wanted, accepts, omitted_when_null)})


NAME = field_kind("a non-empty string", lambda v: _is_text(v) and v != "")
TEXT = field_kind("a string", _is_text)
OPTIONAL_TEXT = field_kind("a string or null", lambda v: v is None or _is_text(v))
COUNT = field_kind(
    f"an integer in [1, {INT32_MAX}]", lambda v: _is_integer(v) and 0 < v <= INT32_MAX
)
INTEGER = field_kind("an integer", _is_integer)
# The parallel layout in a segment header (SegmentHeader.tp_size and after).
LAYOUT_COUNT = field_kind(
    f"an integer in [1, {INT32_MAX}] or null",
    lambda v: v is None or (_is_integer(v) and 0 < v <= INT32_MAX),
    omitted_when_null=True,
)
LAYOUT_INDEX = field_kind(
    f"an integer in [0, {INT32_MAX}) or null",
    lambda v: v is None or (_is_integer(v) and 0 <= v < INT32_MAX),
    omitted_when_null=True,
)
LAYOUT_OBJECT = field_kind("an object of lists of [name, code] pairs", _is_layout)


@dataclass(frozen=True, kw_only=True, slots=True)
class JsonRecord:
    """A frozen record written and read as one compact JSON object, each field checked against
    the kind in its metadata (see `field_kind`) whether built in Python or read from JSON."""

    def __post_init__(self) -> None:
        for spec in fields(self):
            kind: FieldKind = spec.metadata["kind"]
            value = getattr(self, spec.name)
            if not kind.accepts(value):
                raise FieldError(
                    f"field {spec.name}: expected {kind.wanted}, got {reprlib.repr(value)}"
                )

    @classmethod
    def from_mapping(cls, data: object) -> Self:
        """The record of a decoded JSON object: every field it requires, none it does not know."""
        if not isinstance(data, dict):
            raise FieldError(f"expected a JSON object, got {type(data).__name__}")
        specs = fields(cls)
        known = {spec.name for spec in specs}
        unknown = [name for name in data if name not in known]
        if unknown:
            raise FieldError(f"field {unknown[0]}: not a field of {cls.__name__}")
        missing = [s.name for s in specs if s.name not in data and s.default is MISSING]
        if missing:
            raise FieldError(f"field {missing[0]}: required")
        return cls(**data)

    @classmethod
    def from_json(cls, data: bytes | str) -> Self:
        try:
            decoded = json.loads(data)
        except ValueError as err:  # JSONDecodeError, or bytes that are not UTF-8
            raise FieldError(f"not JSON: {err}") from err
        return cls.from_mapping(decoded)

    def as_dict(self) -> dict[str, Any]:
        return {
            spec.name: value
            for spec in fields(self)
            if (value := getattr(self, spec.name)) is not None
            or not spec.metadata["kind"].omitted_when_null
        }

    def to_json(self) -> bytes:
        """Compact JSON, fields in declaration order, text as UTF-8 (not escaped)."""
        return json.dumps(self.as_dict(), ensure_ascii=False, separators=(",", ":")).encode()


def rank_stream_id(replica: str, attn_dp_rank: int) -> str:
    """The step stream of one attention data-parallel rank of `replica`: each rank schedules
    its own batches on its own share of the replica's GPUs, so the pipeline bills each rank's
    stream as a replica of its own (`schemas.config.Pool.streams`)."""
    return f"{replica}.dp{attn_dp_rank}"


@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentHeader(JsonRecord):
    """What a replica says about itself once per segment."""

    pool: str = field(metadata=NAME)
    replica: str = field(metadata=NAME)
    engine_name: str = field(metadata=TEXT)
    engine_version: str = field(metadata=TEXT)
    driver_version: str = field(metadata=TEXT)
    model: str = field(metadata=TEXT)
    gpu_type: str = field(metadata=TEXT)
    gpus_per_replica: int = field(metadata=COUNT)
    kv_block_size: int = field(metadata=COUNT)
    # What the engine itself reports, beside the pool's names above (which pricing and
    # calibration key on): the model it loaded and its GPU (None where it names none, and in
    # segments written before these fields existed).
    engine_model: str | None = field(default=None, metadata=OPTIONAL_TEXT)
    engine_device: str | None = field(default=None, metadata=OPTIONAL_TEXT)
    # The engine's parallel layout, where its hook reports it (absent otherwise, and in
    # segments written before these fields existed): tensor and expert parallel sizes over the
    # whole replica, and with attention data parallelism the rank whose batches this stream
    # records and the rank count (`replica` is then the rank's stream, `rank_stream_id`, and
    # `gpus_per_replica` its share of the replica's GPUs).
    tp_size: int | None = field(default=None, metadata=LAYOUT_COUNT)
    ep_size: int | None = field(default=None, metadata=LAYOUT_COUNT)
    attn_dp_rank: int | None = field(default=None, metadata=LAYOUT_INDEX)
    attn_dp_size: int | None = field(default=None, metadata=LAYOUT_COUNT)


@dataclass(frozen=True, kw_only=True, slots=True)
class HeaderFrame(SegmentHeader):
    """The header frame's JSON: the replica's header plus what identifies and anchors the segment."""

    format_version: int = field(metadata=INTEGER)
    segment_id: str = field(metadata=NAME)
    # Sequence number of the segment's first frame (step or drop): bounds damage at its start.
    first_seq: int = field(metadata=INTEGER)
    # Read from the monotonic and wall clocks together when the segment opened: a step's UTC
    # time is wall_anchor_ns + (start_ns - mono_anchor_ns).
    mono_anchor_ns: int = field(metadata=INTEGER)
    wall_anchor_ns: int = field(metadata=INTEGER)
    layout: dict[str, list[list[str]]] = field(metadata=LAYOUT_OBJECT)
