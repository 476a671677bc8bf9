from vat import with_vat


def test_zero_price():
    assert with_vat(0) == 0
