"""httpx's one-shot calls with a deadline a busy machine does not hit: httpx waits 5 s by default, and a model
call to a server on a loaded 2-core box can take longer. A hung server still fails, at this deadline."""

from typing import Any

import httpx

TIMEOUT = httpx.Timeout(180.0, connect=30.0)


def get(*args: Any, **kwargs: Any) -> httpx.Response:
    return httpx.get(*args, timeout=TIMEOUT, **kwargs)


def post(*args: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(*args, timeout=TIMEOUT, **kwargs)


def stream(*args: Any, **kwargs: Any) -> Any:
    return httpx.stream(*args, timeout=TIMEOUT, **kwargs)
