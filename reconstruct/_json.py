"""JSON through orjson: several times faster than the standard library on token-id arrays.

``dumps`` gives compact separators, UTF-8 kept as is, keys in insertion order. ``loads_like_upstream`` also reads
what Python's ``json`` writes and vLLM's server reads but orjson refuses: ``NaN``, ``Infinity``, ``-Infinity``.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

__all__ = ["BACKEND", "dumps", "loads", "loads_like_upstream"]

BACKEND = "orjson"


def loads(data: str | bytes | bytearray | memoryview) -> Any:
    return orjson.loads(data)


def loads_like_upstream(data: str | bytes | bytearray | memoryview) -> Any:
    """A request body as the upstream parsed it (vLLM reads bodies with Python's ``json``, which takes ``NaN`` and
    ``Infinity``; issue 16). The standard parser runs only when orjson refuses; what it reads must also be writable
    by ``dumps`` (a lone surrogate is not), else ``ValueError`` as for any body that does not parse."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        if isinstance(data, memoryview):
            data = data.tobytes()
        value = json.loads(data)  # ValueError (JSONDecodeError, UnicodeDecodeError) when it does not parse either
        try:
            orjson.dumps(value)
        except orjson.JSONEncodeError as e:
            raise ValueError(f"the body parses but holds text that cannot be written back as UTF-8: {e}") from e
        return value


def dumps(value: Any) -> str:
    return orjson.dumps(value).decode("utf-8")
