"""The registry of reconciliation findings: every way a check can fail, with its severity,
whether it holds the hour back from the finance views, what it means, what on-call does and,
for a finding that holds the hour back, what releases it.

A check builds its findings only from these kinds (`GAP.found("...")`), so a finding's severity
and blocking are stated once, here. The table in `docs/production.md`, the Dagster asset
checks' descriptions (`assets/reconciliation.py`), the pages on-call receives
(`pipeline.reconcile.alerts`) and `stepledger status` are generated from it;
`python -m pipeline.reconcile.findings_doc docs/production.md` rewrites the table after a change.

ERROR pages on-call, WARN is recorded and pages nobody. The findings that block say the numbers
are incomplete or inexact; the others say they may be unfair (host stalls charged to customers,
unattributed usage, stale coefficients) or that a cross-check is unavailable: the hour is still
published. A duplicated segment does not block: the decoder kept one copy, so nothing is lost or
counted twice. Damage blocks only where the log misses sequence numbers it could hide: whether an
hour is held is decided by what is missing from the log now, not by what a file once looked like.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Severity = Literal["ERROR", "WARN"]
Weights = Literal["kernel", "fitted"]
# Where a finding is placed: a replica, the pool, or the alert it is about.
Scope = Literal["replica", "pool", "alert"]


@dataclass(frozen=True)
class Finding:
    """One thing a check found wrong: its kind and what exactly, for the result's detail."""

    kind: FindingKind
    text: str


@dataclass(frozen=True)
class FindingKind:
    """A way a check can fail. `code` is the stable short name recorded as the result's
    `finding`; `weights`, when set, limits the kind to pools charging with those weights.
    `runbook` is what on-call does; `releases`, for a kind that holds the hour back, what
    publishes the hour again (empty for the others, which never hold it)."""

    check: str
    code: str
    severity: Severity
    blocks: bool
    scope: Scope
    description: str
    runbook: str
    weights: Weights | None = None
    releases: str = ""

    def found(self, text: str) -> Finding:
        """This kind of finding, with what was found."""
        return Finding(self, text)


@dataclass(frozen=True)
class CheckSpec:
    """A check run on every pool-hour and what it asserts (shown with it in Dagster)."""

    name: str
    asserts: str

    @property
    def blocks_publication(self) -> bool:
        """Whether some finding of the check holds the hour back."""
        return any(kind.blocks for kind in kinds_of(self.name))

    def description(self) -> str:
        """The Dagster asset check's description: the assertion, the findings, the consequence."""
        listed = ", ".join(
            f"{kind.code} ({kind.severity}"
            + (f", weights: {kind.weights})" if kind.weights else ")")
            for kind in kinds_of(self.name)
        )
        consequence = (
            "A failure holds the hour back."
            if self.blocks_publication
            else "The hour is published either way."
        )
        return f"{self.asserts} Findings: {listed}. {consequence}"


def _kind(
    check: str,
    code: str,
    severity: Severity,
    blocks: bool,
    scope: Scope,
    description: str,
    runbook: str,
    weights: Weights | None = None,
    *,
    releases: str = "",
) -> FindingKind:
    """Register a finding kind; the registry keeps each kind once, in the order declared."""
    kind = FindingKind(
        check, code, severity, blocks, scope, description, runbook, weights, releases
    )
    _DECLARED.append(kind)
    return kind


_DECLARED: list[FindingKind] = []

_INSPECT = "`stepledger inspect <outbox>/<replica>` shows which"
_STEPS_GONE = (
    "the steps are gone: the hour stays held back until finance accepts it as is; "
    "the recorder's buffer or the disk needs attention"
)
_SOFTWARE_FAULT = (
    "a software fault, never data: re-run the hour; if it persists keep the hour held back "
    "and report the detail"
)
_STEPS_LOST_FOR_GOOD = (
    "no re-run: the log will never hold those steps; the hour stays held back until finance "
    "accepts it as is"
)
_TIME_RELEASE = "a re-run of the hour whose steps add up to the wall-clock hour"
_MONEY_RELEASE = (
    "a re-run of the hour whose ledger adds up to the invoice at the pools file's price"
)
_PRICE_FAULT = (
    "check that `usd_per_gpu_hour` and the replicas in the pools file are what was paid for, "
    "then re-run; if it persists keep the hour held back and report the detail"
)
_RECALIBRATE = (
    "run a calibration sweep on the version, `stepledger calibrate --data <segments> --store "
    "<data>/calibration.yaml`, then re-run the affected hours"
)
_TIME_RUNBOOK = (
    "check the replica's NTP and the sequence check of the same hour; re-run once the log is "
    "complete"
)

