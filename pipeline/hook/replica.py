"""The replica descriptor: what an engine adapter needs to know of the pools file about its own
replica, to fill the segment header and to refuse an engine that runs other than its pool
declares.

The pools file needs YAML and pydantic, which the engine's process does not load: `stepledger
hook-config --replica R` reads it where the pipeline runs and writes this small JSON file, and
the adapter reads that with `json` alone, from the path in STEPLEDGER_HOOK_CONFIG.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from schemas.records import COUNT, NAME, TEXT, FieldError, JsonRecord

HOOK_CONFIG_ENV = "STEPLEDGER_HOOK_CONFIG"


class HookConfigError(ValueError):
    """The hook's configuration (environment, replica descriptor) is missing or invalid, or the
    engine does not run what its pool declares; the message names the file, field or variable."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaDescriptor(JsonRecord):
    """A replica of the pools file with the pool's names that pricing keys on."""

    pool: str = field(metadata=NAME)
    replica: str = field(metadata=NAME)
    model: str = field(metadata=TEXT)
    gpu_type: str = field(metadata=TEXT)
    gpus_per_replica: int = field(metadata=COUNT)


def read_descriptor(path: Path) -> ReplicaDescriptor:
    """The descriptor in `path`; HookConfigError names the file and what is wrong with it."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise HookConfigError(
            f"{path}: cannot read the replica descriptor ({HOOK_CONFIG_ENV}): {err.strerror}"
        ) from err
    try:
        return ReplicaDescriptor.from_json(data)
    except FieldError as err:
        raise HookConfigError(
            f"{path}: not a replica descriptor ({err}); write it with "
            "`stepledger hook-config --replica REPLICA`"
        ) from err
