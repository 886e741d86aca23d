"""The replica descriptor: what an engine adapter needs to know of the pools file about its own
replica, to fill the segment header and to refuse an engine that runs other than its pool
declares.

The pools file needs YAML and pydantic, which the engine's process does not load: `stepledger
hook-config --replica R` reads it where the pipeline runs and writes this small JSON file, and
the adapter reads that with `json` alone, from the path in STEPLEDGER_HOOK_CONFIG.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from schemas.errors import ConfigError
from schemas.records import (
    COUNT,
    NAME,
    TEXT,
    FieldError,
    JsonRecord,
    SegmentHeader,
    rank_stream_id,
)

log = logging.getLogger(__name__)

HOOK_CONFIG_ENV = "STEPLEDGER_HOOK_CONFIG"


class HookConfigError(ConfigError):
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
    # The pool's attention data-parallel ranks per replica (1 in descriptors written before
    # the field existed): each rank's steps are the stream `rank_stream_id` names.
    data_parallel: int = field(default=1, metadata=COUNT)


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


def driver_version() -> str:
    """The NVIDIA kernel driver version, from STEPLEDGER_DRIVER_VERSION or /proc."""
    configured = os.environ.get("STEPLEDGER_DRIVER_VERSION")
    if configured:
        return configured
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return "unknown"
    for word in text.split():
        if word.count(".") >= 1 and word.replace(".", "").isdigit():
            return word
    return "unknown"


def model_names(*names: str) -> set[str]:
    """Names an engine knows its model by, lower-cased: each of `names` (its served name, the
    model's path or repository) and the last path component of each."""
    return {n.lower() for name in names for n in (name, name.rstrip("/").rpartition("/")[2])}


def _name_tokens(name: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", name.lower()))


@dataclass(frozen=True)
class EngineFacts:
    """What the engine says it runs, read when its scheduler is built."""

    engine_name: str
    engine_version: str
    driver_version: str
    gpus: int
    # How the GPU count came about, for the refusal (e.g. "2 GPUs (tp_size=2, pp_size=1)").
    gpus_described: str
    served_model_name: str
    model: str
    # The GPU the platform names, or None where it names none (a CPU platform).
    device: str | None
    kv_block_size: int
    # Its parallel layout, where the engine's hook reports it: tensor and expert parallel
    # sizes, and the attention data-parallel rank this process schedules for and the ranks'
    # count (each rank a step stream on its share of the GPUs).
    tp_size: int | None = None
    ep_size: int | None = None
    attn_dp_rank: int | None = None
    attn_dp_size: int | None = None


def checked_header(replica: ReplicaDescriptor, engine: EngineFacts) -> SegmentHeader:
    """The segment header of `replica` (of its attention data-parallel rank's stream, with more
    than one), refused unless the engine runs what its pool declares: its attention ranks, its
    GPU count, its model (the pool's name among the engine's `model_names`) and, where the
    platform names it, its GPU (every word of the pool's gpu_type in the device name, as
    "h100" in "NVIDIA H100 80GB HBM3"). Pricing, calibration and reconciliation key on the
    pool's names, so an engine serving anything else would be billed as the wrong model or
    chip: refused before it serves. The engine's own names go in the header beside them."""
    name, pool = replica.replica, replica.pool
    ranks = engine.attn_dp_size or 1
    if ranks != replica.data_parallel:
        raise HookConfigError(
            f"replica {name!r} runs {ranks} attention data-parallel rank(s) but pool {pool!r} "
            f"declares data_parallel={replica.data_parallel}"
        )
    if engine.gpus != replica.gpus_per_replica:
        raise HookConfigError(
            f"replica {name!r} runs on {engine.gpus_described} but pool {pool!r} declares "
            f"gpus_per_replica={replica.gpus_per_replica}"
        )
    if replica.model.lower() not in model_names(engine.served_model_name, engine.model):
        raise HookConfigError(
            f"replica {name!r} serves {engine.served_model_name!r} (model {engine.model!r}) "
            f"but pool {pool!r} declares model {replica.model!r}: serve it as "
            f"--served-model-name {replica.model}, or put the replica in the pool of the model "
            "it serves"
        )
    if engine.device is None:
        log.warning(
            "%s's platform names no GPU here: replica %r is recorded with gpu_type %r from "
            "pool %r, unchecked",
            engine.engine_name,
            name,
            replica.gpu_type,
            pool,
        )
    elif not _name_tokens(replica.gpu_type) <= _name_tokens(engine.device):
        raise HookConfigError(
            f"replica {name!r} runs on {engine.device!r} but pool {pool!r} declares gpu_type "
            f"{replica.gpu_type!r}: put the replica in the pool of its GPU"
        )
    # Each attention data-parallel rank is a stream of its own, on its share of the GPUs.
    rank = engine.attn_dp_rank
    return SegmentHeader(
        pool=pool,
        replica=rank_stream_id(name, rank) if ranks > 1 and rank is not None else name,
        engine_name=engine.engine_name,
        engine_version=engine.engine_version,
        driver_version=engine.driver_version,
        model=replica.model,
        gpu_type=replica.gpu_type,
        gpus_per_replica=engine.gpus // ranks,
        kv_block_size=engine.kv_block_size,
        engine_model=engine.model,
        engine_device=engine.device,
        tp_size=engine.tp_size,
        ep_size=engine.ep_size,
        attn_dp_rank=rank,
        attn_dp_size=engine.attn_dp_size,
    )
