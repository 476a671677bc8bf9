import functools
from collections.abc import Callable

from tinycache.lru import LRUCache

_MISSING = object()


def memoize(maxsize: int = 128) -> Callable:
    """Cache a function's results by positional arguments in an ``LRUCache(maxsize)``."""

    def decorate(func: Callable) -> Callable:
        cache = LRUCache(maxsize)

        @functools.wraps(func)
        def wrapper(*args):
            value = cache.get(args, _MISSING)
            if value is _MISSING:
                value = func(*args)
                cache.put(args, value)
            return value

        wrapper.cache = cache
        return wrapper

    return decorate