GAP = _kind(
    "sequence", "gap", "ERROR", True, "replica",
    "sequence numbers missing with no counted drop or damage to explain them (a segment lost in shipping)",
    f"{_INSPECT}; ship the lost or late segment to the outbox and re-run the hour",
    releases="a re-run of the hour that finds every sequence number in the outbox",
)  # fmt: skip
DROPPED = _kind(
    "sequence", "dropped", "ERROR", True, "replica",
    "the recorder dropped steps: its buffer overflowed",
    _STEPS_GONE,
    releases=_STEPS_LOST_FOR_GOOD,
)  # fmt: skip
MISSING_HEAD = _kind(
    "sequence", "missing_head", "ERROR", True, "replica",
    "the replica's log of the hour starts after sequence numbers no segment holds: the previous "
    "hour's last step, an earlier segment, or seq 0 (where a recorder's log starts) is not "
    "followed by the hour's first step; the first segments of the hour never arrived",
    f"{_INSPECT}; ship the hour's first segments to the outbox and re-run the hour",
    releases="a re-run of the hour that finds the hour's first sequence numbers in the outbox",
)  # fmt: skip
DAMAGE = _kind(
    "sequence", "damage", "ERROR", True, "replica",
    "damaged frames in the replica's segments hide sequence numbers the log is missing (or "
    "damage whose sequence numbers cannot be told)",
    f"{_INSPECT}; deliver an intact copy of the file and re-run the hour, else {_STEPS_GONE}",
    releases="a re-run of the hour once an intact copy of the file is in the outbox; without "
    "one, none: the hour stays held back until finance accepts it as is",
)  # fmt: skip
LOST_TAIL = _kind(
    "sequence", "lost_tail", "ERROR", True, "replica",
    "the replica's last segment ends inside a frame and no later segment follows: the steps "
    "from the torn frame on are unknown (a torn last segment)",
    f"{_INSPECT}; deliver an intact copy of the last segment (or the replica's next segments) "
    "and re-run the hour",
    releases="a re-run of the hour once an intact last segment, or the replica's next "
    "segments, is in the outbox",
)  # fmt: skip
HARMLESS_DAMAGE = _kind(
    "sequence", "harmless_damage", "WARN", False, "replica",
    "damage that hides no sequence number the log is missing (an empty file, bytes after the "
    "last intact frame, a damaged copy whose steps another file holds): reported, not held",
    "nothing for the bill; remove the damaged file from the outbox and find what wrote it",
)  # fmt: skip
DIVERGENT_COPY = _kind(
    "sequence", "divergent_copy", "ERROR", True, "replica",
    "two segment files with the same segment id and different frames: one segment id, two "
    "logs; the steps only one file holds are decoded, those both hold are taken from the file "
    "with more steps, and which is the replica's log is unknown",
    f"{_INSPECT}; find which copy is the replica's log (the other is from another writer or a "
    "damaged shipper), remove the wrong one from the outbox and re-run the hour",
    releases="a re-run of the hour with only the replica's own copy of the segment in the "
    "outbox",
)  # fmt: skip
REPEATED = _kind(
    "sequence", "repeated", "ERROR", True, "replica",
    "sequence numbers logged more than once: their steps would be charged twice",
    f"{_INSPECT}; remove the stray segment from the outbox and re-run the hour",
    releases="a re-run of the hour after the stray segment is gone: each sequence number once",
)  # fmt: skip
DUPLICATE_SEGMENT = _kind(
    "sequence", "duplicate_segment", "WARN", False, "replica",
    "a segment delivered twice: the copy was ignored, nothing is counted twice",
    "nothing for the bill; find why the shipper delivers segments twice",
)  # fmt: skip
UNPLACED_DAMAGE = _kind(
    "sequence", "unplaced_damage", "ERROR", True, "pool",
    "damage in files not attributable to a replica of the pool",
    "check that the outbox holds each replica's files in `outbox/<replica>/` and that the pools "
    "file lists the replica; re-run the hour",
    releases="a re-run of the hour in which every damaged file belongs to a replica of the pool",
)  # fmt: skip
SHORTFALL = _kind(
    "time", "shortfall", "ERROR", True, "replica",
    "step time plus measured gaps fall short of the wall-clock hour beyond "
    "`time_tolerance_fraction`: step records are missing",
    _TIME_RUNBOOK,
    releases=_TIME_RELEASE,
)  # fmt: skip
EXCESS = _kind(
    "time", "excess", "ERROR", True, "replica",
    "step time plus measured gaps exceed the wall-clock hour: duplicated records or clock skew",
    _TIME_RUNBOOK,
    releases=_TIME_RELEASE,
)  # fmt: skip
CLOCK_SKEW = _kind(
    "time", "clock_skew", "ERROR", True, "replica",
    "UTC placement disagrees with the monotonic durations (overlapping steps, a moving offset)",
    _TIME_RUNBOOK,
    releases=_TIME_RELEASE,
)  # fmt: skip
NOT_INTEGER = _kind(
    "money", "not_integer", "ERROR", True, "pool",
    "an invoice or ledger amount is not integer nano-dollars",
    _SOFTWARE_FAULT,
    releases=_MONEY_RELEASE,
)  # fmt: skip
NULL_AMOUNT = _kind(
    "money", "null_amount", "ERROR", True, "pool",
    "invoice or ledger rows without an amount",
    _SOFTWARE_FAULT,
    releases=_MONEY_RELEASE,
)  # fmt: skip
INVOICE_COUNT = _kind(
    "money", "invoice_count", "ERROR", True, "pool",
    "not exactly one invoice for the pool-hour",
    _SOFTWARE_FAULT,
    releases=_MONEY_RELEASE,
)  # fmt: skip
INVOICE_PRICE = _kind(
    "money", "invoice_price", "ERROR", True, "pool",
    "the invoice is not its GPUs times the pools file's GPU-hour price",
    _PRICE_FAULT,
    releases=_MONEY_RELEASE,
)  # fmt: skip
LINE_KIND = _kind(
    "money", "line_kind", "ERROR", True, "pool",
    "ledger lines of an unknown kind",
    _SOFTWARE_FAULT,
    releases=_MONEY_RELEASE,
)  # fmt: skip
MISMATCH = _kind(
    "money", "mismatch", "ERROR", True, "pool",
    "the ledger lines do not add up to the invoice to the nano-dollar",
    _PRICE_FAULT,
    releases=_MONEY_RELEASE,
)  # fmt: skip
HOST_STALL = _kind(
    "plausibility", "host_stall", "ERROR", False, "replica",
    "the engine is busier than DCGM shows its GPUs: steps stall on the host and customers are "
    "charged for CPU waits",
    "look at the replica's CPU, tokenizer and scheduling",
)  # fmt: skip
GPU_BUSIER = _kind(
    "plausibility", "gpu_busier", "WARN", False, "replica",
    "DCGM shows the GPUs busier than the engine's log: unlogged work on the GPU",
    "look for another process sharing the GPUs and for steps missing from the log",
)  # fmt: skip
IMPOSSIBLE_KV = _kind(
    "plausibility", "impossible_kv", "ERROR", False, "replica",
    "steps whose requests hold more KV blocks than the engine reported it has: impossible data "
    "from the hook; the step's time and the invoice are measured, but its KV shares, and so "
    "the split of its cost between its requests, are wrong",
    "look at the replica's hook and engine version (a block counted for every request sharing "
    "it, a wrong block size); the hour is published, re-run it once the hook is fixed and the "
    "segments re-recorded",
)  # fmt: skip
DCGM_MISSING = _kind(
    "plausibility", "dcgm_missing", "WARN", False, "replica",
    "no DCGM samples for a GPU of the replica: its activity cannot be cross-checked",
    "check the DCGM exporter and the GPU UUIDs in the pools file",
)  # fmt: skip
OVER_THRESHOLD = _kind(
    "unattributed", "over_threshold", "ERROR", False, "pool",
    "more of the hour's usage than the pool's `unattributed_alert_fraction` has no gateway context",
    "check that the hour's gateway file arrived in `gateway/` and that request ids match "
    "between gateway and engine; re-run the hour after the file lands",
)  # fmt: skip
STALE = _kind(
    "calibration", "stale", "ERROR", False, "replica",
    "a version in the log has no coefficients; the stored ones are for other versions only",
    _RECALIBRATE, weights="fitted",
)  # fmt: skip
MISSING = _kind(
    "calibration", "missing", "ERROR", False, "replica",
    "the calibration store has nothing for the model on the GPU type",
    _RECALIBRATE, weights="fitted",
)  # fmt: skip
NEW_ENGINE_VERSION = _kind(
    "calibration", "new_engine_version", "WARN", False, "replica",
    "a version neither the kernel's coefficients nor a stored sweep was measured on",
    f"{_RECALIBRATE} (each hour says so until the version is swept)", weights="kernel",
)  # fmt: skip
DRIFT = _kind(
    "calibration_drift", "drift", "ERROR", False, "pool",
    "a fresh fit of the hour's steps moved beyond `calibration_drift_fraction` from the stored "
    "fit: charges shift between prefill-heavy and decode-heavy tenants",
    _RECALIBRATE, weights="fitted",
)  # fmt: skip
KERNEL_DRIFT = _kind(
    "calibration_drift", "drift", "WARN", False, "pool",
    "given a stored and a fresh fit (the hourly run fits no kernel-weights pool), the fresh one "
    "moved beyond `calibration_drift_fraction`: the kernel's weights may not match the engine",
    _RECALIBRATE, weights="kernel",
)  # fmt: skip
CLOCK_JUMP = _kind(
    "clock", "clock_jump", "WARN", False, "replica",
    "a segment's wall clock stepped by more than a minute against the monotonic clock; its "
    "steps were placed by the monotonic clock, so the money is exact",
    "fix the host's time source",
)  # fmt: skip
SILENT_REPLICA = _kind(
    "silence", "silent_replica", "ERROR", True, "replica",
    "no step log in the hour while DCGM shows the replica's GPUs busy: billing the hour would "
    "charge its work as idle",
    "find why `outbox/<replica>/` is not shipped, deliver the segments and re-run the hour",
    releases="a re-run of the hour once the replica's segments are in `outbox/<replica>/`",
)  # fmt: skip
SILENT_UNVERIFIED = _kind(
    "silence", "silent_unverified", "ERROR", True, "replica",
    "no step log in the hour and no DCGM sample for the replica's GPUs: nothing shows whether it "
    "sat idle or its log is missing, so the hour is not billed as idle (an hour with no data "
    "at all is held this way)",
    "check that the replica's outbox is shipped and the DCGM exporter scraped; deliver what is "
    "missing and re-run the hour, or run the hour only once its data has arrived",
    releases="a re-run of the hour once the replica's segments or its DCGM samples have arrived",
)  # fmt: skip
SILENT_TAIL = _kind(
    "silence", "silent_tail", "ERROR", True, "replica",
    "DCGM shows the replica's GPUs busy after its last logged step of the hour: the log's tail "
    "(its last segments) is missing, and billing the hour would charge that work as idle",
    "find why the replica's last segments are not in `outbox/<replica>/`, deliver them and "
    "re-run the hour",
    releases="a re-run of the hour once the replica's last segments are in `outbox/<replica>/`",
)  # fmt: skip
UNBILLED_STEPS = _kind(
    "conservation", "unbilled_steps", "ERROR", True, "replica",
    "steps up to the hour lie in hours never attributed, neither published nor held back: "
    "billed to nobody",
    "run those hours (`stepledger run --hour`), then re-run this one; if their hours are wrong "
    "(a host clock set wrong across a reboot), fix the clock and re-ingest",
    releases="a re-run of this hour after every hour holding those steps is published or held back",
)  # fmt: skip
NOT_RECONCILED = _kind(
    "deadman", "not_reconciled", "ERROR", False, "pool",
    "hours not reconciled `deadman_minutes` after they ended: nothing else could have paged",
    "check `dagster-daemon` and the schedule's status, then run the missing hours",
)  # fmt: skip
UNDELIVERED = _kind(
    "alert_delivery", "undelivered", "ERROR", False, "alert",
    "an alert the sink has refused for longer than `deadman_minutes`",
    "check the sink the environment configures and `alert_outbox`'s `last_error`; the "
    "`deliver_alerts` sensor keeps retrying",
)  # fmt: skip
REBILLED_CLOSED_MONTH = _kind(
    "closed_month", "rebilled", "WARN", False, "pool",
    "an hour of a closed month was billed again: its issued invoices stand, and each tenant's "
    "change is recorded as an adjustment (credit or debit) on its next open invoice",
    "nothing to undo; check the adjustment in `invoice_adjustments` (and `tenant_invoices`) "
    "before that invoice is closed, and find why an hour of a closed month was re-run",
)  # fmt: skip

