import pytest

from numerals import from_roman, to_roman


def test_additive_numbers():
    assert to_roman(3) == "III"
    assert to_roman(1666) == "MDCLXVI"


def test_from_roman():
    assert from_roman("MCMXCIV") == 1994
    assert from_roman("xiv") == 14


def test_round_trip():
    assert all(from_roman(to_roman(n)) == n for n in range(1, 4000))


def test_out_of_range():
    with pytest.raises(ValueError):
        to_roman(0)
    with pytest.raises(ValueError):
        to_roman(4000)
