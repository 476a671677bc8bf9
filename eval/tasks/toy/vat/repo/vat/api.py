from vat.rates import STANDARD_RATE


def with_vat(price: float) -> float:
    return price * (1 + STANDARD_RATE)
