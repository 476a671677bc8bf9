"""Token id sequences held as their canonical JSON text, so prompts are compared without parsing them.

A session of K calls resends its history every call: its prompts hold O(K²) token ids, its traces O(K). Holding
each prompt as the text ``[1,2,3]`` (whitespace removed) makes "is p a token prefix of q" one ``startswith``
(memcmp speed) and lets only the tails that a trace keeps be parsed into ints. ``cut_array`` lifts the
``prompt_token_ids`` array out of a response body before the body is parsed, so it is never turned into
Python ints at all.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from reconstruct._json import loads

__all__ = ["TokenText", "cut_array"]

_WS = re.compile(r"\s+")


class TokenText:
    """An immutable token id sequence as canonical JSON text: ``[`` ids joined by ``,`` ``]``."""

    __slots__ = ("_head", "n", "text")

    def __init__(self, text: str, n: int) -> None:
        self.text = text
        self.n = n
        self._head: str | None = None

    @classmethod
    def from_ids(cls, ids: Sequence[int]) -> TokenText:
        return cls("[" + ",".join(map(str, ids)) + "]", len(ids))

    @classmethod
    def from_json(cls, text: str) -> TokenText:
        """From a JSON array of integers as some server wrote it (any whitespace)."""
        if not (text.startswith("[") and text.endswith("]")):
            raise ValueError("not a JSON array")
        # A serializer spaces an array uniformly: its first ids tell whether the whole needs compacting (vLLM's
        # does not; Python's json.dumps puts ", " everywhere).
        if _WS.search(text, 0, 64):
            text = _WS.sub("", text)
        return cls(text, text.count(",") + 1 if len(text) > 2 else 0)

    def ids(self) -> list[int]:
        ids = loads(self.text)
        if len(ids) != self.n or (self.n and not self.text[1:-1].replace(",", "").isdigit()):  # C speed
            if len(ids) != self.n or not all(type(i) is int and i >= 0 for i in ids):
                raise ValueError("a token id array holds something other than token ids")
        return ids

    def _open(self) -> str:
        if self._head is None:
            self._head = self.text[:-1]  # "[1,2,3": what a longer sequence starting with these ids starts with
        return self._head

    def is_prefix_of(self, other: TokenText) -> bool:
        """True when ``other`` starts with these ids (equal sequences included)."""
        if self.n == 0:
            return True
        head = self._open()
        return other.text.startswith(head) and other.text[len(head)] in ",]"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenText) and self.text == other.text

    def __hash__(self) -> int:
        return hash(self.text)

    def tail_after(self, prefix: TokenText) -> list[int]:
        """The ids of ``self`` after ``prefix``, which must be a prefix of it."""
        if prefix.n == 0:
            return self.ids()
        rest = self.text[len(prefix.text) - 1 : -1]  # ",4,5" or ""
        return loads("[" + rest[1:] + "]") if rest else []

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        return f"TokenText(n={self.n})"


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
