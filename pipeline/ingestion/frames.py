"""Finding and verifying the frames of a segment's bytes, compiled with numba.

A segment holds one frame per engine step, so a Python call per frame (prefix unpacking, two
CRC calls, slicing) was the decoder's largest cost. Here one compiled pass follows the frame
lengths, checks each frame's structure and CRC32 and, after damage, scans for the next marker
whose frame verifies; it reports spans and kinds only, and the decoder turns them into columns
with numpy. Every checksummed byte is charged to the caller's budget before it is read
(see decoder.CRC_BYTES_PER_FILE_BYTE), and counted, so that bound can be tested.
"""

from __future__ import annotations

import numba
import numpy as np

from schemas.records import (
    DROP_STRUCT,
    FRAME_CHECKED_BYTES,
    FRAME_MARKER,
    FRAME_PREFIX,
    HOLDER_DTYPE,
    MAX_FRAME_PAYLOAD,
    SLOT_DTYPE,
    STEP_DTYPE,
    STEP_FIELDS,
    FrameKind,
    struct_of,
)

# What check_frame returns instead of a frame kind, and the codes of damaged spans in
# read_frames' output: a frame cut off by the end of the data, bytes that are no valid
# frame, and a check the checksum budget no longer covers (nothing after it is read).
TRUNCATED = -1
INVALID = -2
GAVE_UP = -3

_MARKER = np.frombuffer(FRAME_MARKER, np.uint8).copy()
_PREFIX_SIZE = FRAME_PREFIX.size
_KIND_AT, _FLAGS_AT, _RESERVED_AT, _LENGTH_AT, _CRC_AT = 4, 5, 6, 8, 12
_HEADER, _STEP, _DROP = int(FrameKind.HEADER), int(FrameKind.STEP), int(FrameKind.DROP)
_DROP_SIZE = DROP_STRUCT.size
_STEP_SIZE = STEP_DTYPE.itemsize


def _step_field_at(name: str) -> int:
    """Where a field of the step record starts: the size of the fields before it."""
    names = [field for field, _ in STEP_FIELDS]
    return struct_of(STEP_FIELDS[: names.index(name)]).size


_SLOTS_AT = _step_field_at("num_slots")
_HOLDERS_AT = _step_field_at("num_holders")
_ID_BYTES_AT = _step_field_at("request_id_bytes")
_HOLDER_ID_BYTES_AT = _step_field_at("holder_id_bytes")
_BLOCKED_AT = _step_field_at("admission_blocked")
_SLOT_SIZE = SLOT_DTYPE.itemsize
_HOLDER_SIZE = HOLDER_DTYPE.itemsize
_MASK32 = 0xFFFFFFFF


def _crc_tables() -> np.ndarray:
    """zlib's CRC-32 (reflected polynomial 0xEDB88320) as eight tables for slicing-by-8."""
    crc = np.arange(256, dtype=np.int64)
    for _ in range(8):
        crc = np.where(crc & 1, (crc >> 1) ^ 0xEDB88320, crc >> 1)
    tables = np.empty((8, 256), np.int64)
    tables[0] = crc
    for k in range(1, 8):
        tables[k] = (tables[k - 1] >> 8) ^ tables[0][tables[k - 1] & 0xFF]
    return tables


_CRC_TABLES = _crc_tables()


@numba.njit(cache=True, nogil=True, inline="always")
def _u32(data: np.ndarray, at: int) -> int:
    return int(
        np.int64(data[at])
        | (np.int64(data[at + 1]) << 8)
        | (np.int64(data[at + 2]) << 16)
        | (np.int64(data[at + 3]) << 24)
    )


@numba.njit(cache=True, nogil=True)
def crc32(data: np.ndarray, start: int, end: int, crc: int) -> int:
    """zlib.crc32(data[start:end], crc)."""
    t = _CRC_TABLES
    c = (crc & _MASK32) ^ _MASK32
    i = start
    while i + 8 <= end:
        one = c ^ _u32(data, i)
        two = _u32(data, i + 4)
        c = (
            t[7, one & 0xFF]
            ^ t[6, (one >> 8) & 0xFF]
            ^ t[5, (one >> 16) & 0xFF]
            ^ t[4, one >> 24]
            ^ t[3, two & 0xFF]
            ^ t[2, (two >> 8) & 0xFF]
            ^ t[1, (two >> 16) & 0xFF]
            ^ t[0, two >> 24]
        )
        i += 8
    while i < end:
        c = t[0, (c ^ np.int64(data[i])) & 0xFF] ^ (c >> 8)
        i += 1
    return c ^ _MASK32


@numba.njit(cache=True, nogil=True, inline="always")
def _fits_its_kind(data: np.ndarray, kind: int, payload: int, end: int) -> bool:
    """Whether the payload length agrees with what the frame's kind says it holds.

    Checked before the CRC because it costs a few bytes, not the whole payload: random bytes
    that look like a frame marker almost never pass it."""
    length = end - payload
    if kind == _DROP:
        return length == _DROP_SIZE
    if kind != _STEP:
        return True
    if length < _STEP_SIZE:
        return False
    records = (
        _u32(data, payload + _SLOTS_AT) * _SLOT_SIZE
        + _u32(data, payload + _ID_BYTES_AT)
        + _u32(data, payload + _HOLDERS_AT) * _HOLDER_SIZE
        + _u32(data, payload + _HOLDER_ID_BYTES_AT)
    )
    return data[payload + _BLOCKED_AT] <= 1 and _STEP_SIZE + records == length


