import pytest

from pager import page_count, page_items


def test_exact_multiple():
    assert page_count(20, 10) == 2


def test_no_items_no_pages():
    assert page_count(0, 10) == 0


def test_page_items():
    items = list(range(25))
    assert page_items(items, 1, 10) == list(range(10))
    assert page_items(items, 3, 10) == [20, 21, 22, 23, 24]
    assert page_items(items, 4, 10) == []


def test_rejects_bad_arguments():
    with pytest.raises(ValueError):
        page_count(10, 0)
    with pytest.raises(ValueError):
        page_items([1], 0, 10)
