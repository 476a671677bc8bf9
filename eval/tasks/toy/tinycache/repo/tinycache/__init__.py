"""An LRU cache and a memoize decorator built on it."""

from tinycache.lru import LRUCache
from tinycache.memo import memoize

__all__ = ["LRUCache", "memoize"]
