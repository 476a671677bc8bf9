"""Capture format v2: a record in bytes close to what is new in its call, and the v1 record it stands for.

A v1 record (addon/record.py) holds everything that crossed the wire, again for every call: a session that resends
its history is recorded in bytes that grow with the square of its length, and a streamed answer costs ~330 bytes a
sampled token (one SSE chunk each). A v2 record stands for exactly one v1 record, byte for byte
(:func:`Expander.expand`), but stores a request that extends the session's previous one as the number of bytes
they share plus what is new, and everything bulky compressed with ``zlib`` (issue 27). Standard library only.

Files are v1's (addon/record.py): append-only, ``O_EXCL``, mode 0600, one line per record, ``\\n`` only, rotated.
A file may hold v1 and v2 records; readers take both.

Record, format version 2
------------------------
The head is v1's, in v1's order and meaning, up to ``clamped``; then:

=====================  ==========================================================================
field                  meaning
=====================  ==========================================================================
``v``                  format version, ``2``
``id`` ... ``clamped`` as in v1: ``id``, ``session_id``, ``session_source``, ``api``, ``upstream``,
                       ``method``, ``path``, ``status``, ``streamed``, ``t_start``, ``t_first_byte``,
                       ``t_end``, ``complete``, ``error``, ``request_headers``, ``response_headers``,
                       ``injected``, ``translated``, ``constrained``, ``clamped``
``base``               null for a full record; else the ``id`` of the session's previous record in
                       this file, whose request bodies this one's extend
``request_keep``       bytes of the base record's ``request`` (as the v1 line holds it) that this
                       record's ``request`` starts with; 0 in a full record
``upstream_keep``      the same for ``upstream_request`` (``null`` counts as the 4 bytes ``null``)
``prompt_keep``        bytes of the base record's prompt id array (the first ``"prompt_token_ids":[``
                       in its response body, up to ``]``: a vLLM answer repeats the whole prompt's
                       ids) that this record's array starts with; they are left out of ``tail``, right
                       after that key
``sizes``              ``[tail, request]``: byte lengths of the first two parts of ``z``
``z``                  base64 of the ``zlib`` stream of three parts, one after the other: the v1
                       line's ``"chunks": ..., "request_raw": ..., "response_b64": ...,
                       "response_body": ...`` members as a JSON object (``tail``, less the kept
                       prompt ids); the request's
                       bytes after ``request_keep``; the upstream request's bytes after
                       ``upstream_keep``
``crc``                as in v1: CRC-32 of the line's bytes before it, the last member
=====================  ==========================================================================

The v1 line a v2 record stands for is its head (``v`` 1) with the ``tail`` members, then ``"request": `` base
request's first ``request_keep`` bytes and the new ones, ``"upstream_request": `` likewise, then its own ``crc``.

Damage stays bounded. A session's record is full (``base`` null) when it is the session's first in its file or
its previous full one is :data:`FULL_EVERY` records back, so a torn or lost record (``kill -9``, a full disk) takes
at most ``FULL_EVERY - 1`` later records of that one session with it. A reader keeps the last record it rebuilt of
each session and takes a delta record only when its ``base`` is that record: else the record is unresolved,
counted, never rebuilt on the wrong base.
"""

from __future__ import annotations

import base64
import json
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from addon.record import Record, crc_tail, v1_line_parts

FORMAT_VERSION = 2
V2_START = b'{"v": 2, '  # how every v2 line starts (the writer's layout)
FULL_EVERY = 16  # a session's record is full at least this often (the damage bound above)
KEEP_BYTES = 256 << 20  # a writer's last records across sessions (~2,000 sessions of 30K-token contexts)
LEVEL = 1  # zlib level: the writer's CPU counts; level 6 gave 0.066 of v1's bytes on the bench, level 1 0.074
# The v1 head's members in order, up to the ones v2 keeps in ``z`` (addon/record.py ``encode_parts``).
HEAD_KEYS = (
    "id", "session_id", "session_source", "api", "upstream", "method", "path", "status", "streamed", "t_start",
    "t_first_byte", "t_end", "complete", "error", "request_headers", "response_headers", "injected", "translated",
    "constrained", "clamped",
)  # fmt: skip
TAIL_KEYS = ("chunks", "request_raw", "response_b64", "response_body")


