"""Decode segment files into the typed tables of schemas/tables.py, reporting every damage.

The frames of a segment are found and verified in one compiled pass (frames.read_frames);
everything per step and per slot is numpy over the concatenated records of a whole segment,
and request ids become one Arrow string array built from offsets and a single data buffer.
Python handles what is rare: the header, drop frames and damage.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa

from pipeline.ingestion import frames
from schemas.errors import DataError
from schemas.records import (
    DECODED_HOLDER_STATES,
    DROP_STRUCT,
    FILE_MAGIC,
    FORMAT_VERSION,
    FRAME_PREFIX,
    HOLDER_DTYPE,
    LAYOUT,
    PREAMBLE,
    SLOT_DTYPE,
    STEP_DTYPE,
    FieldError,
    FrameKind,
    HeaderFrame,
)
from schemas.tables import (
    DAMAGE,
    DROPS,
    HOLDERS,
    SEGMENTS,
    SLOTS,
    STEPS,
)

_INT64_LIMIT = 1 << 63
# Checksummed bytes a file may cost, per byte of file. Intact frames are checksummed once, so
# this leaves a file's size again for frames that fail; hostile input (markers everywhere, each
# declaring a frame that reaches the end of the file) would otherwise cost quadratic time.
CRC_BYTES_PER_FILE_BYTE = 2
_HOLDER_STATE_NAMES = pa.array(DECODED_HOLDER_STATES, pa.string())
# How the recorder names a segment: `<replica>.<first seq, 12 digits>.<segment id prefix>.seg`.
# A file without a readable header is placed in its replica's sequence by this name alone.
_SEGMENT_NAME = re.compile(r"^(?P<replica>.+)\.(?P<first_seq>\d{12,18})\.[0-9a-f]+\.seg$")
_FILE_TYPES = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}
_NO_STEPS = np.zeros(0, np.int64)


class UnreadableSegment(DataError, OSError):
    """A path named like a segment that is not a readable regular file; the message says why."""


@contextmanager
def open_segment(path: Path) -> Iterator[BinaryIO]:
    """Open a segment for reading without ever blocking: a FIFO, a device or a directory that
    lands in an outbox is refused after a non-blocking open, before any read.

    Raises UnreadableSegment for what cannot be opened (a dangling symlink, a symlink loop,
    no permission) or is not a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise UnreadableSegment(f"cannot open: {err.strerror}") from None
    try:
        kind = stat.S_IFMT(os.fstat(fd).st_mode)
        if kind != stat.S_IFREG:
            raise UnreadableSegment(
                f"{_FILE_TYPES.get(kind, 'not a regular file')}, not a segment file"
            )
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as handle:
        yield handle


def _read_segment(path: Path, limit: int = -1) -> bytes:
    """The segment's bytes, its first `limit` only when that is not -1."""
    with open_segment(path) as handle:
        try:
            return handle.read(limit)
        except OSError as err:
            raise UnreadableSegment(f"cannot read: {err.strerror}") from None


@dataclass
class DecodedLog:
    steps: pa.Table
    slots: pa.Table
    holders: pa.Table
    segments: pa.Table
    damage: pa.Table
    drops: pa.Table


@dataclass
class _Damage:
    kind: str
    byte_offset: int
    byte_length: int
    detail: str
    first_seq: int | None = None
    last_seq: int | None = None


@dataclass
class _File:
    """One file's decoded frames before duplicates are resolved."""

    path: Path
    data: bytes
    # Bytes still allowed through the CRC, see CRC_BYTES_PER_FILE_BYTE.
    crc_budget: int
    # Bytes checksummed so far: what the budget bounds.
    checksummed: int = 0
    header: HeaderFrame | None = None
    damage: list[_Damage] = field(default_factory=list)
    # Per intact step frame: its offset and end in the file, and its fixed-size record.
    step_offsets: np.ndarray = field(default_factory=lambda: _NO_STEPS)
    step_ends: np.ndarray = field(default_factory=lambda: _NO_STEPS)
    fixed: np.ndarray = field(default_factory=lambda: np.zeros(0, STEP_DTYPE))
    drops: list[tuple[int, int]] = field(default_factory=list)
    # Byte offset, first and last seq of every frame that names sequence numbers (steps,
    # including those discarded later, and drops), by offset: they bound damage.
    mark_offsets: np.ndarray = field(default_factory=lambda: _NO_STEPS)
    mark_first: np.ndarray = field(default_factory=lambda: _NO_STEPS)
    mark_last: np.ndarray = field(default_factory=lambda: _NO_STEPS)

    @property
    def step_count(self) -> int:
        return len(self.step_offsets)

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def array(self) -> np.ndarray:
        return np.frombuffer(self.data, np.uint8)


