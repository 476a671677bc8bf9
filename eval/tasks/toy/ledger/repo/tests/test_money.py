from ledger.money import format_cents, percent_of


def test_format_positive():
    assert format_cents(123456) == "$1,234.56"
    assert format_cents(5) == "$0.05"
    assert format_cents(0, currency="EUR ") == "EUR 0.00"


def test_percent_rounds_half_away_from_zero():
    assert percent_of(1005, 10) == 101
    assert percent_of(-1005, 10) == -101
