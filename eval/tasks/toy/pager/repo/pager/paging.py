from collections.abc import Sequence


def page_count(total: int, per_page: int) -> int:
    """Number of pages needed to show ``total`` items, ``per_page`` at a time."""
    if per_page <= 0:
        raise ValueError(f"per_page must be positive, got {per_page}")
    return total // per_page


def page_items(items: Sequence, page: int, per_page: int) -> list:
    """The items on 1-based ``page``; empty past the last page."""
    if page < 1:
        raise ValueError(f"pages start at 1, got {page}")
    start = (page - 1) * per_page
    return list(items[start : start + per_page])