def _new_file(path: Path, data: bytes) -> _File:
    return _File(path=path, data=data, crc_budget=CRC_BYTES_PER_FILE_BYTE * len(data))


class _ResyncGaveUp(Exception):
    """Checking the next candidate frame would exceed the file's checksum budget."""


def _check_frame(decoded: _File, pos: int) -> tuple[int, int]:
    """(kind, end) of a valid frame at `pos`, or (frames.TRUNCATED or frames.INVALID, 0).

    Raises _ResyncGaveUp when the checksum would exceed what is left of the file's budget.
    """
    kind, end, decoded.crc_budget, checked = frames.check_frame(
        decoded.array, pos, decoded.crc_budget
    )
    decoded.checksummed += checked
    if kind == frames.GAVE_UP:
        raise _ResyncGaveUp
    return kind, end


def _next_frame(decoded: _File, pos: int) -> int | None:
    """The offset of the next valid frame after damage at `pos`, or None.

    Raises _ResyncGaveUp when the checksum budget runs out first."""
    following, kind, _, decoded.crc_budget, checked = frames.next_frame(
        decoded.array, pos, decoded.crc_budget
    )
    decoded.checksummed += checked
    if kind == frames.GAVE_UP:
        raise _ResyncGaveUp
    return None if following == -1 else following


def _read_header(decoded: _File, data: bytes) -> int | None:
    """Validate preamble and header frame; the offset of the first body frame, or None."""
    size = len(data)
    if size < PREAMBLE.size:
        if FILE_MAGIC.startswith(data[: len(FILE_MAGIC)]):
            decoded.damage.append(
                _Damage("torn_tail", 0, size, f"file ends inside the {PREAMBLE.size}-byte preamble")
            )
        else:
            decoded.damage.append(
                _Damage("bad_header", 0, size, "not a step segment (no STEPLOG magic)")
            )
        return None
    magic, version = PREAMBLE.unpack_from(data, 0)
    if magic != FILE_MAGIC or data[12:16] != b"\0\0\0\0":
        decoded.damage.append(_Damage("bad_header", 0, size, "not a step segment (bad preamble)"))
        return None
    if version != FORMAT_VERSION:
        decoded.damage.append(
            _Damage(
                "unknown_version",
                0,
                size,
                f"format version {version}; this decoder reads version {FORMAT_VERSION}",
            )
        )
        return None
    kind, end = _check_frame(decoded, PREAMBLE.size)
    if kind == frames.TRUNCATED and not _frames_follow(decoded, PREAMBLE.size):
        decoded.damage.append(
            _Damage(
                "torn_tail",
                PREAMBLE.size,
                size - PREAMBLE.size,
                "file ends inside the segment header frame",
            )
        )
        return None
    if kind != FrameKind.HEADER:
        decoded.damage.append(
            _Damage(
                "bad_header", PREAMBLE.size, size - PREAMBLE.size, "segment header frame damaged"
            )
        )
        return None
    try:
        header = HeaderFrame.from_json(data[PREAMBLE.size + FRAME_PREFIX.size : end])
    except FieldError as err:
        decoded.damage.append(
            _Damage("bad_header", PREAMBLE.size, size - PREAMBLE.size, f"segment header: {err}")
        )
        return None
    if header.format_version != FORMAT_VERSION or header.layout != LAYOUT:
        decoded.damage.append(
            _Damage(
                "bad_header",
                PREAMBLE.size,
                size - PREAMBLE.size,
                f"header declares version {header.format_version} / a field layout that differs from version "
                f"{FORMAT_VERSION}'s",
            )
        )
        return None
    # Numbers past int64 cannot reach the int64 columns (and would overflow the UTC shift).
    numbers = (
        header.first_seq,
        header.mono_anchor_ns,
        header.wall_anchor_ns,
        header.wall_anchor_ns - header.mono_anchor_ns,
    )
    if not all(-_INT64_LIMIT <= value < _INT64_LIMIT for value in numbers):
        why = "segment header: first_seq or a clock anchor exceeds int64"
        decoded.damage.append(_Damage("bad_header", PREAMBLE.size, size - PREAMBLE.size, why))
        return None
    decoded.header = header
    return end


