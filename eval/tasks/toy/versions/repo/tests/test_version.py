import pytest

from versions import Version, latest


def test_str_round_trip():
    assert str(Version.parse("v1.2.3-rc.1")) == "1.2.3-rc.1"
    assert str(Version.parse("0.4.0")) == "0.4.0"


def test_prerelease_sorts_before_release():
    assert Version.parse("1.0.0-rc.1") < Version.parse("1.0.0")


def test_single_digit_ordering():
    assert Version.parse("1.2.3") < Version.parse("1.3.0") < Version.parse("2.0.0")
    assert latest(["0.1.0", "0.3.1", "0.2.9"]) == "0.3.1"


def test_rejects_garbage():
    with pytest.raises(ValueError):
        Version.parse("one.two")