LAKE_FILES_MISSING = _kind(
    "integrity", "lake_files_missing", "ERROR", True, "pool",
    "lake files ingest wrote for the hour (or the hour before) are gone: billing it would charge "
    "their steps as idle, so the run stops before attributing and the published hour is kept",
    "restore the named files from a backup of `lake/` and re-run the hour; if they are lost, "
    "re-ingest the outbox (segments still there and unchanged) into a fresh data directory",
    releases="a re-run of the hour once the lake files are restored or re-ingested",
)  # fmt: skip
PUBLISHED_CHANGED = _kind(
    "integrity", "published_changed", "ERROR", True, "pool",
    "a published pool-hour's warehouse data file or rows differ from what was published: "
    "finance connections refuse to read the file and a re-run refuses to replace the hour; "
    "the `verify_published` sensor pages it even when no run or reader touches the hour",
    "find who changed the named file under `warehouse/data/` and restore it from a backup (its "
    "sha256 is in the message); nothing is served or re-billed from it until it matches; "
    "`stepledger verify --data DIR` then shows every published hour unchanged",
    releases="the published file restored to the sha256 recorded when it was published",
)  # fmt: skip

# Every kind of finding, in the order declared (the docs table's order).
FINDINGS = tuple(_DECLARED)

# The checks run on every pool-hour, in the order their rows are recorded.
CHECK_SPECS = (
    CheckSpec(
        "sequence",
        "Every step of each replica's log arrived once: no missing, dropped, repeated or "
        "damaged sequence numbers.",
    ),
    CheckSpec(
        "time",
        "Per replica, step time plus measured gaps add up to the wall-clock hour within "
        "time_tolerance_fraction (no lost records, overlapping steps or clock skew).",
    ),
    CheckSpec(
        "money",
        "The ledger lines add up to the invoice to the nano-dollar, and the invoice is the "
        "pools file's GPU-hour price.",
    ),
    CheckSpec(
        "plausibility",
        "Per replica, the engine's busy fraction agrees with DCGM's GR_ENGINE_ACTIVE for its "
        "GPUs, and no step's requests hold more KV blocks than the engine has.",
    ),
    CheckSpec(
        "unattributed",
        "The share of the hour's usage without gateway context stays under the pool's "
        "unattributed_alert_fraction.",
    ),
    CheckSpec(
        "calibration",
        "The engine and driver versions in the segment headers have coefficients, measured "
        "or fitted.",
    ),
    CheckSpec(
        "calibration_drift",
        "For fitted weights, a fresh fit of the hour's steps stays within "
        "calibration_drift_fraction of the stored fit.",
    ),
    CheckSpec(
        "clock",
        "Per replica, segment wall-clock anchors agree with the monotonic clock; steps of a "
        "segment whose wall clock jumped are placed by the monotonic clock.",
    ),
    CheckSpec(
        "silence",
        "Per replica, a replica whose GPUs DCGM shows busy logged steps: silence is missing "
        "logs, not idle time.",
    ),
    CheckSpec(
        "conservation",
        "Per replica, every step ingested up to the hour lies in a published or held-back "
        "hour: none is billed to nobody.",
    ),
)
CHECKS = tuple(spec.name for spec in CHECK_SPECS)


def kinds_of(check: str, weights: Weights | None = None) -> tuple[FindingKind, ...]:
    """The kinds of finding `check` can raise (for a pool charging with `weights`, if given)."""
    return tuple(
        kind
        for kind in FINDINGS
        if kind.check == check and (weights is None or kind.weights in (None, weights))
    )


def kinds_found(check: str, finding: str, severity: Severity) -> tuple[FindingKind, ...]:
    """The registered kinds a failed result of `check` names in `finding` (its codes joined
    by "+"). Of two kinds sharing a code (`drift` for fitted and for kernel weights) the one
    of the result's severity."""
    found = []
    for code in finding.split("+"):
        named = [kind for kind in FINDINGS if kind.check == check and kind.code == code]
        of_severity = [kind for kind in named if kind.severity == severity]
        found.extend(of_severity[:1] or named[:1])
    return tuple(found)
