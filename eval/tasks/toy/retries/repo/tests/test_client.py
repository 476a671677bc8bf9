from client import attempts


def test_at_least_one_try():
    assert attempts() >= 1
