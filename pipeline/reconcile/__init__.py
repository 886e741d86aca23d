"""Hourly reconciliation: is an hour's bill trustworthy enough to publish?

Each check is a module with one pure function over polars frames with the pipeline's table
schemas (`schemas.tables` STEPS, DROPS, DAMAGE, SEGMENTS; the warehouse's `invoices` and
`ledger_lines`), for one pool and one UTC hour, and a `run` that applies it to the hour's
gathered facts (`facts.Check`). Each returns `CheckResult`s that map one to one onto rows of
the `reconciliation` table; the failed ones also become `alerts` rows
(`pipeline.reconcile.alerts.record_alerts`).

- `findings`: the registry of every finding (severity, blocks publication, what to do), and
  `findings_doc`, the table of it in `docs/production.md`;
- `hour`: `reconcile_hour` reads a pool-hour's facts once and runs every check on them;
- `facts`: what the checks read about a pool-hour, and the protocol they follow;
- `result`: a check's result, folded from its findings;
- `ranges`: the algebra of sequence-number ranges; `frames`: what several checks read alike;
- `sequence`, `timing`, `money`, `plausibility`, `silence`, `clock`, `conservation`,
  `unattributed`, `calibration`: the checks;
- `alerts`: paging on-call, and the dead-man checks that run outside the hourly run.
"""

from pipeline.reconcile.calibration import check_calibration
from pipeline.reconcile.clock import check_clock
from pipeline.reconcile.conservation import check_conservation
from pipeline.reconcile.findings import CHECKS
from pipeline.reconcile.hour import failed_checks, reconcile_hour
from pipeline.reconcile.money import check_money
from pipeline.reconcile.plausibility import check_plausibility
from pipeline.reconcile.ranges import compact_ranges
from pipeline.reconcile.result import CheckResult
from pipeline.reconcile.sequence import check_sequence
from pipeline.reconcile.silence import check_silence
from pipeline.reconcile.timing import check_time
from pipeline.reconcile.unattributed import check_unattributed

__all__ = [
    "CHECKS",
    "CheckResult",
    "check_calibration",
    "check_clock",
    "check_conservation",
    "check_money",
    "check_plausibility",
    "check_sequence",
    "check_silence",
    "check_time",
    "check_unattributed",
    "compact_ranges",
    "failed_checks",
    "reconcile_hour",
]
