"""Encoding of segment files (see schemas/STEP_RECORDS.md): preamble, frames, step payloads."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from itertools import chain, repeat
from typing import Any

import numpy as np

from schemas.errors import InputError
from schemas.records import (
    DROP_STRUCT,
    FILE_MAGIC,
    FORMAT_VERSION,
    FRAME_CHECKED_BYTES,
    FRAME_MARKER,
    FRAME_PREFIX,
    HOLDER_DTYPE,
    HOLDER_STATES,
    INT32_MAX,
    MAX_FRAME_PAYLOAD,
    PREAMBLE,
    SLOT_DTYPE,
    STEP_DTYPE,
    STEP_STRUCT,
    FrameKind,
    HeaderFrame,
)

_HOLDER_STATE_CODES = {state: code for code, state in enumerate(HOLDER_STATES)}
_UNKNOWN_STATE = -1


class InvalidStep(InputError):
    """A step's arguments cannot be recorded faithfully; the message names the field."""


def preamble() -> bytes:
    return PREAMBLE.pack(FILE_MAGIC, FORMAT_VERSION)


def frame_crc(prefix_checked: bytes | memoryview, payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(prefix_checked))


def frame(kind: FrameKind, payload: bytes) -> bytes:
    if len(payload) > MAX_FRAME_PAYLOAD:
        raise InvalidStep(
            f"a {kind.name.lower()} frame of {len(payload)} bytes exceeds {MAX_FRAME_PAYLOAD}"
        )
    checked = FRAME_PREFIX.pack(FRAME_MARKER, kind, 0, 0, len(payload), 0)[:FRAME_CHECKED_BYTES]
    return checked + frame_crc(checked, payload).to_bytes(4, "little") + payload


def header_frame(header: HeaderFrame) -> bytes:
    return frame(FrameKind.HEADER, header.to_json())


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


def _id_lengths(ids: Sequence[str]) -> np.ndarray:
    """Byte length of each id's UTF-8, without a Python loop per id: the ids are joined by NUL,
    which UTF-8 encodes as the byte 0 and as no part of another character, so the gaps between
    the 0 bytes are the lengths. Raises TypeError for an id that is no string and
    UnicodeEncodeError for one that is no text."""
    separated = "\0".join(ids).encode()
    ends = np.flatnonzero(np.frombuffer(separated, np.uint8) == 0)
    if len(ids) == 0 or len(ends) != len(ids) - 1:
        # No ids, or an id holds a NUL itself.
        return np.fromiter(map(len, map(str.encode, ids)), np.int64, len(ids))
    offsets = np.empty(len(ids) + 1, np.int64)
    offsets[0] = 0
    offsets[1:-1] = ends - np.arange(len(ends))
    offsets[-1] = len(separated) - len(ends)
    return np.diff(offsets)


def _ids(name: str, values: Sequence[str]) -> tuple[np.ndarray, bytes]:
    """Byte length of each id and the ids' UTF-8 concatenated; InvalidStep names the field."""
    if isinstance(values, (str, bytes)):
        raise InvalidStep(
            f"{name}: a sequence of strings required, got one {type(values).__name__}"
        )
    try:
        return _id_lengths(values), "".join(values).encode()
    except TypeError as err:
        given: list[object] = list(values)
        nones = given.count(None)
        if nones:
            raise InvalidStep(f"{name}: {nones} ids are None") from err
        raise InvalidStep(f"{name}: strings required ({err})") from err
    except UnicodeEncodeError as err:
        raise InvalidStep(f"{name}: ids must be valid text ({err})") from err


def _state_codes(states: Sequence[str]) -> np.ndarray:
    """Each holder state's code, _UNKNOWN_STATE for a state the recorder does not write."""
    codes = map(_HOLDER_STATE_CODES.get, states, repeat(_UNKNOWN_STATE))
    return np.fromiter(codes, np.int64, len(states))