# A header frame is about a kilobyte; this leaves room for long names and a longer layout.
HEADER_READ_BYTES = 1 << 13


def segment_header(path: Path) -> HeaderFrame | None:
    """The header of the segment at `path`, from the file's first bytes only (what the segment
    is and when it began, without decoding its records); None when those bytes hold no intact
    header: ingestion reports that damage.

    Raises UnreadableSegment for what cannot be opened or read."""
    data = _read_segment(path, HEADER_READ_BYTES)
    decoded = _new_file(path, data)
    try:
        _read_header(decoded, data)
    except _ResyncGaveUp:
        return None
    return decoded.header


def _frames_follow(decoded: _File, pos: int) -> bool:
    """Whether a valid frame may follow `pos`: one that could not be checked counts."""
    try:
        return _next_frame(decoded, pos) is not None
    except _ResyncGaveUp:
        return True


def _read_body(decoded: _File, pos: int) -> None:
    """Take in every frame from `pos` on: steps as arrays, drops and damage one by one."""
    data = decoded.array
    size = decoded.size
    starts, ends, codes, decoded.crc_budget, checksummed = frames.read_frames(
        data, pos, decoded.crc_budget
    )
    decoded.checksummed += checksummed
    steps = codes == FrameKind.STEP
    decoded.step_offsets, decoded.step_ends = starts[steps], ends[steps]
    record_size = np.full(len(decoded.step_offsets), STEP_DTYPE.itemsize, np.int64)
    decoded.fixed = frames.gather(data, decoded.step_offsets + FRAME_PREFIX.size, record_size).view(
        STEP_DTYPE
    )
    drop_marks: list[tuple[int, int, int]] = []
    for start, end, code in zip(
        starts[~steps].tolist(), ends[~steps].tolist(), codes[~steps].tolist(), strict=True
    ):
        if code == FrameKind.DROP:
            first, last = DROP_STRUCT.unpack_from(decoded.data, start + FRAME_PREFIX.size)
            if 0 <= first <= last:
                decoded.drops.append((first, last))
                drop_marks.append((start, first, last))
                continue
            why = (
                f"drop frame whose first_seq {first} exceeds its last_seq {last}"
                if first > last
                else f"drop frame with a negative first_seq {first}"
            )
            decoded.damage.append(_Damage("corrupt_frame", start, end - start, why))
        elif code == FrameKind.HEADER:
            why = "a second segment header frame"
            decoded.damage.append(_Damage("corrupt_frame", start, end - start, why))
        elif code == frames.GAVE_UP:
            why = (
                f"resynchronisation gave up at byte {start}: checking further frames would checksum more than "
                f"{CRC_BYTES_PER_FILE_BYTE}x the file's {size} bytes; the remaining {size - start} bytes are not read"
            )
            decoded.damage.append(_Damage("corrupt_frame", start, size - start, why))
        else:
            torn = code == frames.TRUNCATED
            decoded.damage.append(
                _Damage(
                    "torn_tail" if torn else "corrupt_frame",
                    start,
                    end - start,
                    "file ends inside a frame" if torn else "bad frame marker, length or checksum",
                )
            )
    seqs = decoded.fixed["seq"]
    drop_columns = np.array(drop_marks, np.int64).reshape(-1, 3).T
    offsets = np.concatenate((decoded.step_offsets, drop_columns[0]))
    order = np.argsort(offsets, kind="stable")
    decoded.mark_offsets = offsets[order]
    decoded.mark_first = np.concatenate((seqs, drop_columns[1]))[order]
    decoded.mark_last = np.concatenate((seqs, drop_columns[2]))[order]


