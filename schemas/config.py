"""The pools file (`pools.yaml`): what the pipeline needs to know about each inference pool.

The same file drives production and the simulator. Production reads everything but the
optional `workload` block, which only `stepledger simulate` uses to generate traffic.
"""

from __future__ import annotations

import hashlib
import json
import math
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pricing.deployment import All2AllBackend, CudagraphMode, Deployment
from pricing.spec import load_chip

# load_pools raises it: its callers may take it from here.
from schemas.errors import ConfigError as ConfigError
from schemas.records import rank_stream_id
from schemas.units import HOUR_NS, NanoUSD, nano_of_usd, nano_to_usd, usd_to_nano

# The largest price per replica-hour the allocator bills exactly: its clock
# (pipeline.attribution.clock) multiplies a price by an instant of the hour (< 2**42 ns) split
# at bit 20, so every product stays below 2**63 (halved for the sum of two products).
MAX_PRICE_PER_HOUR_NANO = (1 << 63) // (HOUR_NS >> 20) // 2


class _Strict(BaseModel):
    # The pools file holds tenants' raw API keys: a validation error must not echo its input
    # (a tenant, a pool with its workload) into a log or Dagster's event log.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


class Replica(_Strict):
    id: str = Field(min_length=1)
    hostname: str = Field(min_length=1)
    # One UUID per GPU of the replica (its TP ranks); DCGM samples are matched on these.
    gpu_uuids: list[str] = Field(min_length=1)


class EngineSettings(_Strict):
    """How the engine batches: the pricing kernel and the simulator both need these."""

    # The engine serving the pool, as its step hook names it in segment headers (the
    # simulator writes it into the headers it makes).
    name: Literal["vllm", "sglang"] = "vllm"
    max_num_seqs: int = Field(default=256, gt=0)
    max_num_batched_tokens: int = Field(default=8192, gt=0)
    cudagraph_mode: CudagraphMode = "FULL_AND_PIECEWISE"
    decode_threshold: int = Field(default=1, gt=0)
    num_spec_tokens: int = Field(default=0, ge=0)
    # KV blocks on the replica; the simulator's scheduler admits while blocks are free.
    total_kv_blocks: int = Field(default=8192, gt=0)


