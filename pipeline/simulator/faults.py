"""Fault knobs: damage the simulated run in one known way, so each reconciliation check can be
shown to catch it. Each is given as `NAME` or `NAME=VALUE`; faults aimed at one replica hit
the first replica of the first pool that has traffic (`idle-replica`: the last replica of the
first pool with more than one), and `SimulationSummary.faults` says exactly what was done.

drop-records[=FRACTION]      The recorder loses a burst of steps, as an overflowing buffer does
                             at peak: a window of FRACTION of the span (default 0.02), starting
                             40% in, is recorded as counted drops (`StepRecorder.drop_step`).
                             The sequence numbers are consumed and the steps' time is missing,
                             so the time check sees a shortfall.
torn-segment                 One segment file (the middle one of the replica) is truncated in
                             the middle of a frame, as a crash during a write would leave it.
bit-flip                     One bit flips inside a step frame of the middle segment, as a bad
                             disk or link leaves it: the frame fails its checksum.
intact-copy                  With torn-segment or bit-flip: the damaged segment's intact bytes
                             are kept in `redelivery/outbox/<replica>/<name>`, for a test or an
                             operator to deliver later (under the same name or another one).
duplicate-segment            One segment file is delivered a second time under another name.
trailing-garbage             Bytes that are no frame are appended after the middle segment's
                             last frame; the next segment starts right after it.
empty-segment                A zero-byte file named like a delivery of the middle segment
                             (its first sequence number, another segment id) appears beside
                             it, as a crash between a rename and the data reaching disk leaves.
hostile-outbox               Beside the middle segment, named like deliveries of it: a
                             directory, a FIFO, a dangling symlink, a symlink loop and a copy
                             no one may read (mode 000, which root reads all the same).
clock-skew[=SECONDS]         The replica's wall clock runs slow by SECONDS per hour (default
                             36, i.e. 1%). Every segment re-reads the wall clock when it opens,
                             so consecutive segments' UTC ranges overlap and drift off the
                             true hour.
clock-jump[=SECONDS]         Halfway through the span the replica's wall clock steps by SECONDS
                             (default 7200; negative steps it back), as a bad NTP source or a
                             hand-set clock does. The recorder opens a segment there, anchored
                             on the stepped wall clock; the monotonic clock runs on.
missing-head[=FRACTION]      The segments holding the replica's steps of the first FRACTION of
                             the span (default 0.25) are never delivered: the log of the
                             hour starts late, DCGM and the gateway still show the work.
missing-middle[=FRACTION]    As missing-head, for a window of FRACTION (default 0.1) from 40%
                             of the span in.
missing-tail[=FRACTION]      As missing-head, for the last FRACTION of the span (default 0.25):
                             the log stops early with nothing after it.
torn-last-segment            The replica's last segment is truncated in the middle of a frame,
                             as a crash during its last write leaves it: no later segment
                             bounds what the tear hid.
divergent-copy               The replica's last segment is split in two files under its one
                             segment id, the first half of its frames in one and the rest in
                             the other, as two writers sharing a segment id leave them.
impossible-kv[=FACTOR]       The replica's hook reports every request's KV blocks FACTOR times
                             over (default 100): its steps hold more blocks than the engine has.
no-dcgm                      The replica's DCGM samples are never scraped (with silent-replica:
                             a replica with neither log nor DCGM).
silent-replica               The replica's segments are never delivered (a recorder whose outbox
                             is not shipped), while DCGM shows its GPUs busy and the gateway
                             its requests.
sink-down[=ATTEMPTS]         The fleet's alert webhook refuses its first ATTEMPTS deliveries
                             (default 1) with HTTP 500, then accepts: the run directory's
                             `alert-sink.json` describes it, `pipeline.simulator.sink` serves it.
missing-context[=FRACTION]   FRACTION of requests (default 0.05) have no gateway line.
idle-replica                 One replica receives no traffic; it still reports DCGM samples.
host-stall[=FRACTION]        Every step of the replica waits on the host for FRACTION of its GPU
                             time (default 0.5) while the GPU is idle: the engine looks busy and
                             DCGM shows the GPU idle for that time.
new-engine-version           The replica's log reports an engine version with no calibration.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from pipeline.datadir import DataDir
from pipeline.ingestion.decoder import read_segments
from schemas.errors import InputError
from schemas.records import FRAME_MARKER, FRAME_PREFIX, PREAMBLE

# name -> (default value, name of the value or None when it takes none, one-line help)
FAULTS: dict[str, tuple[float | None, str | None, str]] = {
    "drop-records": (
        0.02,
        "FRACTION",
        "lose a burst of FRACTION of the span's steps as counted drops",
    ),
    "torn-segment": (None, None, "truncate one segment mid-frame"),
    "bit-flip": (None, None, "flip one bit inside a step frame of one segment"),
    "intact-copy": (None, None, "keep the damaged segment's intact bytes under redelivery/"),
    "duplicate-segment": (None, None, "deliver one segment twice under another name"),
    "trailing-garbage": (None, None, "append bytes that are no frame after a segment's last frame"),
    "empty-segment": (None, None, "a zero-byte file named like a delivery of a segment"),
    "hostile-outbox": (
        None,
        None,
        "a directory, FIFO, dangling symlink, symlink loop and unreadable file named like segments",
    ),
    "clock-skew": (36.0, "SECONDS", "a replica's wall clock runs slow by SECONDS per hour"),
    "clock-jump": (7200.0, "SECONDS", "a replica's wall clock steps by SECONDS halfway through"),
    "missing-head": (0.25, "FRACTION", "the segments of the span's first FRACTION never arrive"),
    "missing-middle": (
        0.1,
        "FRACTION",
        "the segments of FRACTION of the span from 40% never arrive",
    ),
    "missing-tail": (0.25, "FRACTION", "the segments of the span's last FRACTION never arrive"),
    "torn-last-segment": (None, None, "truncate the replica's last segment mid-frame"),
    "divergent-copy": (None, None, "split the last segment in two files with one segment id"),
    "impossible-kv": (100.0, "FACTOR", "the hook reports FACTOR times each request's KV blocks"),
    "no-dcgm": (None, None, "the replica's DCGM samples are never scraped"),
    "silent-replica": (None, None, "a replica's segments are never delivered"),
    "sink-down": (1.0, "ATTEMPTS", "the alert webhook refuses its first ATTEMPTS deliveries"),
    "missing-context": (0.05, "FRACTION", "FRACTION of requests have no gateway line"),
    "idle-replica": (None, None, "one replica gets no traffic"),
    "host-stall": (0.5, "FRACTION", "steps wait on the host for FRACTION of their GPU time"),
    "new-engine-version": (None, None, "the log reports an engine version with no calibration"),
}

# What a replica's engine reports normally, and under `new-engine-version`.
ENGINE_VERSION = "0.11.0"
UNCALIBRATED_ENGINE_VERSION = "0.12.0rc2"
DRIVER_VERSION = "570.172.08"


# Faults whose value is a fraction of the span or of the requests.
_FRACTIONS = ("drop-records", "missing-context", "missing-head", "missing-middle", "missing-tail")


class FaultError(InputError):
    """A fault knob is unknown or has a bad value; the message names it."""


def parse_fault(text: str) -> tuple[str, float | None]:
    """`NAME` or `NAME=VALUE` -> (name, value or the fault's default)."""
    name, sep, raw = text.partition("=")
    name = name.strip()
    if name not in FAULTS:
        raise FaultError(f"unknown fault {name!r}; known faults: {', '.join(FAULTS)}")
    default, value_name, _ = FAULTS[name]
    if not sep:
        return name, default
    if value_name is None:
        raise FaultError(f"fault {name!r} takes no value (got {raw!r})")
    try:
        value = float(raw)
    except ValueError as err:
        raise FaultError(f"fault {name!r}: value {raw!r} is not a number") from err
    return name, validate_fault(name, value)


def validate_fault(name: str, value: float | None) -> float | None:
    if name not in FAULTS:
        raise FaultError(f"unknown fault {name!r}; known faults: {', '.join(FAULTS)}")
    default, value_name, _ = FAULTS[name]
    if value is None or value_name is None:
        return default
    if name in _FRACTIONS and not 0.0 < value <= 1.0:
        raise FaultError(f"fault {name!r}: fraction {value} must be in (0, 1]")
    if name == "impossible-kv" and value <= 1.0:
        raise FaultError(f"fault {name!r}: factor {value} must exceed 1")
    if name == "host-stall" and value <= 0.0:
        raise FaultError(f"fault {name!r}: fraction {value} must be positive")
    if name == "sink-down" and (value < 1 or value != int(value)):
        raise FaultError(f"fault {name!r}: {value} deliveries must be a whole number from 1")
    if name == "clock-skew" and not 0.0 < value < 3600.0:
        raise FaultError(f"fault {name!r}: {value} seconds per hour must be in (0, 3600)")
    if name == "clock-jump" and not 60.0 <= abs(value) <= 86_400.0:
        raise FaultError(
            f"fault {name!r}: a step of {value} seconds must be 60 to 86400 either way"
        )
    return value


@dataclass(frozen=True)
class ReplicaFaults:
    """The faults that act while one replica is simulated."""

    drop_window_ns: tuple[int, int] | None = None  # steps starting in [a, b) are dropped
    # steps starting in [a, b) are logged in segments that are never delivered
    lost_window_ns: tuple[int, int] | None = None
    wall_rate: float = 1.0  # wall-clock seconds per true second
    # (from ns into the span, step ns): the wall clock steps once
    wall_jump: tuple[int, int] | None = None
    host_stall_fraction: float = 0.0
    kv_factor: float = 1.0  # the hook reports each request's KV blocks this many times over
    engine_version: str = ENGINE_VERSION


# Faults that damage delivered segment files, in the order they are applied: the duplicate is
# taken before any damage, and every later fault starts from the intact middle segment.
FILE_FAULTS = (
    "duplicate-segment",
    "divergent-copy",
    "torn-last-segment",
    "torn-segment",
    "bit-flip",
    "trailing-garbage",
    "empty-segment",
    "hostile-outbox",
)
# Bytes `trailing-garbage` appends: no frame marker, so nothing can pass for a frame.
GARBAGE = b"\x00garbage after the last frame\xff" * 4


def damage_segments(
    out_dir: Path, replica: str, segments: list[Path], faults: dict[str, float | None]
) -> dict[str, str]:
    """Apply the file faults to `replica`'s delivered `segments`; what was done, by fault."""
    notes: dict[str, str] = {}
    wanted = [name for name in FILE_FAULTS if name in faults]
    if "silent-replica" in faults:
        if wanted:
            raise FaultError(
                f"fault 'silent-replica' leaves no segment for {wanted[0]!r} to damage"
            )
        for segment in segments:
            segment.unlink()
        return {
            "silent-replica": f"{replica}: none of its {len(segments)} segment(s) delivered; "
            "DCGM and the gateway still show its work"
        }
    if not wanted:
        return notes
    if not segments:
        raise FaultError(f"fault {wanted[0]!r}: replica {replica} wrote no segment to damage")
    middle = len(segments) // 2
    segment = segments[middle]
    intact = segment.read_bytes()
    shown = segment.relative_to(out_dir)
    for name in wanted:
        notes[name] = _apply_file_fault(name, segments, out_dir)
    if "intact-copy" in faults:
        if not {"torn-segment", "bit-flip"} & set(faults):
            raise FaultError("fault 'intact-copy' needs torn-segment or bit-flip")
        kept = DataDir(out_dir).redelivery / segment.relative_to(out_dir)
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_bytes(intact)
        notes["intact-copy"] = f"intact bytes of {shown} kept as {kept.relative_to(out_dir)}"
    return notes


def _apply_file_fault(name: str, segments: list[Path], out_dir: Path) -> str:
    """Damage the files as the file fault `name` does (the middle segment unless it says
    otherwise); what was done."""
    segment = segments[len(segments) // 2]
    shown = segment.relative_to(out_dir)
    if name == "duplicate-segment":
        # From another segment when there is one, so each fault leaves its own artefact.
        original = segments[max(len(segments) // 2 - 1, 0)]
        copy = original.with_name(f"{original.stem}-redelivered.seg")
        shutil.copyfile(original, copy)
        return f"{original.relative_to(out_dir)} delivered again as {copy.name}"
    if name == "divergent-copy":
        return _split(segments[-1], out_dir)
    if name == "torn-last-segment":
        last = segments[-1]
        return f"{last.relative_to(out_dir)} truncated to {_tear(last)} bytes mid-frame"
    if name == "torn-segment":
        return f"{shown} truncated to {_tear(segment)} bytes mid-frame"
    if name == "bit-flip":
        return f"{shown}: bit {_flip(segment)} flipped inside a step frame"
    if name == "trailing-garbage":
        with segment.open("ab") as handle:
            handle.write(GARBAGE)
        return f"{shown}: {len(GARBAGE)} bytes appended after the last frame"
    if name == "empty-segment":
        empty = _beside(segment, "0e")
        empty.touch()
        return f"{empty.relative_to(out_dir)}: zero bytes, named like {segment.name}"
    return "; ".join(
        f"{path.relative_to(out_dir)}: {what}" for path, what in _hostile_entries(segment)
    )


def _beside(segment: Path, id_prefix: str) -> Path:
    """A name like `segment`'s (same replica and first sequence number), another segment id."""
    replica_and_seq = segment.name.removesuffix(".seg").rsplit(".", 1)[0]
    return segment.with_name(f"{replica_and_seq}.{id_prefix}.seg")


def _hostile_entries(segment: Path) -> list[tuple[Path, str]]:
    directory, fifo, dangling, loop, unreadable = (
        _beside(segment, prefix) for prefix in ("d1", "f1f0", "dead", "100b", "0000")
    )
    directory.mkdir()
    os.mkfifo(fifo)
    dangling.symlink_to(segment.with_name("missing.seg"))
    loop.symlink_to(loop.name)
    shutil.copyfile(segment, unreadable)
    unreadable.chmod(0)
    return [
        (directory, "a directory"),
        (fifo, "a FIFO"),
        (dangling, "a dangling symlink"),
        (loop, "a symlink to itself"),
        (unreadable, "a copy of mode 000"),
    ]


def _split(segment: Path, out_dir: Path) -> str:
    """Write `segment`'s step frames after its middle one into a second file behind the same
    preamble and header frame, and cut them from `segment`; what was done."""
    data = segment.read_bytes()
    payload_length = FRAME_PREFIX.unpack_from(data, PREAMBLE.size)[4]
    header_end = PREAMBLE.size + FRAME_PREFIX.size + payload_length
    cut = data.find(FRAME_MARKER, header_end + (len(data) - header_end) // 2)
    if cut < 0:
        raise FaultError(f"fault 'divergent-copy': {segment} has too few frames to split")
    other = _beside(segment, "d2")
    other.write_bytes(data[:header_end] + data[cut:])
    segment.write_bytes(data[:cut])
    for part in (segment, other):
        if read_segments([part]).damage.num_rows:
            raise RuntimeError(f"{part}: the split did not fall on a frame boundary")
    return (
        f"{segment.relative_to(out_dir)} cut at byte {cut}; its frames from there on written "
        f"as {other.relative_to(out_dir)} under the same segment id"
    )


def _tear(segment: Path) -> int:
    """Truncate `segment` inside a frame; returns the new length in bytes."""
    data = segment.read_bytes()
    for cut in range(int(len(data) * 0.6), len(data)):
        segment.write_bytes(data[:cut])
        if "torn_tail" in read_segments([segment]).damage.column("kind").to_pylist():
            return cut
    segment.write_bytes(data)
    raise RuntimeError(f"{segment}: found no cut the decoder reads as a torn frame")


def _flip(segment: Path) -> int:
    """Flip a bit in the payload of a step frame near the middle of `segment`; returns which
    bit (counted from the start of the file)."""
    data = bytearray(segment.read_bytes())
    frame_at = data.find(FRAME_MARKER, len(data) // 2)
    if frame_at < PREAMBLE.size:
        raise RuntimeError(f"{segment}: no frame after the middle to damage")
    bit = (frame_at + 20) * 8 + 3
    data[bit // 8] ^= 1 << (bit % 8)
    segment.write_bytes(bytes(data))
    if "corrupt_frame" not in read_segments([segment]).damage.column("kind").to_pylist():
        raise RuntimeError(f"{segment}: the flipped bit at {bit} did not damage a frame")
    return bit