def _step_slots(
    request_ids: Sequence[str], counts: Sequence[tuple[str, object]], kv_blocks: object
) -> tuple[np.ndarray, bytes]:
    """step_frame's slot array and its ids' UTF-8; `counts`: each count field and its values."""
    id_lengths, id_blob = _ids("request_ids", request_ids)
    n = len(id_lengths)
    slots = np.empty(n, SLOT_DTYPE)
    slots["request_id_len"] = id_lengths
    for name, values in counts:
        slots[name] = _counts(name, values, n)
    slots["kv_blocks"] = _blocks("kv_blocks", kv_blocks, n)
    if np.any(slots["spec_drafted"] > slots["new_tokens"]):
        raise InvalidStep(
            "spec_drafted exceeds new_tokens (drafts are part of the step's new tokens)"
        )
    if np.any(slots["spec_accepted"] > slots["spec_drafted"]):
        raise InvalidStep("spec_accepted exceeds spec_drafted")
    return slots, id_blob


def _step_holders(
    holder_ids: Sequence[str], holder_blocks: object, holder_states: Sequence[str]
) -> tuple[np.ndarray, bytes]:
    """step_frame's holder array and its holders' ids as UTF-8."""
    holder_lengths, holder_blob = _ids("holder_ids", holder_ids)
    n_holders = len(holder_lengths)
    holders = np.empty(n_holders, HOLDER_DTYPE)
    holders["request_id_len"] = holder_lengths
    holders["kv_blocks"] = _blocks("holder_blocks", holder_blocks, n_holders)
    if len(holder_states) != n_holders:
        raise InvalidStep(f"holder_states: expected {n_holders} values, got {len(holder_states)}")
    if n_holders:
        codes = _state_codes(holder_states)
        if np.any(codes == _UNKNOWN_STATE):
            unknown = sorted({s for s in holder_states if s not in _HOLDER_STATE_CODES}, key=str)
            raise InvalidStep(
                f"holder_states: unknown states {unknown}; expected one of {HOLDER_STATES}"
            )
        holders["state"] = codes
    return holders, holder_blob


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
    counts = (
        ("new_tokens", new_tokens),
        ("context_tokens", context_tokens),
        ("prompt_tokens", prompt_tokens),
        ("prefix_hit_tokens", prefix_hit_tokens),
        ("spec_drafted", spec_drafted),
        ("spec_accepted", spec_accepted),
    )
    slots, id_blob = _step_slots(request_ids, counts, kv_blocks)
    holders, holder_blob = _step_holders(holder_ids, holder_blocks, holder_states)
    try:
        fixed = STEP_STRUCT.pack(
            seq,
            start_ns,
            end_ns,
            free_blocks,
            total_blocks,
            len(slots),
            len(holders),
            len(id_blob),
            len(holder_blob),
            bool(admission_blocked),
        )
    except struct.error as err:
        raise InvalidStep(
            f"step fields do not fit the record (seq, start_ns, end_ns are int64): {err}"
        ) from err
    return frame(
        FrameKind.STEP, b"".join((fixed, slots.tobytes(), id_blob, holders.tobytes(), holder_blob))
    )


# Positions in a step tuple: step_frame's positional arguments, in order.
_SEQ, _START, _END, _REQUEST_IDS = 0, 1, 2, 3
_COUNT_COLUMNS = (
    (4, "new_tokens"),
    (5, "context_tokens"),
    (7, "prompt_tokens"),
    (8, "prefix_hit_tokens"),
    (9, "spec_drafted"),
    (10, "spec_accepted"),
)
_KV_BLOCKS, _HOLDER_IDS, _HOLDER_BLOCKS, _HOLDER_STATES = 6, 11, 12, 13
_ADMISSION_BLOCKED, _FREE_BLOCKS, _TOTAL_BLOCKS = 14, 15, 16
_STEP_PAYLOAD_FIXED = STEP_STRUCT.size
# Steps whose ids are measured together: their joined ids stay small enough (some hundred
# kilobytes) for the allocator to hand out again, where a whole batch's would fault in fresh
# pages on every batch, which costs more than measuring them.
_ID_CHUNK_STEPS = 16


def step_frames(steps: Sequence[tuple[Any, ...]]) -> list[bytes | Exception]:
    """Frames for many steps, each given as step_frame's positional arguments: the frame's
    bytes, or the error that makes the step unrecordable (InvalidStep, TypeError, ValueError).

    The bytes equal step_frame's. Numpy's fixed cost per call dwarfs the work of one step,
    so the whole batch is checked and packed column by column; a batch holding anything the
    vectorised checks do not accept is encoded step by step, which names each bad field.
    """
    frames = _batch_frames(steps)
    if frames is not None:
        return frames
    encoded: list[bytes | Exception] = []
    for step in steps:
        try:
            encoded.append(step_frame(*step))
        except (InvalidStep, TypeError, ValueError) as err:
            encoded.append(err)
    return encoded