class AlphaFromEvidence(_Strict):
    """alpha = max_alpha - (max_alpha - min_alpha) * blocked_fraction.

    blocked_fraction is the share of the billing period's steps in which admission waited on
    free KV blocks: a pool that never waits for memory is charged on compute alone
    (max_alpha), one that always waits weighs memory-time as much as min_alpha allows.
    """

    min_alpha: float = Field(default=0.5, ge=0.0, le=1.0)
    max_alpha: float = Field(default=1.0, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _ordered(self) -> AlphaFromEvidence:
        if self.min_alpha > self.max_alpha:
            raise ValueError(f"min_alpha {self.min_alpha} exceeds max_alpha {self.max_alpha}")
        return self


# Former spelling -> current name of an idle policy (CHANGELOG.md says when each changed).
RENAMED_IDLE_POLICIES = {"both": "spread_then_headroom"}


class Policies(_Strict):
    """Attribution policies of a pool. Every ledger row records `version()` of these."""

    weights: Literal["kernel", "fitted"] = "kernel"
    fixed_cost: Literal["per_slot", "per_token"] = "per_slot"
    alpha: Annotated[float, Field(ge=0.0, le=1.0)] | AlphaFromEvidence = 0.8
    prefix_cache: Literal["first_writer", "split_by_holders", "cache_read"] = "split_by_holders"
    # Under cache_read: cache-hit tokens are charged this fraction of the prefill rate.
    cache_read_fraction: float = Field(default=0.1, ge=0.0, le=1.0)
    # spread_then_headroom: idle up to (1 - target_utilization) of the hour is spread; beyond
    # is headroom.
    idle: Literal["spread", "capacity_owner", "spread_then_headroom"] = "spread_then_headroom"
    platform_pays_platform_retries: bool = True
    # Unattributed share of the hour's usage above which on-call is paged.
    unattributed_alert_fraction: float = Field(default=0.02, ge=0.0, le=1.0)

    @field_validator("idle", mode="before")
    @classmethod
    def _renamed_idle_policy(cls, value: object) -> object:
        if value in RENAMED_IDLE_POLICIES:
            raise ValueError(
                f"idle policy {value!r} is now called {RENAMED_IDLE_POLICIES[value]!r} "
                "(same behaviour, see CHANGELOG.md): write that name instead"
            )
        return value

    def version(self) -> str:
        """A short stable hash of the policy settings: equal policies, equal version."""
        settings = self.model_dump(mode="json")
        # The version hashes what the policies do, so a renamed policy keeps its old spelling
        # here: ledger rows from before the rename stay comparable with those after it.
        former = {new: old for old, new in RENAMED_IDLE_POLICIES.items()}
        settings["idle"] = former.get(settings["idle"], settings["idle"])
        canonical = json.dumps(settings, sort_keys=True)
        return "pol-" + hashlib.sha256(canonical.encode()).hexdigest()[:10]


class LengthDistribution(_Strict):
    """Log-normal token counts, clipped to [min, max]."""

    median: float = Field(gt=0)
    sigma: float = Field(default=0.6, ge=0)
    min: int = Field(default=1, ge=1)
    max: int = Field(default=32768, ge=1)


class Feature(_Strict):
    name: str = Field(min_length=1)
    requests_per_s: float = Field(gt=0)
    prompt_tokens: LengthDistribution
    output_tokens: LengthDistribution
    # Tokens of a system prompt every request of this feature starts with (prefix-cache hits).
    system_prompt_tokens: int = Field(default=0, ge=0)


class Tenant(_Strict):
    name: str = Field(min_length=1)
    api_keys: list[str] = Field(min_length=1)
    features: list[Feature] = Field(min_length=1)


class Workload(_Strict):
    """Traffic for `stepledger simulate`; production ignores it."""

    tenants: list[Tenant] = Field(min_length=1)
    # Fraction of requests that are a client retry of an earlier one, and how many of those
    # were caused by a platform timeout rather than the client.
    retry_fraction: float = Field(default=0.01, ge=0.0, le=1.0)
    platform_timeout_fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    # Relative step-time measurement noise (standard deviation).
    step_noise: float = Field(default=0.03, ge=0.0, le=1.0)


class Pool(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    model: str
    gpu_type: str
    gpus_per_replica: int = Field(gt=0)
    dtype: str = "bf16"
    kv_cache_dtype: str = "bf16"
    kv_block_size: int = Field(default=16, gt=0)
    usd_per_gpu_hour: float = Field(gt=0)
    capacity_owner: str = Field(min_length=1)
    slo_owner: str = Field(min_length=1)
    target_utilization: float = Field(default=0.7, gt=0.0, le=1.0)
    engine: EngineSettings = EngineSettings()
    # Attention data-parallel replicas within one replica's GPUs (TP = gpus_per_replica /
    # data_parallel each) feeding one MoE group, and how its experts are placed (pricing.Deployment).
    data_parallel: int = Field(default=1, gt=0)
    expert_parallel: bool = False
    eplb_redundant_experts: int = Field(default=0, ge=0)
    all2all_backend: All2AllBackend = "allgather_reducescatter"
    decode_context_parallel: int = Field(default=1, gt=0)
    replicas: list[Replica] = Field(min_length=1)
    policies: Policies = Policies()
    workload: Workload | None = None

    @model_validator(mode="after")
    def _replicas_match_width(self) -> Pool:
        if self.gpus_per_replica % self.data_parallel:
            raise ValueError(
                f"gpus_per_replica {self.gpus_per_replica} is not a multiple of "
                f"data_parallel {self.data_parallel}"
            )
        for replica in self.replicas:
            if len(replica.gpu_uuids) != self.gpus_per_replica:
                raise ValueError(
                    f"replica {replica.id!r} lists {len(replica.gpu_uuids)} GPU UUIDs, "
                    f"expected gpus_per_replica={self.gpus_per_replica}"
                )
        ids = [r.id for r in self.replicas]
        if len(set(ids)) != len(ids):
            raise ValueError(f"replica ids repeat: {sorted(ids)}")
        return self

    @model_validator(mode="after")
    def _price_bills_exactly(self) -> Pool:
        """The allocator bills in whole nano-dollars, exactly, up to a price per replica-hour
        its int64 arithmetic can hold: a price it could only bill rounded, as nothing, or
        wrapped around is refused here rather than billed wrong."""
        price = self.usd_per_gpu_hour
        exact = nano_of_usd(Decimal(repr(price))) if math.isfinite(price) else None
        if exact is None:
            why = "is not a finite number"
        elif exact.to_integral_value() == 0:
            why = "rounds to 0 nano-dollars per GPU-hour"
        elif exact * self.gpus_per_replica > MAX_PRICE_PER_HOUR_NANO:
            why = (
                f"makes {price * self.gpus_per_replica:g} USD per replica-hour "
                f"({self.gpus_per_replica} GPUs), above the "
                f"{nano_to_usd(MAX_PRICE_PER_HOUR_NANO)} USD the allocator bills exactly"
            )
        elif exact != exact.to_integral_value():
            why = f"is not a whole number of nano-dollars ({exact.normalize():f})"
        else:
            return self
        raise ValueError(f"pool {self.name!r}: usd_per_gpu_hour {self.usd_per_gpu_hour!r} {why}")

    @property
    def gpus_per_stream(self) -> int:
        """GPUs one step stream runs on: one attention data-parallel rank's share."""
        return self.gpus_per_replica // self.data_parallel

    @property
    def streams(self) -> list[Replica]:
        """What the pipeline bills and reconciles as replicas: one per step stream. With
        attention data parallelism each rank schedules its own batches on its own GPUs (TP
        ranks are listed in order, a rank's `gpus_per_stream` of them together), so each rank
        is a stream of its own (`rank_stream_id`), on the replica's host; otherwise each
        replica is one stream."""
        if self.data_parallel == 1:
            return self.replicas
        width = self.gpus_per_stream
        return [
            Replica(
                id=rank_stream_id(replica.id, rank),
                hostname=replica.hostname,
                gpu_uuids=replica.gpu_uuids[rank * width : (rank + 1) * width],
            )
            for replica in self.replicas
            for rank in range(self.data_parallel)
        ]

    @property
    def nano_per_gpu_hour(self) -> NanoUSD:
        """The GPU-hour price in integer nano-dollars: exact, as `_price_bills_exactly` admits
        only prices that are whole nano-dollars as written."""
        return usd_to_nano(Decimal(repr(self.usd_per_gpu_hour)))

    def deployment(self) -> Deployment:
        """The deployment this pool serves: chip = gpu_type, TP = gpus_per_replica over its
        attention data-parallel replicas."""
        chip = load_chip(self.gpu_type)
        tp = self.gpus_per_replica // self.data_parallel
        engine = self.engine
        return Deployment(
            model=self.model,
            chip=self.gpu_type,
            dtype=self.dtype,
            cache_dtype=self.kv_cache_dtype,
            tp=tp,
            nodes=-(-tp // chip.gpus_per_node),
            data_parallel=self.data_parallel,
            expert_parallel=self.expert_parallel,
            eplb_redundant_experts=self.eplb_redundant_experts,
            all2all_backend=self.all2all_backend,
            decode_context_parallel=self.decode_context_parallel,
            cudagraph_mode=engine.cudagraph_mode,
            max_num_seqs=engine.max_num_seqs,
            decode_threshold=engine.decode_threshold,
            num_spec_tokens=engine.num_spec_tokens,
        )


class Settings(_Strict):
    """Pipeline-wide tolerances and delays."""

    # Relative tolerance of the time check (step time + gaps vs wall-clock time).
    time_tolerance_fraction: float = Field(default=0.005, ge=0.0, lt=1.0)
    # Absolute band of the DCGM plausibility check (busy fraction vs mean engine activity).
    dcgm_tolerance: float = Field(default=0.10, ge=0.0, le=1.0)
    # Minutes after an hour ends before the schedule materializes it (late files).
    late_file_delay_minutes: int = Field(default=15, ge=0)
    # Minutes after an hour ends by which it must be reconciled, or the dead-man alert fires.
    deadman_minutes: int = Field(default=120, gt=0)
    # Relative drift of a fresh calibration fit against the stored one that raises an alert.
    calibration_drift_fraction: float = Field(default=0.15, gt=0.0)


class PoolsFile(_Strict):
    settings: Settings = Settings()
    pools: list[Pool] = Field(min_length=1)

    @field_validator("pools")
    @classmethod
    def _unique_names(cls, pools: list[Pool]) -> list[Pool]:
        names = [p.name for p in pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names repeat: {sorted(names)}")
        replica_ids = [r.id for p in pools for r in p.replicas]
        if len(set(replica_ids)) != len(replica_ids):
            raise ValueError("replica ids must be unique across pools")
        # An attention data-parallel rank's stream is billed as a replica of its own.
        streams = [s.id for p in pools if p.data_parallel > 1 for s in p.streams]
        clashes = sorted(set(streams) & set(replica_ids))
        if clashes:
            raise ValueError(
                f"replica ids {clashes} are also the streams of attention data-parallel ranks"
            )
        return pools

    def pool(self, name: str) -> Pool:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(f"no pool named {name!r}; the pools file has {[p.name for p in self.pools]}")


Model = TypeVar("Model", bound=BaseModel)

DEFAULT_POOLS_PATH = Path(__file__).resolve().parent.parent / "pipeline/data/pools.yaml"


def _line_of(text: str, loc: tuple[int | str, ...]) -> int | None:
    """Best-effort line number of a pydantic error location in a YAML document."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    if node is None:
        return None
    for key in loc:
        if isinstance(node, yaml.MappingNode) and isinstance(key, str):
            match = [v for k, v in node.value if getattr(k, "value", None) == key]
            if not match:
                break
            node = match[0]
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
        else:
            break
    return node.start_mark.line + 1


def load_pools(path: str | Path = DEFAULT_POOLS_PATH) -> PoolsFile:
    """Read and validate a pools file; errors name the file, line and field."""
    return load_yaml_model(path, PoolsFile, "pools file")


def load_yaml_model(path: str | Path, model: type[Model], what: str) -> Model:
    """Read a YAML file and validate it as `model`; errors name the file, line and field."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{path}: cannot read {what}: {err.strerror}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}): {err.reason}") from err
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: not valid YAML: {err}") from err
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "(top level)"
        line = _line_of(text, first["loc"])
        where = f":{line}" if line else ""
        more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
        raise ConfigError(f"{path}{where}: field {field}: {first['msg']}{more}") from err