def _bound_damage(decoded: _File) -> None:
    """Name the sequence numbers each damaged region may hide, from the intact neighbours."""
    for damage in decoded.damage:
        if damage.kind not in ("corrupt_frame", "torn_tail") or decoded.header is None:
            continue
        index = int(np.searchsorted(decoded.mark_offsets, damage.byte_offset))
        damage.first_seq = (
            int(decoded.mark_last[index - 1]) + 1 if index > 0 else decoded.header.first_seq
        )
        if index < len(decoded.mark_offsets):
            damage.last_seq = int(decoded.mark_first[index]) - 1


def _decode_file(path: Path) -> _File:
    try:
        data = _read_segment(path)
    except UnreadableSegment as err:
        decoded = _new_file(path, b"")
        decoded.damage.append(_Damage("unreadable", 0, 0, str(err)))
        return decoded
    decoded = _new_file(path, data)
    if not data:
        decoded.damage.append(_Damage("torn_tail", 0, 0, "empty file"))
        return decoded
    body = _read_header(decoded, data)
    if body is not None:
        _read_body(decoded, body)
        _bound_damage(decoded)
    elif (
        decoded.damage[-1].kind == "bad_header" and decoded.damage[-1].byte_offset == PREAMBLE.size
    ):
        # The preamble vouches for the framing, so intact frames can at least be counted.
        _note_unreadable_seqs(decoded, data)
    return decoded


def _note_unreadable_seqs(decoded: _File, data: bytes) -> None:
    """Without a usable header nothing can be attributed; still say which steps are in the file."""
    probe = _new_file(decoded.path, data)
    probe.crc_budget = decoded.crc_budget
    try:
        following = _next_frame(probe, PREAMBLE.size)
        if following is not None:
            _read_body(probe, following)
    except _ResyncGaveUp:
        return
    finally:
        decoded.checksummed += probe.checksummed
    if len(probe.mark_offsets):
        decoded.damage[-1].first_seq = int(probe.mark_first.min())
        decoded.damage[-1].last_seq = int(probe.mark_last.max())
        decoded.damage[-1].detail += f"; {probe.step_count} intact step frames not decoded"


# --- tables ---------------------------------------------------------------------------------
def _offsets(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def _strings(offsets: np.ndarray, data: np.ndarray) -> pa.Array:
    array = pa.StringArray.from_buffers(
        len(offsets) - 1, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data)
    )
    array.validate(full=True)
    return array


def _row_keys(
    header: HeaderFrame, seq: np.ndarray, counts: np.ndarray
) -> list[pa.Array | np.ndarray]:
    """pool, replica, seq and position-in-step columns of per-step rows (slots or holders)."""
    total = int(counts.sum())
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return [
        _constant(header.pool, total),
        _constant(header.replica, total),
        np.repeat(seq, counts),
        (np.arange(total) - starts).astype(np.int32),
    ]


def _constant(value: str, n: int) -> pa.Array:
    return pa.repeat(pa.scalar(value, pa.string()), n)


def _inconsistent_steps(
    fixed: np.ndarray, slot_offsets: np.ndarray, holder_offsets: np.ndarray, holders: np.ndarray
) -> np.ndarray:
    """Steps whose records disagree with their own counts: CRC-valid, but written wrongly."""
    bad = np.zeros(len(fixed), bool)
    for offsets, count_field, bytes_field in (
        (slot_offsets, "num_slots", "request_id_bytes"),
        (holder_offsets, "num_holders", "holder_id_bytes"),
    ):
        row_bounds = np.zeros(len(fixed) + 1, np.int64)
        np.cumsum(fixed[count_field], out=row_bounds[1:])
        bad |= np.diff(offsets[row_bounds]) != fixed[bytes_field]
    holder_step = np.repeat(np.arange(len(fixed)), fixed["num_holders"].astype(np.int64))
    bad[holder_step[holders["state"] >= len(DECODED_HOLDER_STATES)]] = True
    return bad


