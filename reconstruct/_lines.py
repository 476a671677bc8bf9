"""Incremental splitter of capture files into record lines: where each line is, and the few head fields an index needs.

    indexer = LineIndexer()
    refs = indexer.decode(block)   # for each block read, split anywhere
    torn = indexer.flush()         # the unterminated last line (a ``kill -9`` mid-write), or None

Lines end with ``\\n`` only (addon/record.py: JSON strings may hold U+2028, which ``str.splitlines`` would split
on). Only the first ``head`` bytes of a line are kept: enough for ``parse_head`` to read the record id, session and
version without parsing a 200 KB line. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import re

from reconstruct._json import loads

__all__ = ["HEAD_BYTES", "RECORD_START", "Head", "LineIndexer", "LineRef", "parse_head"]

HEAD_BYTES = 512
RECORD_START = b'{"v": '  # the first bytes of every record the writer writes

# The writer (addon/record.py ``encode``) starts every record with these keys, in this order.
_HEAD = re.compile(rb'^\{"v": (\d+), "id": "([0-9a-f]+)", "session_id": "((?:[^"\\]|\\.)*)"')


@dataclasses.dataclass(frozen=True, slots=True)
class LineRef:
    offset: int  # of the line's first byte in the file
    length: int  # without the newline
    head: bytes  # its first HEAD_BYTES bytes


@dataclasses.dataclass(frozen=True, slots=True)
class Head:
    version: int
    id: str
    session_id: str


class LineIndexer:
    def __init__(self, head: int = HEAD_BYTES) -> None:
        self._head_size = head
        self._pos = 0  # file offset of the next byte fed
        self._start = 0  # file offset where the current line began
        self._head = bytearray()

    def decode(self, chunk: bytes | bytearray) -> list[LineRef]:
        out: list[LineRef] = []
        i = 0
        while True:
            j = chunk.find(b"\n", i)
            end = len(chunk) if j < 0 else j
            need = self._head_size - len(self._head)
            if need > 0:
                self._head += chunk[i : min(end, i + need)]
            if j < 0:
                break
            out.append(LineRef(self._start, self._pos + j - self._start, bytes(self._head)))
            self._start = self._pos + j + 1
            self._head = bytearray()
            i = j + 1
        self._pos += len(chunk)
        return out

    def flush(self) -> LineRef | None:
        """The last line when the data did not end with a newline (torn), else None."""
        if self._pos == self._start:
            return None
        ref = LineRef(self._start, self._pos - self._start, bytes(self._head))
        self._start = self._pos
        self._head = bytearray()
        return ref


def parse_head(head: bytes) -> Head | None:
    """The version, record id and session of a record from its first bytes; None when they are not in the
    writer's layout (then the caller parses the whole line)."""
    m = _HEAD.match(head)
    if m is None:
        return None
    session = m.group(3)
    try:
        sid = loads(b'"' + session + b'"') if b"\\" in session else session.decode("utf-8")
    except ValueError:  # also UnicodeDecodeError
        return None
    return Head(int(m.group(1)), m.group(2).decode("ascii"), sid)
