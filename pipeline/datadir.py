"""A data directory's layout: what one deployment keeps where, for the CLI, the Dagster
resources and the benchmarks alike.

    outbox/<replica>/*.seg     step-log segments, as the engine hook writes them
    gateway/<hour>.jsonl       the gateway's request context, one file per UTC hour
    dcgm/<host>/<hour>.prom    DCGM exporter scrapes
    lake/                      the Parquet lake (pipeline.storage.lake)
    redelivery/                intact copies of damaged segments
    pools.yaml                 the pools, when the directory has its own
    calibration.yaml           the calibrated work-model coefficients
    pipeline.duckdb            the pipeline's state (pipeline.storage.warehouse.STATE_FILE)
    warehouse/                 the DuckLake warehouse (its catalog and data files)
    warehouse.duckdb           the warehouse of the previous layout, one DuckDB file
    alerts_sent.keys           the alerts already delivered
    api_tokens.json            the read API's bearer tokens, hashed (`stepledger tokens`)

`DataDir` names each path and `check_output` keeps a command's output file from replacing any of these.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from pipeline.storage.warehouse import PREVIOUS_LAYOUT_FILE, STATE_FILE, WAREHOUSE_DIR
from schemas.config import DEFAULT_POOLS_PATH
from schemas.errors import InputError
from schemas.units import parse_hour_key

DATA_ENV = "STEPLEDGER_DATA"


@dataclass(frozen=True)
class DataDir:
    """One data directory: every module asks it where a kind of file lives."""

    root: Path

    @property
    def outbox(self) -> Path:
        """Step-log segments, one directory per replica."""
        return self.root / "outbox"

    def replica_outbox(self, replica: str) -> Path:
        return self.outbox / replica

    @property
    def gateway(self) -> Path:
        """The gateway's request context, one JSON-lines file per UTC hour."""
        return self.root / "gateway"

    @property
    def dcgm(self) -> Path:
        return self.root / "dcgm"

    @property
    def lake(self) -> Path:
        return self.root / "lake"

    @property
    def redelivery(self) -> Path:
        """Intact copies of damaged segments, for the engine's redelivery."""
        return self.root / "redelivery"

    @property
    def own_pools_file(self) -> Path:
        return self.root / "pools.yaml"

    @property
    def pools_file(self) -> Path:
        """The directory's own pools file, else the default pools."""
        own = self.own_pools_file
        return own if own.is_file() else DEFAULT_POOLS_PATH

    @property
    def calibration_file(self) -> Path:
        return self.root / "calibration.yaml"

    @property
    def state_file(self) -> Path:
        return self.root / STATE_FILE

    @property
    def warehouse(self) -> Path:
        return self.root / WAREHOUSE_DIR

    @property
    def previous_layout_file(self) -> Path:
        return self.root / PREVIOUS_LAYOUT_FILE

    @property
    def sent_alert_keys(self) -> Path:
        """The dedup keys of the alerts already delivered."""
        return self.root / "alerts_sent.keys"

    @property
    def api_tokens(self) -> Path:
        """The read API's bearer tokens, stored hashed."""
        return self.root / "api_tokens.json"

    def hours(self) -> list[datetime]:
        """The hours the gateway logged requests for (one file per hour)."""
        return sorted(parse_hour_key(p.stem) for p in self.gateway.glob("*.jsonl"))

    def protected(self) -> list[Path]:
        """What a command's output must never replace: the inputs, the lake, the pipeline's
        state and the warehouse (a directory with everything beneath it), and the intact
        copies of damaged segments."""
        return [
            self.outbox,
            self.gateway,
            self.dcgm,
            self.lake,
            self.redelivery,
            self.warehouse,
            self.own_pools_file,
            self.calibration_file,
            self.state_file,
            self.previous_layout_file,
            self.api_tokens,
        ]


# Files a DuckDB or SQLite database keeps beside itself while it is open.
_SIDECARS = (".wal", "-wal", "-journal", "-shm")


class OutputPathError(InputError):
    """An output path would replace an input, a data directory's file or the warehouse."""


def check_output(out: Path, data_dir: Path, inputs: Iterable[Path] = ()) -> Path:
    """`out` resolved, unless writing it would replace a file of `data_dir` (`DataDir.protected`,
    or beneath one of its directories), one of `inputs` (files the command reads, e.g. a warehouse
    named elsewhere), or a database's sidecar of either. Symlinks are followed on both sides,
    as opening `out` would; an existing `out` that is a hard link of a protected file counts
    as that file."""
    target = out.resolve()
    protected = [
        (path.resolve(), f"the data directory's {path.name}")
        for path in DataDir(data_dir).protected()
    ]
    protected += [(path.resolve(), "an input of this command") for path in inputs]
    for path, what in protected:
        sidecars = [path.with_name(path.name + suffix) for suffix in _SIDECARS]
        if target in sidecars:
            what = f"a file its database keeps beside {what}"
        elif target != path and target.is_relative_to(path):
            what = f"inside {what}"
        elif target != path and not (
            target.is_file() and path.is_file() and os.path.samefile(target, path)
        ):
            continue
        raise OutputPathError(
            f"{out}: refusing to write there, it is {what} ({path}); choose an output path "
            "outside the data directory's inputs, lake and warehouse"
        )
    return target
