"""JSON through orjson: several times faster than the standard library on token-id arrays.

``dumps`` gives compact separators, UTF-8 kept as is, keys in insertion order.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["BACKEND", "dumps", "loads"]

BACKEND = "orjson"


def loads(data: str | bytes) -> Any:
    return orjson.loads(data)


def dumps(value: Any) -> str:
    return orjson.dumps(value).decode("utf-8")
