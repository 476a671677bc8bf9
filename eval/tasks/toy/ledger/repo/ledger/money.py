"""Amounts are integer cents."""

from decimal import ROUND_HALF_UP, Decimal


def format_cents(cents: int, currency: str = "$") -> str:
    """``'$1,234.56'`` for 123456."""
    dollars, rest = divmod(cents, 100)
    return f"{currency}{dollars:,}.{rest:02d}"


def percent_of(cents: int, percent: float) -> int:
    """``percent`` % of an amount, rounded half away from zero to whole cents."""
    exact = Decimal(cents) * Decimal(str(percent)) / 100
    return int(exact.quantize(Decimal(1), rounding=ROUND_HALF_UP))