@dataclass
class _StepParts:
    """Where each step's variable-length parts start in the file, and their byte lengths."""

    slots_at: np.ndarray
    slot_bytes: np.ndarray
    ids_at: np.ndarray
    id_bytes: np.ndarray
    holders_at: np.ndarray
    holder_bytes: np.ndarray
    holder_ids_at: np.ndarray
    holder_id_bytes: np.ndarray


def _step_parts(decoded: _File) -> _StepParts:
    """The parts follow each other (their lengths agree with the payload, see frames.check_frame)."""
    fixed = decoded.fixed
    slots_at = decoded.step_offsets + FRAME_PREFIX.size + STEP_DTYPE.itemsize
    slot_bytes = fixed["num_slots"].astype(np.int64) * SLOT_DTYPE.itemsize
    ids_at = slots_at + slot_bytes
    id_bytes = fixed["request_id_bytes"].astype(np.int64)
    holders_at = ids_at + id_bytes
    holder_bytes = fixed["num_holders"].astype(np.int64) * HOLDER_DTYPE.itemsize
    holder_ids_at = holders_at + holder_bytes
    holder_id_bytes = fixed["holder_id_bytes"].astype(np.int64)
    return _StepParts(
        slots_at,
        slot_bytes,
        ids_at,
        id_bytes,
        holders_at,
        holder_bytes,
        holder_ids_at,
        holder_id_bytes,
    )


def _step_ids(
    decoded: _File, parts: _StepParts, slot_offsets: np.ndarray, holder_offsets: np.ndarray
) -> tuple[pa.Array, pa.Array]:
    """The slots' and the holders' ids; raises pa.ArrowInvalid when some id is not UTF-8."""
    data = decoded.array
    slot_ids = _strings(slot_offsets, frames.gather(data, parts.ids_at, parts.id_bytes))
    holder_ids = _strings(
        holder_offsets, frames.gather(data, parts.holder_ids_at, parts.holder_id_bytes)
    )
    return slot_ids, holder_ids


def _steps_with_invalid_ids(decoded: _File, parts: _StepParts) -> np.ndarray:
    """Which steps hold an id, of a slot or a holder, that is not UTF-8."""
    spans = zip(
        parts.ids_at.tolist(),
        parts.id_bytes.tolist(),
        parts.holder_ids_at.tolist(),
        parts.holder_id_bytes.tolist(),
        strict=True,
    )
    return np.array(
        [
            not _utf8(decoded.data[a : a + n]) or not _utf8(decoded.data[b : b + m])
            for a, n, b, m in spans
        ],
        bool,
    )


def _steps_table(
    header: HeaderFrame,
    fixed: np.ndarray,
    shift: int,
    slot_counts: np.ndarray,
    holder_counts: np.ndarray,
) -> pa.Table:
    """The STEPS rows of the steps' fixed parts; `shift`: monotonic to UTC nanoseconds."""
    n_steps = len(fixed)
    return pa.table(
        [
            _constant(header.pool, n_steps),
            _constant(header.replica, n_steps),
            _constant(header.segment_id, n_steps),
            fixed["seq"],
            fixed["start_ns"],
            fixed["end_ns"],
            fixed["start_ns"] + shift,
            fixed["end_ns"] + shift,
            fixed["admission_blocked"].astype(bool),
            fixed["free_blocks"],
            fixed["total_blocks"],
            slot_counts.astype(np.int32),
            holder_counts.astype(np.int32),
        ],
        schema=STEPS,
    )


