from greeting import greet


def test_name_is_kept():
    assert "Bo" in greet("Bo")