@numba.njit(cache=True, nogil=True)
def check_frame(data: np.ndarray, pos: int, budget: int) -> tuple[int, int, int, int]:
    """(kind or TRUNCATED / INVALID / GAVE_UP, frame end, budget left, bytes checksummed) of
    the frame at `pos`. GAVE_UP when its checksum would take the budget below zero (the budget
    is still charged, so every later check gives up too)."""
    size = len(data)
    if size - pos < _PREFIX_SIZE:
        for k in range(min(4, size - pos)):
            if data[pos + k] != _MARKER[k]:
                return INVALID, 0, budget, 0
        return TRUNCATED, 0, budget, 0
    for k in range(4):
        if data[pos + k] != _MARKER[k]:
            return INVALID, 0, budget, 0
    kind = int(data[pos + _KIND_AT])
    length = _u32(data, pos + _LENGTH_AT)
    if (
        (kind != _HEADER and kind != _STEP and kind != _DROP)
        or data[pos + _FLAGS_AT] != 0
        or data[pos + _RESERVED_AT] != 0
        or data[pos + _RESERVED_AT + 1] != 0
        or length > MAX_FRAME_PAYLOAD
    ):
        return INVALID, 0, budget, 0
    payload = pos + _PREFIX_SIZE
    end = payload + length
    if end > size:
        return TRUNCATED, 0, budget, 0
    if not _fits_its_kind(data, kind, payload, end):
        return INVALID, 0, budget, 0
    checked = FRAME_CHECKED_BYTES + length
    budget -= checked
    if budget < 0:
        return GAVE_UP, 0, budget, 0
    crc = crc32(data, payload, end, crc32(data, pos, pos + FRAME_CHECKED_BYTES, 0))
    if crc != _u32(data, pos + _CRC_AT):
        return INVALID, 0, budget, checked
    return kind, end, budget, checked


@numba.njit(cache=True, nogil=True, inline="always")
def _find_marker(data: np.ndarray, start: int) -> int:
    size = len(data)
    for at in range(start, size - 3):
        if (
            data[at] == _MARKER[0]
            and data[at + 1] == _MARKER[1]
            and data[at + 2] == _MARKER[2]
            and data[at + 3] == _MARKER[3]
        ):
            return at
    return -1


@numba.njit(cache=True, nogil=True)
def next_frame(data: np.ndarray, pos: int, budget: int) -> tuple[int, int, int, int, int]:
    """(offset, kind, end, budget left, bytes checksummed) of the first valid frame after
    damage at `pos`: markers are scanned for and each candidate verified. Offset -1 when there
    is none; kind GAVE_UP when the budget ran out first."""
    checksummed = 0
    candidate = _find_marker(data, pos + 1)
    while candidate != -1:
        kind, end, budget, checked = check_frame(data, candidate, budget)
        checksummed += checked
        if kind > 0 or kind == GAVE_UP:
            return candidate, kind, end, budget, checksummed
        candidate = _find_marker(data, candidate + 1)
    return -1, INVALID, 0, budget, checksummed


@numba.njit(cache=True, nogil=True, inline="always")
def _grown(values: np.ndarray) -> np.ndarray:
    more = np.empty(2 * len(values), values.dtype)
    more[: len(values)] = values
    return more


@numba.njit(cache=True, nogil=True)
def read_frames(
    data: np.ndarray, pos: int, budget: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """Every span from `pos` to the end of the data, in order: (starts, ends, codes, budget
    left, bytes checksummed). A code is a valid frame's kind, or for damage TRUNCATED (the
    data ends inside a frame), INVALID (bad marker, length or checksum, up to the next valid
    frame) or GAVE_UP (the budget ran out here; the span runs to the end unread)."""
    size = len(data)
    starts = np.empty(1024, np.int64)
    ends = np.empty(1024, np.int64)
    codes = np.empty(1024, np.int8)
    n = 0
    kind, end, budget, checksummed = check_frame(data, pos, budget)
    while pos < size:
        if n == len(starts):
            starts, ends, codes = _grown(starts), _grown(ends), _grown(codes)
        if kind == GAVE_UP:
            starts[n], ends[n], codes[n] = pos, size, GAVE_UP
            n += 1
            break
        if kind > 0:
            starts[n], ends[n], codes[n] = pos, end, kind
            n += 1
            pos = end
            kind, end, budget, checked = check_frame(data, pos, budget)
            checksummed += checked
            continue
        following, next_kind, next_end, budget, checked = next_frame(data, pos, budget)
        checksummed += checked
        if next_kind == GAVE_UP:
            kind = GAVE_UP
            continue
        damage_end = size if following == -1 else following
        torn = following == -1 and kind == TRUNCATED
        starts[n], ends[n], codes[n] = pos, damage_end, TRUNCATED if torn else INVALID
        n += 1
        pos = damage_end
        # Already checked: checksumming the frame again would double its cost.
        kind, end = next_kind, next_end
    return starts[:n], ends[:n], codes[:n], budget, checksummed


@numba.njit(cache=True, nogil=True)
def gather(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The spans data[starts[i] : starts[i] + lengths[i]] one after another."""
    out = np.empty(lengths.sum(), np.uint8)
    at = 0
    for i in range(len(starts)):
        out[at : at + lengths[i]] = data[starts[i] : starts[i] + lengths[i]]
        at += lengths[i]
    return out
