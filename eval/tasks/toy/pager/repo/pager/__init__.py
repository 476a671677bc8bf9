"""Split sequences into numbered, 1-based pages."""

from pager.paging import page_count, page_items

__all__ = ["page_count", "page_items"]
