"""Token id sequences held as their canonical JSON text, so prompts are compared without parsing them.

A session of K calls resends its history every call: its prompts hold O(K²) token ids, its traces O(K). Holding
each prompt as the text ``[1,2,3]`` (whitespace removed) makes "is p a token prefix of q" one ``startswith``
(memcmp speed) and lets only the tails that a trace keeps be parsed into ints. Even the count of ids is not
taken up front: a prompt's count is learnt from its prefix's count plus the tail merging parses anyway, and only
a trace's first prompt (parsed whole) or a caller that asks pays for counting. ``cut_array`` lifts the
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

    __slots__ = ("_head", "_n", "text")

    def __init__(self, text: str, n: int | None = None) -> None:
        self.text = text
        self._n = n
        self._head: str | None = None

    @property
    def n(self) -> int:
        """How many ids; counted on first use unless already learnt (see ``tail_after`` and ``ids``)."""
        if self._n is None:
            self._n = self.text.count(",") + 1 if len(self.text) > 2 else 0
        return self._n

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
        return cls(text)

    def ids(self) -> list[int]:
        ids = loads(self.text)
        if not isinstance(ids, list) or (self._n is not None and len(ids) != self._n):
            raise ValueError("a token id array holds something other than token ids")
        # isdigit runs at C speed; the slow check only when that finds something odd.
        odd = ids and not self.text[1:-1].replace(",", "").isdigit()
        if odd and not all(type(i) is int and i >= 0 for i in ids):
            raise ValueError("a token id array holds something other than token ids")
        self._n = len(ids)
        return ids

    def _open(self) -> str:
        if self._head is None:
            self._head = self.text[:-1]  # "[1,2,3": what a longer sequence starting with these ids starts with
        return self._head

    def is_prefix_of(self, other: TokenText) -> bool:
        """True when ``other`` starts with these ids (equal sequences included)."""
        if len(self.text) == 2:
            return True
        head = self._open()
        return other.text.startswith(head) and other.text[len(head)] in ",]"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenText) and self.text == other.text

    def __hash__(self) -> int:
        return hash(self.text)

    def tail_after(self, prefix: TokenText) -> list[int]:
        """The ids of ``self`` after ``prefix``, which must be a prefix of it; ``self`` learns its count from them
        when it had none (the prefix's count, then, is counted once and passed on along a chain)."""
        if len(prefix.text) == 2:
            return self.ids()
        rest = self.text[len(prefix.text) - 1 : -1]  # ",4,5" or ""
        tail = loads("[" + rest[1:] + "]") if rest else []
        if self._n is None:
            self._n = prefix.n + len(tail)
        return tail

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