class Unresolved(ValueError):
    """A delta record whose base record is not the session's previous one read (torn, lost or out of order)."""


@dataclass(frozen=True, slots=True)
class _Last:
    """What a session's next record may refer to: its previous record's id and the bytes it extends."""

    id: str
    request: bytes
    upstream_request: bytes
    prompt_ids: bytes  # the answer's prompt id array as the tail holds it (b"" when none)
    since_full: int = 0  # records since the session's last full one

    @property
    def size(self) -> int:
        return len(self.request) + len(self.upstream_request) + len(self.prompt_ids)


class Encoder:
    """A writer's v2 encoder for one file: each session's previous record in it, to refer to. At most ``keep_bytes``
    of them are kept, the sessions seen least recently dropped first: a dropped session's next record is full."""

    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self._last: OrderedDict[str, _Last] = OrderedDict()
        self._bytes = 0

    def snapshot(self) -> tuple[OrderedDict[str, _Last], int]:
        return OrderedDict(self._last), self._bytes

    def restore(self, snapshot: tuple[OrderedDict[str, _Last], int]) -> None:
        """Back to a :meth:`snapshot` (lines encoded after it did not reach the file)."""
        self._last, self._bytes = OrderedDict(snapshot[0]), snapshot[1]

    def _remember(self, session: str, last: _Last) -> None:
        if (old := self._last.pop(session, None)) is not None:
            self._bytes -= old.size
        self._last[session] = last
        self._bytes += last.size
        while self._bytes > self.keep_bytes and self._last:
            self._bytes -= self._last.popitem(last=False)[1].size

    def encode(self, record: Record) -> tuple[bytes, ...]:
        """The v2 line of ``record`` in pieces (checksum and newline included); it becomes its session's last."""
        session = record.head["session_id"]
        last = self._last.get(session)
        if last is not None and last.since_full + 1 >= FULL_EVERY:
            last = None  # a full record
        tail = json.dumps({k: record.head[k] for k in TAIL_KEYS}, ensure_ascii=False).encode("utf-8")
        span = prompt_span(tail)
        prompt_ids = tail[span[0] : span[1]] if span else b""
        keep = shared_prefix(last.request, record.request) if last else 0
        up_keep = shared_prefix(last.upstream_request, record.upstream_request) if last else 0
        prompt_keep = shared_prefix(last.prompt_ids, prompt_ids) if last and span else 0
        if span and prompt_keep:
            tail = tail[: span[0]] + tail[span[0] + prompt_keep :]
        request_new = memoryview(record.request)[keep:]
        z = zlib.compressobj(LEVEL)
        packed = b"".join(
            (z.compress(tail), z.compress(request_new), z.compress(memoryview(record.upstream_request)[up_keep:]))
        )
        packed += z.flush()
        head = {"v": FORMAT_VERSION, **{k: record.head[k] for k in HEAD_KEYS}}
        head |= {
            "base": last.id if last else None,
            "request_keep": keep,
            "upstream_keep": up_keep,
            "prompt_keep": prompt_keep,
            "sizes": [len(tail), len(request_new)],
            "z": base64.b64encode(packed).decode("ascii"),
        }
        line = (json.dumps(head, ensure_ascii=False).encode("utf-8")[:-1],)
        since = last.since_full + 1 if last else 0
        self._remember(session, _Last(record.head["id"], record.request, record.upstream_request, prompt_ids, since))
        return (*line, crc_tail(line))


