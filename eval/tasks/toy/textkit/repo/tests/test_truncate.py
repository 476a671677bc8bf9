from textkit import truncate


def test_short_text_unchanged():
    assert truncate("abc", 5) == "abc"


def test_long_text_cut():
    assert truncate("abcdefgh", 6) == "abc..."
