"""Token id sequences held as their canonical JSON text, so prompts are compared without parsing them.

A session of K calls resends its history every call: its prompts hold O(K²) token ids, its traces O(K). Holding
each prompt as the bytes ``[1,2,3`` (whitespace removed, closing bracket left off) makes "is p a token prefix of
q" one ``startswith`` (memcmp speed) and lets only the tails that a trace keeps be parsed into ints. Even the count
of ids is not taken up front: a prompt's count is learnt from its prefix's count plus the tail merging parses
anyway, and only a trace's first prompt (parsed whole) or a caller that asks pays for counting. The prompt array
of a vLLM answer is lifted out of the record line as bytes (``_io.parse_record``), or out of a response body by
``cut_array``, so it is never turned into Python ints at all.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from reconstruct._json import loads

__all__ = ["TokenText", "cut_array"]

_WS = re.compile(rb"\s+")


class TokenText:
    """An immutable token id sequence as canonical JSON text without its closing bracket: ``[`` then the ids
    joined by ``,`` (``b"[1,2,3"``). Left open, one sequence's text starts with another's exactly when its ids
    start with the other's ids (checking the next byte is a comma), so no copy is made to compare them."""

    __slots__ = ("_n", "body")

    def __init__(self, body: bytes, n: int | None = None) -> None:
        self.body = body
        self._n = n

    @property
    def n(self) -> int:
        """How many ids; counted on first use unless already learnt (see ``tail_after`` and ``ids``)."""
        if self._n is None:
            self._n = self.body.count(b",") + 1 if len(self.body) > 1 else 0
        return self._n

    @classmethod
    def from_ids(cls, ids: Sequence[int]) -> TokenText:
        return cls(("[" + ",".join(map(str, ids))).encode("ascii"), len(ids))

    @classmethod
    def from_json(cls, text: str | bytes) -> TokenText:
        """From a JSON array of integers as some server wrote it (any whitespace)."""
        data = text.encode("utf-8") if isinstance(text, str) else text
        if not (data.startswith(b"[") and data.endswith(b"]")):
            raise ValueError("not a JSON array")
        # A serializer spaces an array uniformly: its first ids tell whether the whole needs compacting (vLLM's
        # does not; Python's json.dumps puts ", " everywhere).
        if _WS.search(data, 0, 64):
            data = _WS.sub(b"", data)
        return cls(data[:-1])

    @classmethod
    def lifted(cls, body: bytes) -> TokenText:
        """From an array's text without its closing bracket (``b"[1, 2"``), as ``_io.parse_record`` lifts it."""
        if _WS.search(body, 0, 64):
            body = _WS.sub(b"", body)
        return cls(body)

    def ids(self) -> list[int]:
        ids = loads(self.body + b"]")
        if not isinstance(ids, list) or (self._n is not None and len(ids) != self._n):
            raise ValueError("a token id array holds something other than token ids")
        # isdigit runs at C speed; the slow check only when that finds something odd.
        odd = ids and not self.body[1:].replace(b",", b"").isdigit()
        if odd and not all(type(i) is int and i >= 0 for i in ids):
            raise ValueError("a token id array holds something other than token ids")
        self._n = len(ids)
        return ids

    def is_prefix_of(self, other: TokenText) -> bool:
        """True when ``other`` starts with these ids (equal sequences included)."""
        size = len(self.body)
        if size == 1:
            return True
        return other.body.startswith(self.body) and (len(other.body) == size or other.body[size] == _COMMA)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenText) and self.body == other.body

    def __hash__(self) -> int:
        return hash(self.body)

    def tail_after(self, prefix: TokenText) -> list[int]:
        """The ids of ``self`` after ``prefix``, which must be a prefix of it; ``self`` learns its count from them
        when it had none (the prefix's count, then, is counted once and passed on along a chain)."""
        if len(prefix.body) == 1:
            return self.ids()
        rest = self.body[len(prefix.body) + 1 :]  # "4,5" or ""
        tail = loads(b"[" + rest + b"]") if rest else []
        if self._n is None:
            self._n = prefix.n + len(tail)
        return tail

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        return f"TokenText(n={self.n})"


_COMMA = ord(",")


def cut_array(text: str, key: str) -> tuple[str, str | None]:
    """``text`` (a JSON document) with the first integer array under ``key`` replaced by ``null``, and that
    array's text; ``(text, None)`` when there is none."""
    span = find_array(text, key)
    if span is None:
        return text, None
    start, stop = span
    return text[:start] + "null" + text[stop:], text[start:stop]


def find_array(text: str, key: str) -> tuple[int, int] | None:
    """Where the first integer array under ``key`` lies in ``text`` (a JSON document): ``text[start:stop]`` is
    ``[...]``; None when there is none. Found without parsing: an unescaped ``"key"`` followed by ``:`` and
    ``[`` can only be an object key (inside a JSON string the quotes would be escaped), and an array of
    integers holds no ``]`` until its end."""
    needle = json.dumps(key)
    start = 0
    while (i := text.find(needle, start)) >= 0:
        start = i + len(needle)
        j = start
        while j < len(text) and text[j] in " \t\r\n":
            j += 1
        if j >= len(text) or text[j] != ":":
            continue
        j += 1
        while j < len(text) and text[j] in " \t\r\n":
            j += 1
        if j >= len(text) or text[j] != "[":
            return None  # null or something else: nothing to lift out
        end = text.find("]", j)
        if end < 0:
            return None
        return j, end + 1
    return None
