"""What past hours would have cost under other policies: each pool-hour attributed again from
the lake with some of its pool's policies changed, compared per tenant and feature with what
the warehouse holds for it. Nothing is written: neither the lake's ledger nor the warehouse.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import polars as pl
from pydantic import ValidationError

from pipeline import finance
from pipeline.attribution.attribute import attribute_pool_hour
from pipeline.attribution.weights import SavedInputsMissing, saved_inputs
from pipeline.datadir import DataDir
from schemas.config import Policies, Pool, load_pools
from schemas.errors import InputError
from schemas.units import from_warehouse, hour_key, to_warehouse

# The policies --set may change (names as in the pools file).
SETTINGS = ("idle", "prefix_cache", "alpha", "weights")


class WhatIfError(InputError):
    """A scenario that cannot be computed; the message names the setting or hour."""


def parse_settings(pairs: list[str]) -> dict[str, object]:
    """`name=value` pairs (alpha a number, the others names) as policy overrides."""
    settings: dict[str, object] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in SETTINGS:
            raise WhatIfError(f"--set {pair!r}: expected one of {', '.join(SETTINGS)}=VALUE")
        if name == "alpha":
            try:
                settings[name] = float(value)
            except ValueError:
                raise WhatIfError(f"--set {pair!r}: alpha is a number in [0, 1]") from None
        else:
            settings[name] = value
    return settings


def with_policies(pool: Pool, settings: dict[str, object]) -> Pool:
    """The pool with its policies changed (validated as a pools file would be)."""
    try:
        policies = Policies.model_validate({**pool.policies.model_dump(), **settings})
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise WhatIfError(f"--set on pool {pool.name!r}: {problems}") from None
    return pool.model_copy(update={"policies": policies})


@dataclass(frozen=True)
class WhatIf:
    """Per tenant and feature: what the hours cost (`before_nano`, as the warehouse holds
    them), what they would cost (`after_nano`), the change and its percentage; and per
    pool-hour the invoice with both ledgers' sums."""

    changes: pl.DataFrame
    hours: pl.DataFrame

    @property
    def tenants(self) -> pl.DataFrame:
        """`changes` summed per tenant: billed (`before_nano`), what-if (`after_nano`), the
        change and its percentage, largest increase first."""
        return _with_change(
            self.changes.group_by("tenant").agg(
                pl.col("before_nano").sum(), pl.col("after_nano").sum()
            ),
            ["tenant"],
        )

    @property
    def balanced(self) -> bool:
        return bool(
            (self.hours["invoice_nano"] == self.hours["before_nano"]).all()
            and (self.hours["invoice_nano"] == self.hours["after_nano"]).all()
        )


_BILLED_HOURS = """
SELECT i.hour, i.pool, i.amount_nano AS invoice_nano
FROM invoices i WHERE i.hour >= ? AND i.hour < ? ORDER BY i.hour, i.pool
"""
_LINES = """
SELECT tenant, feature, CAST(sum(amount_nano) AS BIGINT) AS amount_nano
FROM ledger_lines WHERE hour = ? AND pool = ? GROUP BY tenant, feature
"""


def what_if(data_dir: Path, start: datetime, end: datetime, settings: dict[str, object]) -> WhatIf:
    """Attribute every billed pool-hour in [start, end) again with `settings` changed."""
    layout = DataDir(data_dir)
    pools = {p.name: p for p in load_pools(layout.pools_file).pools}
    lake = layout.lake
    befores, afters, hours = [], [], []
    with finance.connect(data_dir) as con:
        billed = con.execute(_BILLED_HOURS, [to_warehouse(start), to_warehouse(end)]).pl()
        if not billed.height:
            raise WhatIfError(
                f"no billed hours from {hour_key(start)} to before {hour_key(end)} in {data_dir}"
            )
        for stored, pool_name, invoice in billed.iter_rows():
            hour = from_warehouse(stored)
            if pool_name not in pools:
                raise WhatIfError(
                    f"{hour_key(hour)}: pool {pool_name!r} is not in {layout.pools_file}"
                )
            pool = with_policies(pools[pool_name], settings)
            try:
                inputs, weights = saved_inputs(data_dir, pool, hour)
            except SavedInputsMissing as err:
                raise WhatIfError(str(err)) from err
            ledger = attribute_pool_hour(lake, pool, inputs, weights).ledger
            before = con.execute(_LINES, [stored, pool_name]).pl()
            after = ledger.ledger_lines.group_by("tenant", "feature").agg(
                pl.col("amount_nano").sum()
            )
            befores.append(before)
            afters.append(after)
            hours.append(
                {
                    "hour": hour_key(hour),
                    "pool": pool_name,
                    "invoice_nano": int(invoice),
                    "before_nano": int(before["amount_nano"].sum()),
                    "after_nano": int(after["amount_nano"].sum()),
                    "policy_version": pool.policies.version(),
                    "weights_version": weights.version,
                }
            )
    keys = ["tenant", "feature"]
    total = pl.col("amount_nano").sum().cast(pl.Int64)
    changes = (
        pl.concat(befores)
        .group_by(keys)
        .agg(total.alias("before_nano"))
        .join(
            pl.concat(afters).group_by(keys).agg(total.alias("after_nano")),
            on=keys,
            how="full",
            coalesce=True,
        )
        .fill_null(0)
    )
    return WhatIf(_with_change(changes, keys), pl.DataFrame(hours))


def _with_change(totals: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    """`totals` (keys, before_nano, after_nano) with the change in nano-dollars and percent of
    what was billed (none where nothing was), largest increase first."""
    return (
        totals.with_columns(change_nano=pl.col("after_nano") - pl.col("before_nano"))
        .with_columns(
            change_pct=pl.when(pl.col("before_nano") != 0).then(
                100.0 * pl.col("change_nano") / pl.col("before_nano").abs()
            )
        )
        .sort(["change_nano", *keys], descending=[True, *(False for _ in keys)])
    )
