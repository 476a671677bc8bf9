from units import miles_to_km


def test_zero():
    assert miles_to_km(0) == 0
