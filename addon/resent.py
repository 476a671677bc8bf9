"""Request bodies that resend a conversation: checked as JSON only from where they differ from the session's last.

An agent sends its whole history with every call, so most of a session's request body is the bytes of its
previous one. The record embeds the body as it came, so each body must be checked to be JSON, and checking
100 KB with ``json.loads`` costs about a tenth of what mitmproxy itself spends on the call. :class:`ResentBodies`
keeps each session's last body with the offsets where the elements of its conversation array (``messages``,
``input`` or ``contents`` at the top level) end. A new body of the session that holds the same bytes up to such an
offset is, there, in the same JSON state as the old one was (inside that array, after that element), so only
the members before the array and everything after that offset are parsed.

The result is :meth:`record.Body.parse`'s lean value: every top-level member parsed, but the conversation
:data:`record.ELIDED` (nothing reads it before the record is written; :meth:`record.Body.full` parses it when a
translation does). The check accepts a body only where ``json.loads`` accepts it; anything it does not take
(not an object, bad JSON, a body over :data:`record.LEAN_BYTES`) goes to :meth:`record.Body.parse`, which decides.
Standard library only; used on the event loop only, so it takes no lock.
"""

from __future__ import annotations

import bisect
import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from addon.record import ELIDED, LEAN_BYTES, Body, fold_line_breaks

CONVERSATION_KEYS = frozenset(("messages", "input", "contents"))
KEEP_BYTES = 64 << 20  # bodies kept across all sessions, the least recently seen dropped first
_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")  # JSON's whitespace, as the json module reads it


@dataclass(frozen=True)
class _Seen:
    """A session's last body and where its conversation array starts and its elements end (byte offsets)."""

    data: bytes
    key: str  # the conversation member
    start: int  # its "["
    ends: tuple[int, ...]


class _Refused(ValueError):
    """The scan does not take this body; json.loads decides."""


class ResentBodies:
    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self._seen: OrderedDict[str, _Seen] = OrderedDict()
        self._bytes = 0

    def parse(self, session_id: str, data: bytes) -> Body:
        """``Body.parse(data)``, with the conversation array left unparsed where it repeats the session's last
        body; that body is then this one."""
        if len(data) > LEAN_BYTES or not data:
            return Body.parse(data)
        prev = self._seen.get(session_id)
        shared = _shared_elements(prev, data) if prev is not None else 0
        try:
            if prev is not None and shared:
                scan = _Scan(data, prev, prev.ends[shared - 1])
                ends = (*prev.ends[:shared], *scan.ends)
            else:
                scan = _Scan(data, None, 0)
                ends = tuple(scan.ends)
        except (ValueError, RecursionError):  # bad JSON (or JSON this scan does not take): parsed whole, as always
            return Body.parse(data)
        seen = _Seen(data, scan.key, scan.start, ends) if scan.key is not None and ends else None
        self._remember(session_id, seen)
        return Body(value=scan.body, json_bytes=fold_line_breaks(data), lean=scan.key is not None)

    def _remember(self, session_id: str, seen: _Seen | None) -> None:
        old = self._seen.pop(session_id, None)
        if old is not None:
            self._bytes -= len(old.data)
        if seen is None or len(seen.data) > self.keep_bytes:
            return
        self._seen[session_id] = seen
        self._bytes += len(seen.data)
        while self._bytes > self.keep_bytes:
            _, dropped = self._seen.popitem(last=False)
            self._bytes -= len(dropped.data)


def _shared_elements(prev: _Seen, data: bytes) -> int:
    """How many of ``prev``'s conversation elements ``data`` holds byte for byte, up to the last one's end."""
    count = bisect.bisect_left(prev.ends, len(data))  # ends before the end of data
    old = memoryview(prev.data)  # compared in place, not copied
    if count == 0 or data.startswith(old[: prev.ends[count - 1]]):  # usually: the whole old conversation, and more
        return count
    lo, hi = 0, count - 2  # the same bytes up to an end means the same bytes up to every earlier end too
    while lo <= hi:
        mid = (lo + hi) // 2
        if data.startswith(old[: prev.ends[mid]]):
            lo = mid + 1
        else:
            hi = mid - 1
    return lo


