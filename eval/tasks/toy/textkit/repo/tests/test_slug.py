from textkit import slugify


def test_single_word():
    assert slugify("Hello") == "hello"


def test_accents_are_dropped():
    assert slugify("Café") == "cafe"


def test_custom_separator():
    assert slugify("a b", sep="_") == "a_b"
