"""A simulated data directory delivered as it would arrive: its segments land in another data
directory in the order their last steps ended, up to a given time, for the live path's tests,
benchmarks and demo (`pipeline.simulator` writes a whole span at once)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.datadir import DataDir
from pipeline.ingestion.decoder import read_segments
from pipeline.ingestion.ingest import segment_files


def segments_by_close(outbox: Path, rotate_ns: int) -> list[tuple[int, Path]]:
    """Each segment under `outbox` with when its recorder shipped it (UTC ns): at the end of
    the rotation window its first step started in, or when its last step ended if later;
    oldest first. The simulator's windows are `rotate_ns` long from the hour."""
    closing = []
    for path in segment_files(outbox):
        steps = read_segments([path]).steps
        if steps.num_rows:
            window_end = (
                min(steps.column("start_utc_ns").to_pylist()) // rotate_ns + 1
            ) * rotate_ns
            closing.append((max(window_end, *steps.column("end_utc_ns").to_pylist()), path))
    return sorted(closing)


@dataclass
class OutboxReplay:
    """Delivers the segments of `source` into `target` as the clock passes their close."""

    source: Path
    target: Path
    rotate_ns: int
    pending: list[tuple[int, Path]] = field(default_factory=list)

    def __post_init__(self) -> None:
        source, target = DataDir(self.source), DataDir(self.target)
        self.target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source.own_pools_file, target.own_pools_file)
        # The gateway logs a request when it arrives, before its first step.
        shutil.copytree(source.gateway, target.gateway, dirs_exist_ok=True)
        self.pending = segments_by_close(source.outbox, self.rotate_ns)

    def deliver_until(self, utc_ns: int) -> list[tuple[int, Path]]:
        """Ship every segment whose last step ended by `utc_ns` (atomically, as the recorder
        does); returns them with their close times."""
        shipped = [(end, path) for end, path in self.pending if end <= utc_ns]
        self.pending = self.pending[len(shipped) :]
        for _, path in shipped:
            landed = self.target / path.relative_to(self.source)
            landed.parent.mkdir(parents=True, exist_ok=True)
            partial = landed.with_name(f".{landed.name}.partial")
            shutil.copy2(path, partial)
            os.replace(partial, landed)
        return shipped
