"""StepRecorder: the engine-side hook that logs every step without blocking it on I/O.

The engine thread only appends a tuple to a bounded deque. A writer thread takes queued steps
in batches, encodes each batch's frames together, writes them to a segment file in the outbox
under a temporary name, rotates by size and by time (every `ROTATE_SECONDS` by default, so
the live path prices a step within seconds of it), and ships each finished segment
atomically (fsync, then rename to `*.seg`), so the pipeline never reads a half-written file
unless the process died mid-segment.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from pipeline.hook import format as fmt
from schemas.errors import StepledgerError
from schemas.records import FORMAT_VERSION, LAYOUT, HeaderFrame, SegmentHeader

if TYPE_CHECKING:
    import numpy as np

# A step's per-slot values: a list from the engine, or a column of a simulated batch.
IntColumn: TypeAlias = "Sequence[int] | np.ndarray"
FloatColumn: TypeAlias = "Sequence[float] | np.ndarray"
# record_step's arguments after end_ns, in order, keywords included.
StepColumns: TypeAlias = tuple[Any, ...]

log = logging.getLogger(__name__)

SEGMENT_SUFFIX = ".seg"
PARTIAL_SUFFIX = ".partial"
# How often an idle writer looks at the queue and the rotation clock. Polling keeps
# record_step free of any signalling cost on the engine thread.
_POLL_SECONDS = 0.002
# Bytes gathered before one os.write; small enough that a crash loses little beyond the queue.
_WRITE_CHUNK = 1 << 20
_LOGGED_REJECTIONS = 10
# Steps the writer takes off the queue and encodes together: enough to spread numpy's cost
# per call thinly, few enough that the steps in hand add little to the bounded buffer.
ENCODE_BATCH_STEPS = 256
# Keeps a segment's request-id bytes within Arrow's 32-bit string offsets when decoded.
MAX_SEGMENT_BYTES = 1 << 30
# A segment is shipped at least this often: provisional costs (pipeline.live) can be no fresher
# than the segment that holds a request's last step.
ROTATE_SECONDS = 15.0
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]")


class RecorderError(StepledgerError, RuntimeError):
    """The writer thread failed; raised by close() so the loss is not silent."""


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def recover_partial_segments(outbox: Path) -> list[Path]:
    """Ship segments left behind by a recorder process that died (their tail may be torn).

    Partial files are named `.<name>.<pid>.partial`; a file whose process is still running
    belongs to a live recorder and is left alone.
    """
    shipped = []
    for partial in sorted(outbox.glob(f".*{PARTIAL_SUFFIX}")):
        stem, _, pid = partial.name[1 : -len(PARTIAL_SUFFIX)].rpartition(".")
        if not pid.isdigit() or _process_alive(int(pid)) or not stem.endswith(SEGMENT_SUFFIX):
            continue
        target = outbox / stem
        with open(partial, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(partial, target)
        log.warning("shipped %s left by recorder process %s, which is gone", target, pid)
        shipped.append(target)
    if shipped:
        _fsync_dir(outbox)
    return shipped


class _Segment:
    """The open segment file of the writer thread."""

    def __init__(
        self, outbox: Path, header: HeaderFrame, first_seq: int, opened_mono_ns: int
    ) -> None:
        replica = _UNSAFE_NAME.sub("_", header.replica)
        self.name = f"{replica}.{first_seq:012d}.{header.segment_id[:12]}{SEGMENT_SUFFIX}"
        self.final_path = outbox / self.name
        self.partial_path = outbox / f".{self.name}.{os.getpid()}{PARTIAL_SUFFIX}"
        self.opened_mono_ns = opened_mono_ns
        self.fd = os.open(self.partial_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        first = fmt.preamble() + fmt.header_frame(header)
        self.pending = [first]
        self.pending_bytes = self.size = len(first)

    def append(self, data: bytes) -> None:
        self.pending.append(data)
        self.pending_bytes += len(data)
        self.size += len(data)
        if self.pending_bytes >= _WRITE_CHUNK:
            self.flush()

    def flush(self) -> None:
        data = memoryview(b"".join(self.pending))
        while data:
            data = data[os.write(self.fd, data) :]
        self.pending.clear()
        self.pending_bytes = 0

    def ship(self) -> Path:
        self.flush()
        os.fsync(self.fd)
        os.close(self.fd)
        os.replace(self.partial_path, self.final_path)
        _fsync_dir(self.final_path.parent)
        return self.final_path


class StepRecorder:
    """Logs engine steps to segment files in `outbox`; see schemas/STEP_RECORDS.md.

    Call record_step from one thread (the engine's). `overflow="drop"` never blocks that
    thread: when `buffer_steps` steps are waiting, whole steps are dropped, counted and
    written into the log as drop frames. `overflow="block"` waits for room instead, for
    offline producers that must not lose steps.
    """

    def __init__(
        self,
        outbox: Path,
        header: SegmentHeader,
        *,
        buffer_steps: int = 4096,
        rotate_bytes: int = 64 << 20,
        rotate_seconds: float = ROTATE_SECONDS,
        overflow: Literal["drop", "block"] = "drop",
        mono_clock: Callable[[], int] = time.monotonic_ns,
        wall_clock: Callable[[], int] = time.time_ns,
        first_seq: int = 0,
    ) -> None:
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {buffer_steps}")
        if not 0 < rotate_bytes <= MAX_SEGMENT_BYTES or rotate_seconds <= 0:
            raise ValueError(
                f"rotate_bytes must lie in (0, {MAX_SEGMENT_BYTES}] and rotate_seconds be positive, "
                f"got {rotate_bytes}, {rotate_seconds}"
            )
        if overflow not in ("drop", "block"):
            raise ValueError(f"overflow must be 'drop' or 'block', got {overflow!r}")
        self.outbox = Path(outbox)
        self.outbox.mkdir(parents=True, exist_ok=True)
        recover_partial_segments(self.outbox)
        self.header = header
        self._capacity = buffer_steps
        self._rotate_bytes = rotate_bytes
        self._rotate_ns = int(rotate_seconds * 1e9)
        self._block = overflow == "block"
        self._mono_clock = mono_clock
        self._wall_clock = wall_clock

        # Engine-thread state. Each queued item carries how many steps were dropped just
        # before it, so the writer can place drop frames without sharing a mutable structure.
        self._queue: deque[tuple[Any, ...]] = deque()
        self._next_seq = first_seq
        self._drops_pending = 0
        self._dropped_total = 0
        self._closed = False

        # Writer-thread state.
        self._segment: _Segment | None = None
        self._rejected = 0
        self._shipped: list[Path] = []
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._room = threading.Condition()
        self._writer = threading.Thread(
            target=self._run, name=f"step-recorder-{header.replica}", daemon=True
        )
        self._writer.start()
        atexit.register(self.close)

    # --- engine thread -------------------------------------------------------------------
    def record_step(
        self,
        start_ns: int,
        end_ns: int,
        request_ids: Sequence[str],
        new_tokens: IntColumn,
        context_tokens: IntColumn,
        kv_blocks: FloatColumn,
        prompt_tokens: IntColumn,
        prefix_hit_tokens: IntColumn,
        spec_drafted: IntColumn,
        spec_accepted: IntColumn,
        *,
        holder_ids: Sequence[str] = (),
        holder_blocks: FloatColumn = (),
        holder_states: Sequence[str] = (),
        admission_blocked: bool = False,
        free_blocks: int = 0,
        total_blocks: int = 0,
    ) -> bool:
        """Queue one step; False when it was dropped. The sequence number is consumed either way.

        The recorder owns the arrays passed: the caller must not mutate them afterwards.
        Values are checked on the writer thread; a step that cannot be recorded faithfully
        is logged, counted in `rejected_steps` and written as a drop.
        """
        return self._queue_step(
            start_ns,
            end_ns,
            (
                request_ids,
                new_tokens,
                context_tokens,
                kv_blocks,
                prompt_tokens,
                prefix_hit_tokens,
                spec_drafted,
                spec_accepted,
                holder_ids,
                holder_blocks,
                holder_states,
                admission_blocked,
                free_blocks,
                total_blocks,
            ),
        )

    def record_step_later(
        self, start_ns: int, end_ns: int, columns: Callable[[], StepColumns]
    ) -> bool:
        """record_step, with the columns built by `columns()` on the writer thread: for an
        engine whose state is cheap to capture but costly to turn into columns. columns()
        must read only what the caller no longer mutates; if it raises, the step is rejected
        like one whose values cannot be recorded."""
        return self._queue_step(start_ns, end_ns, columns)

    def _queue_step(
        self, start_ns: int, end_ns: int, columns: StepColumns | Callable[[], StepColumns]
    ) -> bool:
        if self._closed:
            raise RecorderError("record_step called after close()")
        seq = self._next_seq
        self._next_seq = seq + 1
        queue = self._queue
        if len(queue) >= self._capacity:
            if not self._block:
                self._drops_pending += 1
                self._dropped_total += 1
                return False
            self._wait_for_room()
        queue.append((seq, self._drops_pending, start_ns, end_ns, columns))
        self._drops_pending = 0
        return True

    def drop_step(self) -> None:
        """Consume a sequence number as a counted drop (the same path as a full buffer)."""
        if self._closed:
            raise RecorderError("drop_step called after close()")
        self._next_seq += 1
        self._drops_pending += 1
        self._dropped_total += 1

    def _wait_for_room(self) -> None:
        with self._room:
            while len(self._queue) >= self._capacity:
                if not self._writer.is_alive():
                    raise RecorderError("the writer thread has stopped") from self._error
                self._room.wait(_POLL_SECONDS)

    @property
    def dropped_steps(self) -> int:
        """Steps dropped because the buffer was full or by drop_step()."""
        return self._dropped_total

    @property
    def rejected_steps(self) -> int:
        """Steps whose values could not be recorded (logged, and written as drops)."""
        return self._rejected

    @property
    def shipped_segments(self) -> list[Path]:
        """Segment files shipped so far, oldest first."""
        return list(self._shipped)

    def close(self) -> None:
        """Write everything queued, ship the open segment and stop the writer thread."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._stop.set()
        self._writer.join()
        if self._error is not None:
            raise RecorderError(
                f"step recorder for replica {self.header.replica!r} failed: {self._error}"
            ) from self._error

    def __enter__(self) -> StepRecorder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- writer thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                stopping = self._stop.is_set()
                self._drain()
                if stopping:
                    # Producers are done: steps dropped after the last queued one still
                    # belong in the log.
                    if self._drops_pending:
                        self._write_drop(self._next_seq - self._drops_pending, self._next_seq - 1)
                    if self._segment is not None:
                        self._ship()
                    return
                self._rotate_if_old()
                self._stop.wait(_POLL_SECONDS)
        except BaseException as err:
            log.exception("step recorder writer for replica %r stopped", self.header.replica)
            self._error = err
            self._ship_what_was_written()

    def _ship_what_was_written(self) -> None:
        """After a writer failure, still ship the frames already encoded (if the disk refuses,
        the partial file is shipped by the next recorder started on this outbox)."""
        segment, self._segment = self._segment, None
        if segment is None:
            return
        try:
            self._shipped.append(segment.ship())
        except OSError:
            log.exception("could not ship %s after the failure", segment.partial_path)

    def _drain(self) -> None:
        queue = self._queue
        while queue:
            batch = [queue.popleft() for _ in range(min(len(queue), ENCODE_BATCH_STEPS))]
            if self._block:
                with self._room:
                    self._room.notify()
            rows, unbuilt = [], {}
            for item in batch:
                seq, columns = item[0], item[4]
                if callable(columns):
                    try:
                        columns = columns()
                    except Exception as err:
                        unbuilt[seq] = err
                        continue
                rows.append((seq, item[2], item[3], *columns))
            encoded = iter(fmt.step_frames(rows))
            for item in batch:
                data = unbuilt[item[0]] if item[0] in unbuilt else next(encoded)
                seq, drops_before = item[0], item[1]
                if drops_before:
                    self._write_drop(seq - drops_before, seq - 1)
                if isinstance(data, Exception):
                    self._reject(seq, data)
                    self._write_drop(seq, seq)
                else:
                    self._write(seq, data)
        if self._segment is not None:
            self._segment.flush()

    def _reject(self, seq: int, err: Exception) -> None:
        self._rejected += 1
        # A systematic caller bug would repeat every step: say it early, then sparsely.
        if self._rejected <= _LOGGED_REJECTIONS or self._rejected % 1000 == 0:
            log.error(
                "replica %r step %d not recorded, written as a drop (%d rejected so far): %s",
                self.header.replica,
                seq,
                self._rejected,
                err,
            )

    def _write_drop(self, first_seq: int, last_seq: int) -> None:
        self._write(first_seq, fmt.drop_frame(first_seq, last_seq))

    def _write(self, seq: int, data: bytes) -> None:
        segment = self._segment
        if segment is None:
            segment = self._segment = self._open(seq)
        segment.append(data)
        if segment.size >= self._rotate_bytes:
            self._ship()
        else:
            self._rotate_if_old()

    def _rotate_if_old(self) -> None:
        if (
            self._segment is not None
            and self._mono_clock() - self._segment.opened_mono_ns >= self._rotate_ns
        ):
            self._ship()

    def _open(self, first_seq: int) -> _Segment:
        mono = self._mono_clock()
        wall = self._wall_clock()
        header = HeaderFrame(
            **self.header.as_dict(),
            format_version=FORMAT_VERSION,
            segment_id=uuid.uuid4().hex,
            first_seq=first_seq,
            mono_anchor_ns=mono,
            wall_anchor_ns=wall,
            layout=LAYOUT,
        )
        return _Segment(self.outbox, header, first_seq, mono)

    def _ship(self) -> None:
        segment, self._segment = self._segment, None
        if segment is not None:
            self._shipped.append(segment.ship())