def _tables(decoded: _File, header: HeaderFrame) -> tuple[pa.Table, pa.Table, pa.Table]:
    fixed = decoded.fixed
    data = decoded.array
    parts = _step_parts(decoded)
    slots = frames.gather(data, parts.slots_at, parts.slot_bytes).view(SLOT_DTYPE)
    holders = frames.gather(data, parts.holders_at, parts.holder_bytes).view(HOLDER_DTYPE)
    slot_offsets = _offsets(slots["request_id_len"])
    holder_offsets = _offsets(holders["request_id_len"])
    bad = _inconsistent_steps(fixed, slot_offsets, holder_offsets, holders)
    if not bad.any():
        try:
            slot_ids, holder_ids = _step_ids(decoded, parts, slot_offsets, holder_offsets)
        except pa.ArrowInvalid:
            bad = _steps_with_invalid_ids(decoded, parts)
    if bad.any():
        why = "step frame whose id lengths, ids or holder states disagree with its counts"
        _discard_steps(decoded, bad, fixed["seq"], why)
        return _tables(decoded, header)
    shift = header.wall_anchor_ns - header.mono_anchor_ns
    overflows = _utc_overflows(fixed, shift)
    if overflows.any():
        why = (
            f"step start or end time plus the header's clock anchor shift (wall_anchor_ns - mono_anchor_ns = "
            f"{shift}) is outside int64 nanoseconds, so the step has no UTC time"
        )
        _discard_steps(decoded, overflows, fixed["seq"], why)
        return _tables(decoded, header)
    slot_counts = fixed["num_slots"].astype(np.int64)
    holder_counts = fixed["num_holders"].astype(np.int64)

    seq = fixed["seq"]
    slot_table = pa.table(
        [
            *_row_keys(header, seq, slot_counts),
            slot_ids,
            slots["new_tokens"],
            slots["context_tokens"],
            slots["kv_blocks"],
            slots["prompt_tokens"],
            slots["prefix_hit_tokens"],
            slots["spec_drafted"],
            slots["spec_accepted"],
        ],
        schema=SLOTS,
    )
    holder_table = pa.table(
        [
            *_row_keys(header, seq, holder_counts),
            holder_ids,
            holders["kv_blocks"],
            _HOLDER_STATE_NAMES.take(pa.array(holders["state"])),
        ],
        schema=HOLDERS,
    )
    steps = _steps_table(header, fixed, shift, slot_counts, holder_counts)
    return steps, slot_table, holder_table


def _utf8(blob: bytes) -> bool:
    try:
        blob.decode()
    except UnicodeDecodeError:
        return False
    return True


def _utc_overflows(fixed: np.ndarray, shift: int) -> np.ndarray:
    """Steps whose start or end would leave int64 when shifted to UTC; numpy would wrap silently.

    Compares against the limit before adding, so nothing overflows on the way.
    """
    if shift >= 0:
        latest = np.int64(_INT64_LIMIT - 1 - shift)
        return (fixed["start_ns"] > latest) | (fixed["end_ns"] > latest)
    earliest = np.int64(-_INT64_LIMIT - shift)
    return (fixed["start_ns"] < earliest) | (fixed["end_ns"] < earliest)


def _discard_steps(decoded: _File, discard: np.ndarray, seqs: np.ndarray, why: str) -> None:
    """Report step frames that passed their checksum but cannot be decoded, and drop them.

    Byte-adjacent discarded frames are one damaged region, so a file whose steps all fail is
    one row and the cost stays linear in the number of steps.
    """
    starts = decoded.step_offsets[discard]
    ends = decoded.step_ends[discard]
    discarded_seqs = seqs[discard]
    last = np.flatnonzero(np.append(starts[1:] != ends[:-1], True))
    first = np.concatenate(([0], last[:-1] + 1))
    for run_first, run_last in zip(first.tolist(), last.tolist(), strict=True):
        decoded.damage.append(
            _Damage(
                "corrupt_frame",
                int(starts[run_first]),
                int(ends[run_last] - starts[run_first]),
                why,
                int(discarded_seqs[run_first]),
                int(discarded_seqs[run_last]),
            )
        )
    _keep_steps(decoded, ~discard)


def _keep_steps(decoded: _File, keep: np.ndarray) -> None:
    decoded.step_offsets = decoded.step_offsets[keep]
    decoded.step_ends = decoded.step_ends[keep]
    decoded.fixed = decoded.fixed[keep]


def _seq_range(decoded: _File) -> tuple[int | None, int | None]:
    if not len(decoded.mark_offsets):
        return None, None
    return int(decoded.mark_first.min()), int(decoded.mark_last.max())