class _Scan:
    """A top-level object parsed member by member: ``body`` with the conversation elided, its ``key`` (None when
    there is none) and ``start``, and the byte offsets where the conversation elements parsed here end. With
    ``prev``, the body's bytes before ``resume`` are those of ``prev``, ending after one of its conversation
    elements: the members before the conversation are parsed, its elements up to ``resume`` are not."""

    def __init__(self, data: bytes, prev: _Seen | None, resume: int) -> None:
        self.data = data
        self.body: dict[str, Any] = {}
        self.key: str | None = None
        self.start = 0
        self.ends: list[int] = []
        # The text being read, and the byte offset of its first character in the body.
        self._text = data.decode("utf-8") if prev is None else data[: prev.start + 1].decode("utf-8")
        self._base = 0
        self._ascii = self._text.isascii()
        self._counted = (0, 0)  # (char index, byte offset) up to which the text's UTF-8 length is known
        text = self._text
        i = _ws(text, 0)
        if text[i : i + 1] != "{":
            raise _Refused("not an object")
        i = _ws(text, i + 1)
        if text[i : i + 1] == "}":
            self._end(i + 1)
            return
        while True:
            if text[i : i + 1] != '"':
                raise _Refused(f"expected a property name at char {i}")
            key, i = _DECODER.raw_decode(text, i)
            i = _ws(text, i)
            if text[i : i + 1] != ":":
                raise _Refused(f"expected ':' at char {i}")
            i = _ws(text, i + 1)
            if self.key is None and key in CONVERSATION_KEYS and text[i : i + 1] == "[":
                i = self._conversation(key, i, prev, resume)
                text = self._text
            else:
                self.body[key], i = _DECODER.raw_decode(text, i)
            i = _ws(text, i)
            if text[i : i + 1] == ",":
                i = _ws(text, i + 1)
                continue
            if text[i : i + 1] != "}":
                raise _Refused(f"expected ',' or '}}' at char {i}")
            self._end(i + 1)
            return

    def _conversation(self, key: str, i: int, prev: _Seen | None, resume: int) -> int:
        """Read the conversation array whose "[" is at ``i``; the index after its "]" (in the text read now)."""
        self.start = self._byte_offset(i)
        if prev is not None:
            if (key, self.start) != (prev.key, prev.start):
                raise _Refused("not where the last body had its conversation")
            # Jump over the elements the last body had too: read on from just after the last of them.
            self._text, self._base = self.data[resume:].decode("utf-8"), resume
            self._ascii, self._counted = self._text.isascii(), (0, resume)
            i = 0
        else:
            i = _ws(self._text, i + 1)
            if self._text[i : i + 1] == "]":
                self.body[key] = []  # empty: kept as it is, nothing to resume from
                return i + 1
            i = self._element(i)
        self.key, self.body[key] = key, ELIDED
        text = self._text
        while True:
            i = _ws(text, i)
            if text[i : i + 1] == "]":
                return i + 1
            if text[i : i + 1] != ",":
                raise _Refused(f"expected ',' or ']' at char {i}")
            i = self._element(_ws(text, i + 1))

    def _element(self, i: int) -> int:
        """Parse the element at ``i`` (and drop it); note where it ends."""
        _, i = _DECODER.raw_decode(self._text, i)
        self.ends.append(self._byte_offset(i))
        return i

    def _byte_offset(self, i: int) -> int:
        """The byte offset in the body of character ``i`` of the text being read."""
        if self._ascii:
            return self._base + i
        char, offset = self._counted
        offset += len(self._text[char:i].encode("utf-8"))  # the indices only grow: each character counted once
        self._counted = (i, offset)
        return offset

    def _end(self, i: int) -> None:
        if _ws(self._text, i) != len(self._text):
            raise _Refused(f"extra data at char {i}")


def _ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()  # type: ignore[union-attr]  # matches the empty string too
