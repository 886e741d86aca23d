"""Dollar strings from integer nano-dollars, exact up to the rounding of the last digit shown."""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal

from schemas.units import nano_to_usd

AMOUNT_PLACES = 6  # micro-dollars: an hour's line, a request
UNIT_PLACES = 8  # cost per request and per thousand tokens are fractions of a cent


def usd(nano: int, places: int = AMOUNT_PLACES) -> str:
    """'$1,234.567890' (or '-$0.000123') for an integer amount of nano-dollars."""
    return _dollars(nano_to_usd(nano), places)


def usd_per(nano: int, units: int, places: int = UNIT_PLACES) -> str:
    """Dollars per unit, e.g. per request; '-' when there are no units."""
    if not units:
        return "-"
    return _dollars(nano_to_usd(nano) / Decimal(int(units)), places)


def _dollars(value: Decimal, places: int) -> str:
    rounded = value.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_EVEN)
    sign = "-" if rounded < 0 else ""
    return f"{sign}${abs(rounded):,.{places}f}"