def _copy_key(decoded: _File) -> str | bytes:
    """What copies of one segment share: the segment id, else the bytes. Files with no bytes
    (empty, or unreadable) are copies of nothing: each is its own damage."""
    if decoded.header is not None:
        return decoded.header.segment_id
    return decoded.data or str(decoded.path)


_COPY_KINDS = ("duplicate_segment", "divergent_copy")


def _resolve_duplicates(
    files: list[_File],
) -> tuple[list[_File], list[tuple[_File, _Damage]], list[_File]]:
    """Keep one copy of each segment; the others become duplicate_segment damage, or
    divergent_copy damage when they hold frames the kept copy lacks or other bytes for one of
    its steps. A divergent copy's steps that the kept one lacks are kept too (the third list:
    those copies, cut to those steps).

    Copies share a segment_id; files without a readable header are copies only when their
    bytes are identical. The kept copy is the one with the most intact steps.
    """
    kept: dict[str | bytes, _File] = {}
    duplicates: list[tuple[_File, _File]] = []
    for decoded in sorted(files, key=lambda f: str(f.path)):
        key = _copy_key(decoded)
        other = kept.get(key)
        if other is None:
            kept[key] = decoded
            continue
        best, worse = sorted(
            (other, decoded), key=lambda f: (-f.step_count, len(f.damage), str(f.path))
        )
        kept[key] = best
        duplicates.append((worse, best))
    damage = []
    extras = []
    for copy, keeper in duplicates:
        keeper = kept[_copy_key(keeper)]
        kind = "duplicate_segment"
        if copy.data == keeper.data or copy.header is None:
            why = f"identical content to {keeper.path}, which was kept"
        else:
            why = f"same segment_id {copy.header.segment_id} as {keeper.path}, which was kept"
            missing = int(np.isin(copy.mark_first, keeper.mark_first, invert=True).sum())
            changed = _steps_changed(copy, keeper)
            if missing or changed:
                # Another log under the same id, not a copy.
                kind = "divergent_copy"
                why += (
                    f"; {missing} of this copy's frames are not in the kept copy (its steps "
                    f"among them decoded too), {changed} of its steps differ from the kept copy's"
                )
            unique = ~np.isin(copy.fixed["seq"], keeper.fixed["seq"])
            if unique.any():
                _keep_steps(copy, unique)
                extras.append(copy)
        first, last = _seq_range(copy)
        damage.append((copy, _Damage(kind, 0, copy.size, why, first, last)))
    return list(kept.values()), damage, extras


def _steps_changed(copy: _File, keeper: _File) -> int:
    """How many steps both files hold with other bytes in each."""
    frame_of = {
        int(seq): keeper.data[start:end]
        for seq, start, end in zip(
            keeper.fixed["seq"], keeper.step_offsets, keeper.step_ends, strict=True
        )
    }
    return sum(
        int(seq) in frame_of and frame_of[int(seq)] != copy.data[start:end]
        for seq, start, end in zip(
            copy.fixed["seq"], copy.step_offsets, copy.step_ends, strict=True
        )
    )


def _replica_and_name_seq(decoded: _File) -> tuple[str | None, int | None]:
    """The replica a file belongs to, and where its sequence starts when only its name says so."""
    if decoded.header is not None:
        return decoded.header.replica, None
    named = _SEGMENT_NAME.match(decoded.path.name)
    if named is None:
        return None, None
    return named["replica"], int(named["first_seq"])


