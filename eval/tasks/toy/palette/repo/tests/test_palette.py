from palette import css


def test_css_prefix():
    assert css("red").startswith("color: #")