def _batch_column(columns: Sequence[Any], lengths: list[int], kinds: str) -> np.ndarray | None:
    """One step's values after another, or None unless every step has one value per entry
    of a dtype kind in `kinds` (an empty step's dtype is free, as in step_frame)."""
    arrays = [np.asarray(values) for values in columns]
    if any(array.shape != (n,) for array, n in zip(arrays, lengths, strict=False)):
        return None
    if any(array.dtype.kind not in kinds for array in arrays if array.size):
        return None
    return np.concatenate(arrays)


def _batch_ids(columns: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, list[bytes]] | None:
    """Entries per step, the byte length of every id of the steps in order, and each step's
    ids as UTF-8."""
    if not all(type(ids) is list or type(ids) is tuple for ids in columns):
        return None
    try:
        blobs = list(map(str.encode, map("".join, columns)))
    except (TypeError, UnicodeEncodeError):
        return None
    lengths = [
        _id_lengths(list(chain.from_iterable(columns[first : first + _ID_CHUNK_STEPS])))
        for first in range(0, len(columns), _ID_CHUNK_STEPS)
    ]
    entries = np.fromiter(map(len, columns), np.int64, len(columns))
    return entries, np.concatenate(lengths) if lengths else np.zeros(0, np.int64), blobs


def _in_int32_range(values: np.ndarray) -> bool:
    return values.size == 0 or (int(values.min()) >= 0 and int(values.max()) <= INT32_MAX)


def _valid_blocks(values: np.ndarray | None) -> bool:
    return values is not None and bool(np.all(np.isfinite(values))) and not np.any(values < 0)


def _batch_frames(steps: Sequence[tuple[Any, ...]]) -> list[bytes | Exception] | None:
    """All of `steps` encoded together, or None when any of them needs step_frame's checks."""
    try:
        return _pack_batch(steps)
    except (TypeError, ValueError, OverflowError):
        # Values numpy cannot take whole.
        return None


def _pack_batch(steps: Sequence[tuple[Any, ...]]) -> list[bytes | Exception] | None:
    """step_frame's checks over whole columns; None as soon as any step fails one."""
    columns = list(zip(*steps, strict=False))
    if not columns:
        return []
    ids = _batch_ids(columns[_REQUEST_IDS])
    holder_ids = _batch_ids(columns[_HOLDER_IDS])
    if ids is None or holder_ids is None:
        return None
    entries, id_lengths, id_blobs = ids
    holder_entries, holder_id_lengths, holder_blobs = holder_ids
    slots = _batch_slots(columns, entries.tolist(), id_lengths)
    if slots is None:
        return None
    holders = _batch_holders(columns, holder_entries.tolist(), holder_id_lengths)
    if holders is None:
        return None
    fixed = _batch_fixed(columns, len(steps))
    if fixed is None:
        return None
    id_bytes = np.fromiter(map(len, id_blobs), np.int64, len(steps))
    holder_id_bytes = np.fromiter(map(len, holder_blobs), np.int64, len(steps))
    fixed["num_slots"] = entries
    fixed["num_holders"] = holder_entries
    fixed["request_id_bytes"] = id_bytes
    fixed["holder_id_bytes"] = holder_id_bytes
    fixed["admission_blocked"] = np.fromiter(
        map(bool, columns[_ADMISSION_BLOCKED]), np.bool_, len(steps)
    )
    payload_bytes = (
        _STEP_PAYLOAD_FIXED
        + entries * SLOT_DTYPE.itemsize
        + id_bytes
        + holder_entries * HOLDER_DTYPE.itemsize
        + holder_id_bytes
    )
    if int(payload_bytes.max()) > MAX_FRAME_PAYLOAD:
        return None
    return _joined_frames(
        fixed, (slots, entries, id_blobs), (holders, holder_entries, holder_blobs)
    )


