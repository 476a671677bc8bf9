from server import address


def test_host():
    assert address().startswith("localhost:")
