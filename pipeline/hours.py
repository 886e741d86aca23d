"""The names `pipeline.reconcile` still imports from here; each is defined in `schemas.units`,
where every other module imports it. Goes when reconcile's imports move there."""

from schemas.units import (
    HOUR_NS,
    from_warehouse,
    hour_bounds_ns,
    hour_key,
    parse_hour_key,
    to_warehouse,
    utc_hour,
)

__all__ = [
    "HOUR_NS",
    "from_warehouse",
    "hour_bounds_ns",
    "hour_key",
    "parse_hour_key",
    "to_warehouse",
    "utc_hour",
]