def _batch_slots(
    columns: Sequence[Sequence[Any]], lengths: list[int], id_lengths: np.ndarray
) -> np.ndarray | None:
    """The slots of all steps, in order; None unless every step passes step_frame's checks."""
    slots = np.empty(len(id_lengths), SLOT_DTYPE)
    slots["request_id_len"] = id_lengths
    for position, name in _COUNT_COLUMNS:
        values = _batch_column(columns[position], lengths, "iu")
        if values is None or not _in_int32_range(values):
            return None
        slots[name] = values
    kv_blocks = _batch_column(columns[_KV_BLOCKS], lengths, "iuf")
    if not _valid_blocks(kv_blocks):
        return None
    slots["kv_blocks"] = kv_blocks
    if np.any(slots["spec_drafted"] > slots["new_tokens"]) or np.any(
        slots["spec_accepted"] > slots["spec_drafted"]
    ):
        return None
    return slots


def _batch_holders(
    columns: Sequence[Sequence[Any]], holder_lengths: list[int], holder_id_lengths: np.ndarray
) -> np.ndarray | None:
    """The holders of all steps, in order; None unless every step passes step_frame's checks."""
    holders = np.empty(len(holder_id_lengths), HOLDER_DTYPE)
    holders["request_id_len"] = holder_id_lengths
    holder_blocks = _batch_column(columns[_HOLDER_BLOCKS], holder_lengths, "iuf")
    if not _valid_blocks(holder_blocks):
        return None
    holders["kv_blocks"] = holder_blocks
    states = columns[_HOLDER_STATES]
    if (
        not all(type(s) is list or type(s) is tuple for s in states)
        or list(map(len, states)) != holder_lengths
    ):
        return None
    codes = _state_codes(list(chain.from_iterable(states)))
    if np.any(codes == _UNKNOWN_STATE):
        return None
    holders["state"] = codes
    return holders


def _batch_fixed(columns: Sequence[Sequence[Any]], n_steps: int) -> np.ndarray | None:
    """The steps' fixed parts with the fields given as scalars (the counts of their variable
    parts are the caller's); None unless every step passes step_frame's checks."""
    fixed = np.empty(n_steps, STEP_DTYPE)
    for field, position in (("seq", _SEQ), ("start_ns", _START), ("end_ns", _END)):
        values = np.array(columns[position])
        if values.dtype != np.int64:
            return None
        fixed[field] = values
    if np.any(fixed["end_ns"] < fixed["start_ns"]):
        return None
    for field, position in (("free_blocks", _FREE_BLOCKS), ("total_blocks", _TOTAL_BLOCKS)):
        if not all(isinstance(value, (int, np.integer)) for value in columns[position]):
            return None
        values = np.array(columns[position])
        if values.dtype.kind not in "iu" or not _in_int32_range(values):
            return None
        fixed[field] = values
    return fixed


def _joined_frames(
    fixed: np.ndarray,
    slot_parts: tuple[np.ndarray, np.ndarray, list[bytes]],
    holder_parts: tuple[np.ndarray, np.ndarray, list[bytes]],
) -> list[bytes | Exception]:
    """Each step's frame from the batch's fixed parts, slots and holders; `slot_parts` and
    `holder_parts`: the rows of all steps, the rows per step and each step's ids as UTF-8."""
    slots, entries, id_blobs = slot_parts
    holders, holder_entries, holder_blobs = holder_parts
    slot_bounds = np.concatenate(([0], np.cumsum(entries)))
    holder_bounds = np.concatenate(([0], np.cumsum(holder_entries)))
    # One buffer per part for the whole batch; each frame joins its slices of them.
    fixed_view = memoryview(fixed.tobytes())
    slot_view = memoryview(slots.tobytes())
    holder_view = memoryview(holders.tobytes())
    slot_cuts = (slot_bounds * SLOT_DTYPE.itemsize).tolist()
    holder_cuts = (holder_bounds * HOLDER_DTYPE.itemsize).tolist()
    frames: list[bytes | Exception] = []
    for i in range(len(fixed)):
        payload = b"".join(
            (
                fixed_view[i * _STEP_PAYLOAD_FIXED : (i + 1) * _STEP_PAYLOAD_FIXED],
                slot_view[slot_cuts[i] : slot_cuts[i + 1]],
                id_blobs[i],
                holder_view[holder_cuts[i] : holder_cuts[i + 1]],
                holder_blobs[i],
            )
        )
        frames.append(frame(FrameKind.STEP, payload))
    return frames
