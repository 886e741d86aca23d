"""Encoding of segment files (see schemas/STEP_RECORDS.md): preamble, frames, step payloads."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.records import (
    DROP_STRUCT,
    FILE_MAGIC,
    FORMAT_VERSION,
    FRAME_CHECKED_BYTES,
    FRAME_MARKER,
    FRAME_PREFIX,
    HOLDER_DTYPE,
    INT32_MAX,
    MAX_FRAME_PAYLOAD,
    PREAMBLE,
    SLOT_DTYPE,
    STEP_STRUCT,
    FrameKind,
    HeaderFrame,
)
from schemas.tables import HOLDER_STATES

_HOLDER_STATE_VALUES = pa.array(HOLDER_STATES, pa.string())


class InvalidStep(ValueError):
    """A step's arguments cannot be recorded faithfully; the message names the field."""


def preamble() -> bytes:
    return PREAMBLE.pack(FILE_MAGIC, FORMAT_VERSION)


def frame_crc(prefix_checked: bytes | memoryview, payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(prefix_checked))


def frame(kind: FrameKind, payload: bytes) -> bytes:
    if len(payload) > MAX_FRAME_PAYLOAD:
        raise InvalidStep(f"a {kind.name.lower()} frame of {len(payload)} bytes exceeds {MAX_FRAME_PAYLOAD}")
    checked = FRAME_PREFIX.pack(FRAME_MARKER, kind, 0, 0, len(payload), 0)[:FRAME_CHECKED_BYTES]
    return checked + frame_crc(checked, payload).to_bytes(4, "little") + payload


def header_frame(header: HeaderFrame) -> bytes:
    return frame(FrameKind.HEADER, header.model_dump_json().encode())


def drop_frame(first_seq: int, last_seq: int) -> bytes:
    return frame(FrameKind.DROP, DROP_STRUCT.pack(first_seq, last_seq))


def _counts(name: str, values: object, n: int) -> np.ndarray:
    array = np.asarray(values)
    if array.shape != (n,):
        raise InvalidStep(f"{name}: expected {n} values (one per entry), got shape {array.shape}")
    if n == 0:
        return array
    if array.dtype.kind not in "iu":
        raise InvalidStep(f"{name}: integers required, got dtype {array.dtype}")
    low, high = int(array.min()), int(array.max())
    if low < 0 or high > INT32_MAX:
        raise InvalidStep(f"{name}: values must lie in [0, {INT32_MAX}], got [{low}, {high}]")
    return array


def _blocks(name: str, values: object, n: int) -> np.ndarray:
    array = np.asarray(values)
    if array.shape != (n,):
        raise InvalidStep(f"{name}: expected {n} values (one per entry), got shape {array.shape}")
    if n == 0:
        return array
    if array.dtype.kind not in "iuf":
        raise InvalidStep(f"{name}: numbers required, got dtype {array.dtype}")
    if not np.all(np.isfinite(array)) or array.min() < 0:
        raise InvalidStep(f"{name}: KV blocks must be finite and >= 0")
    return array


def _ids(name: str, values: Sequence[str]) -> tuple[np.ndarray, bytes]:
    """Byte length of each id and the concatenated UTF-8, without a Python loop per id."""
    try:
        array = pa.array(values, pa.string())
    except (pa.ArrowException, TypeError) as err:
        raise InvalidStep(f"{name}: strings required ({err})") from err
    if array.null_count:
        raise InvalidStep(f"{name}: {array.null_count} ids are None")
    n = len(array)
    offsets = np.frombuffer(array.buffers()[1], np.int32, count=n + 1, offset=array.offset * 4)
    data = array.buffers()[2]
    blob = data[offsets[0] : offsets[-1]].to_pybytes() if data is not None else b""
    return np.diff(offsets), blob


def step_frame(
    seq: int,
    start_ns: int,
    end_ns: int,
    request_ids: Sequence[str],
    new_tokens: object,
    context_tokens: object,
    kv_blocks: object,
    prompt_tokens: object,
    prefix_hit_tokens: object,
    spec_drafted: object,
    spec_accepted: object,
    holder_ids: Sequence[str],
    holder_blocks: object,
    holder_states: Sequence[str],
    admission_blocked: bool,
    free_blocks: int,
    total_blocks: int,
) -> bytes:
    """One step frame; raises InvalidStep naming the offending field."""
    if end_ns < start_ns:
        raise InvalidStep(f"end_ns {end_ns} precedes start_ns {start_ns}")
    for name, value in (("free_blocks", free_blocks), ("total_blocks", total_blocks)):
        if not isinstance(value, (int, np.integer)) or not 0 <= value <= INT32_MAX:
            raise InvalidStep(f"{name}: {value} outside [0, {INT32_MAX}]")
    id_lengths, id_blob = _ids("request_ids", request_ids)
    n = len(id_lengths)
    slots = np.empty(n, SLOT_DTYPE)
    slots["request_id_len"] = id_lengths
    for name, values in (
        ("new_tokens", new_tokens),
        ("context_tokens", context_tokens),
        ("prompt_tokens", prompt_tokens),
        ("prefix_hit_tokens", prefix_hit_tokens),
        ("spec_drafted", spec_drafted),
        ("spec_accepted", spec_accepted),
    ):
        slots[name] = _counts(name, values, n)
    slots["kv_blocks"] = _blocks("kv_blocks", kv_blocks, n)
    if np.any(slots["spec_drafted"] > slots["new_tokens"]):
        raise InvalidStep("spec_drafted exceeds new_tokens (drafts are part of the step's new tokens)")
    if np.any(slots["spec_accepted"] > slots["spec_drafted"]):
        raise InvalidStep("spec_accepted exceeds spec_drafted")

    holder_lengths, holder_blob = _ids("holder_ids", holder_ids)
    n_holders = len(holder_lengths)
    holders = np.empty(n_holders, HOLDER_DTYPE)
    holders["request_id_len"] = holder_lengths
    holders["kv_blocks"] = _blocks("holder_blocks", holder_blocks, n_holders)
    if len(holder_states) != n_holders:
        raise InvalidStep(f"holder_states: expected {n_holders} values, got {len(holder_states)}")
    if n_holders:
        codes = pc.index_in(pa.array(holder_states, pa.string()), value_set=_HOLDER_STATE_VALUES)
        if codes.null_count:
            unknown = sorted({s for s, c in zip(holder_states, codes.to_pylist()) if c is None})
            raise InvalidStep(f"holder_states: unknown states {unknown}; expected one of {HOLDER_STATES}")
        holders["state"] = codes.to_numpy()

    try:
        fixed = STEP_STRUCT.pack(
            seq,
            start_ns,
            end_ns,
            free_blocks,
            total_blocks,
            n,
            n_holders,
            len(id_blob),
            len(holder_blob),
            bool(admission_blocked),
        )
    except struct.error as err:
        raise InvalidStep(f"step fields do not fit the record (seq, start_ns, end_ns are int64): {err}") from err
    return frame(FrameKind.STEP, b"".join((fixed, slots.tobytes(), id_blob, holders.tobytes(), holder_blob)))