def _bound_by_next_segment(files: list[_File], following: list[_File]) -> None:
    """Scope each damaged region to the sequence numbers it can hide: a torn tail ends before
    the next segment of the same replica (among `files` and `following`) starts, and a file
    without a readable header hides at most the numbers from the first one its name gives up to
    that next segment (replica ids are unique across pools, so the replica alone places it).

    A next segment that starts right after the damage leaves it an empty range
    (last_seq = first_seq - 1): then it can hide nothing."""
    starts: dict[str, list[int]] = {}
    for decoded in [*files, *following]:
        first, _ = _seq_range(decoded)
        if decoded.header is not None and first is not None:
            starts.setdefault(decoded.header.replica, []).append(first)
    for decoded in files:
        replica, name_seq = _replica_and_name_seq(decoded)
        if replica is None:
            continue
        later = sorted(starts.get(replica, []))
        for damage in decoded.damage:
            if damage.first_seq is None and damage.kind not in _COPY_KINDS:
                damage.first_seq = name_seq
            if damage.last_seq is None and damage.first_seq is not None:
                after = [s for s in later if s >= damage.first_seq]
                if after:
                    damage.last_seq = after[0] - 1


def read_segments(paths: Iterable[Path], following: Iterable[Path] = ()) -> DecodedLog:
    """Decode segment files given in any order; duplicated segments are kept once and reported.

    Rows come segment by segment, segments ordered by pool, replica and first sequence
    number, and `segments` lists them in that same order; within a segment, file order
    (rising sequence numbers). The result does not depend on the order of `paths`.
    `following`: segments read only for where they start, so that a torn tail of `paths` is
    bounded by its replica's next segment when that one is decoded in a later call; nothing
    of them is returned.
    """
    unique = sorted({Path(p) for p in paths}, key=str)
    decoded_files = [_decode_file(path) for path in unique]
    files, duplicate_damage, divergent = _resolve_duplicates(decoded_files)
    _bound_by_next_segment(
        files, [_decode_file(Path(p)) for p in following if Path(p) not in unique]
    )
    readable = sorted(
        ((f, f.header) for f in [*files, *divergent] if f.header is not None),
        key=lambda fh: (fh[1].pool, fh[1].replica, _seq_range(fh[0])[0] or 0, fh[1].segment_id),
    )

    step_tables, slot_tables, holder_tables = [], [], []
    segment_rows: list[dict[str, Any]] = []
    drop_rows: list[dict[str, Any]] = []
    for decoded, header in readable:
        steps, slots, holders = _tables(decoded, header)
        step_tables.append(steps)
        slot_tables.append(slots)
        holder_tables.append(holders)
        if any(decoded is copy for copy in divergent):
            continue  # its segment id, drops and range are its kept copy's
        first, last = _seq_range(decoded)
        dropped = sum(b - a + 1 for a, b in decoded.drops)
        segment_rows.append(
            {
                "path": str(decoded.path),
                **{k: v for k, v in header.as_dict().items() if k in SEGMENTS.names},
                "first_seq": first,
                "last_seq": last,
                "steps": decoded.step_count,
                "dropped_steps": dropped,
                "bytes": decoded.size,
            }
        )
        drop_rows.extend(
            {
                "pool": header.pool,
                "replica": header.replica,
                "first_seq": a,
                "last_seq": b,
                "steps": b - a + 1,
            }
            for a, b in sorted(decoded.drops)
        )

    damage_rows = [
        {"path": str(decoded.path), **vars(damage)}
        for decoded in sorted(files, key=lambda f: str(f.path))
        for damage in sorted(decoded.damage, key=lambda d: d.byte_offset)
    ]
    damage_rows += [{"path": str(copy.path), **vars(damage)} for copy, damage in duplicate_damage]
    return DecodedLog(
        steps=_concat(step_tables, STEPS),
        slots=_concat(slot_tables, SLOTS),
        holders=_concat(holder_tables, HOLDERS),
        segments=pa.Table.from_pylist(segment_rows, schema=SEGMENTS),
        damage=pa.Table.from_pylist(damage_rows, schema=DAMAGE),
        drops=pa.Table.from_pylist(drop_rows, schema=DROPS),
    )


def _concat(tables: list[pa.Table], schema: pa.Schema) -> pa.Table:
    return pa.concat_tables(tables) if tables else schema.empty_table()


def segment_paths(paths: Iterable[Path]) -> list[Path]:
    """Files named directly, plus every `*.seg` below each directory named."""
    found: list[Path] = []
    for path in map(Path, paths):
        found.extend(sorted(path.rglob("*.seg")) if path.is_dir() else [path])
    return found