class Expander:
    """A reader's side: v2 records (parsed, checksum checked) back to the v1 records they stand for. Feed each
    session's records in file order; one Expander may serve many sessions and files."""

    def __init__(self) -> None:
        self._last: dict[str, _Last] = {}

    def expand(self, v2: dict[str, Any], *, checksum: bool = True) -> bytes:
        """The v1 line (no newline) that the v2 record ``v2`` stands for; :class:`Unresolved` when its base is not
        the session's last record fed, ``ValueError`` naming the field when it is malformed. Without ``checksum``
        the line ends without its ``crc`` member (a reader that checked the v2 line needs no second check)."""
        session, base, rid = v2.get("session_id"), v2.get("base"), v2.get("id")
        if not isinstance(session, str) or not isinstance(rid, str):
            raise ValueError("a v2 record without a session_id or id")
        last = self._last.pop(session, None)  # a record that fails leaves the session without a base
        if base is not None and (last is None or last.id != base):
            raise Unresolved(f"record {rid}: its base record {base} was not read before it (torn or lost)")
        if base is None:
            last = None
        try:
            sizes, keeps = v2["sizes"], (v2["request_keep"], v2["upstream_keep"], v2.get("prompt_keep", 0))
            data = zlib.decompress(base64.b64decode(v2["z"], validate=True))
            tail_end, request_end = sizes[0], sizes[0] + sizes[1]
            if last is None and any(keeps):
                raise ValueError("a full record keeps bytes of a base")
        except (KeyError, TypeError, IndexError, zlib.error, ValueError) as e:
            raise ValueError(f"record {rid}: malformed v2 fields (sizes, *_keep, z): {e}") from e
        tail = data[:tail_end]
        if keeps[2] and last is not None:  # (a full record keeps nothing: checked above)
            if (start := _prompt_start(tail)) < 0:
                raise ValueError(f"record {rid}: malformed v2 fields (prompt_keep): its tail holds no prompt ids")
            tail = tail[:start] + last.prompt_ids[: keeps[2]] + tail[start:]
        span = prompt_span(tail)
        request = (last.request[: keeps[0]] if last else b"") + data[tail_end:request_end]
        upstream = (last.upstream_request[: keeps[1]] if last else b"") + data[request_end:]
        if tail[:1] != b"{" or tail[-1:] != b"}":
            raise ValueError(f"record {rid}: malformed v2 fields (z): its tail is not a JSON object")
        self._last[session] = _Last(rid, request, upstream, tail[span[0] : span[1]] if span else b"")
        # The tail's members are spliced in as the writer's JSON encoder wrote them: the very bytes v1 holds, and
        # no decoding and encoding of a streamed answer's text again.
        head = json.dumps({"v": 1, **{k: v2.get(k) for k in HEAD_KEYS}}, ensure_ascii=False).encode("utf-8")
        return b"".join(v1_line_parts(head[:-1] + b", " + tail[1:], request, upstream, checksum=checksum))[:-1]


# The prompt id array of a vLLM answer, in the tail's JSON (inside the response body's string: quotes escaped).
_PROMPT_KEY = b'\\"prompt_token_ids\\":['


def _prompt_start(tail: bytes) -> int:
    at = tail.find(_PROMPT_KEY)
    return -1 if at < 0 else at + len(_PROMPT_KEY)


def prompt_span(tail: bytes) -> tuple[int, int] | None:
    """Where the first prompt id array's digits lie in ``tail`` (between its brackets); None when there is none.
    A session's calls resend their history, so each answer's prompt ids extend the previous answer's."""
    start = _prompt_start(tail)
    stop = tail.find(b"]", start) if start >= 0 else -1
    return (start, stop) if stop >= 0 else None


def shared_prefix(old: bytes, new: bytes) -> int:
    """How many first bytes ``new`` shares with ``old``: a binary search of ``startswith`` (memcmp speed)."""
    view = memoryview(old)
    hi = min(len(old), len(new))
    if new.startswith(view[:hi]):
        return hi
    lo = 0  # new starts with old[:lo]; not with old[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if new.startswith(view[:mid]):
            lo = mid
        else:
            hi = mid
    return lo


def expand_lines(lines: Iterable[bytes]) -> Iterator[bytes]:
    """A file's record lines, in order, as the v1 lines they stand for (no newline): v1 lines as they are, v2 ones
    expanded. For tools and tests; ``python -m reconstruct expand`` also checks each line and counts what it skips.
    :class:`Unresolved` or ``ValueError`` on a v2 line that cannot be expanded."""
    expander = Expander()
    for line in lines:
        yield expander.expand(json.loads(line)) if line.startswith(V2_START) else line
