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
``base``               the ``id`` of the session's previous record in this file, whose request bodies
                       this one's extend; null when it extends none (the session's first record in the
                       file, one whose previous record the writer no longer keeps, a full record that
                       shares no byte with it): then every ``*_keep`` is 0
``request_keep``       bytes of the base record's ``request`` (as the v1 line holds it) that this
                       record's ``request`` starts with
``upstream_keep``      the same for ``upstream_request`` (``null`` counts as the 4 bytes ``null``)
``prompt_keep``        bytes of the base record's prompt id array (the first ``"prompt_token_ids":[``
                       in its response body, up to ``]``: a vLLM answer repeats the whole prompt's
                       ids) that this record's array starts with; they are left out of ``tail``, right
                       after that key
``sizes``              ``[tail, request]``: byte lengths of the first two parts of ``z``; or
                       ``[tail, request, upstream]`` when a fourth part, ``stream``, follows (a
                       streamed answer stored column-wise, below; added in issue 27's second round:
                       records with two sizes have no such part)
``z``                  base64 of the ``zlib`` stream of three or four parts, one after the other: the
                       v1 line's ``"chunks": ..., "request_raw": ..., "response_b64": ...,
                       "response_body": ...`` members as a JSON object (``tail``, less the kept
                       prompt ids, and with a ``stream`` part less the events stored there); the
                       request's bytes after ``request_keep``; the upstream request's bytes after
                       ``upstream_keep``; ``stream``
``zf``                 only in a full record that has a base: base64 of the ``zlib`` stream of the
                       bytes its ``*_keep`` fields keep of the base, one after the other (request,
                       upstream request, prompt ids), so that it reads without its base (added in issue
                       27's third round; before it, full records had a null ``base``)
``crc``                as in v1: CRC-32 of the line's bytes before it, the last member
=====================  ==========================================================================

The v1 line a v2 record stands for is its head (``v`` 1) with the ``tail`` members, then ``"request": `` base
request's first ``request_keep`` bytes and the new ones, ``"upstream_request": `` likewise, then its own ``crc``.

A streamed answer, column-wise (``stream``)
-------------------------------------------
A vLLM stream is one SSE event per sampled token, each the same JSON but for a few values (the token's text, id and
log-prob). The writer takes the event in the middle of the stream as a template: the value of every member that is
a string, a number, a flat array of numbers or a literal is a slot, and so is the key of a ``"delta"``'s member
(``content``, ``reasoning`` or ``reasoning_content``). Each event that is exactly the template with other values
(its JSON on one ``data:`` line, right after the stream's start or a blank line) is stored as its slots' values, one
column per slot; a slot whose value is the same in every such event goes back into the template, except the values
a reader takes from columns (``token_ids``, ``logprob``, ``finish_reason``). Every other event (the role chunk with
the prompt ids, the usage chunk, ``[DONE]``, a tool call, an event of another shape) stays text: the tail's
``response_body`` holds those, in order. A stream with fewer than :data:`MIN_EVENTS` such events, or with a CR, is
stored as text. The ``stream`` part is UTF-8: a JSON object, a line break, then the columns:

=====================  ==========================================================================
member                 meaning
=====================  ==========================================================================
``t``                  the template: the k + 1 literal pieces around its k slots
``n``                  how many events fit it
``gaps``               ``[[i, m], ...]``: the next ``m`` characters of ``response_body`` come
                       before the ``i``-th templated event (``i`` = ``n``: after the last)
(columns)              the k columns after the line break, joined by a blank line (``\n\n``);
                       each the ``n`` values of its slot as the event held them (JSON text), joined
                       by ``\n`` (no JSON value a slot takes holds a line break)
=====================  ==========================================================================

The stream as received is the literal pieces and each event's values, event by event, with the ``response_body``
pieces put in at their ``gaps``. A reader takes the sampled ids and log-probs from the ``token_ids`` and ``logprob``
columns without building or scanning the stream's text (reconstruct/_chat.py ``_fast_columns``).

Damage stays bounded. A session's record is full (``base`` null, or ``zf`` set) when it is the session's first in
its file or its previous full one is :data:`FULL_EVERY` records back, so a torn or lost record (``kill -9``, a full
disk) takes at most ``FULL_EVERY - 1`` later records of that one session with it. A reader keeps the last record it
rebuilt of each session and takes a delta record only when its ``base`` is that record: else the record is
unresolved, counted, never rebuilt on the wrong base. A full record with a base is written as a delta of it plus
``zf``: a reader that has the base reads it as a delta and never inflates ``zf`` (most of the record's bytes, the
whole history again); one that lost the base reads the kept bytes from ``zf``.
"""

from __future__ import annotations

import base64
import json
import re
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
        full = last is None or last.since_full + 1 >= FULL_EVERY
        members = {k: record.head[k] for k in TAIL_KEYS}
        body = members["response_body"]
        found = split_stream(body) if record.head.get("streamed") and isinstance(body, str) else None
        if found is not None:
            members["response_body"] = found[0]  # the events that fit no template; the rest goes column-wise
        tail = json.dumps(members, ensure_ascii=False).encode("utf-8")
        span = prompt_span(tail)
        prompt_ids = tail[span[0] : span[1]] if span else b""
        keep = shared_prefix(last.request, record.request) if last else 0
        up_keep = shared_prefix(last.upstream_request, record.upstream_request) if last else 0
        prompt_keep = shared_prefix(last.prompt_ids, prompt_ids) if last and span else 0
        if span and prompt_keep:
            tail = tail[: span[0]] + tail[span[0] + prompt_keep :]
        request_new = memoryview(record.request)[keep:]
        upstream_new = memoryview(record.upstream_request)[up_keep:]
        kept = None  # a full record's own copy of what it keeps of its base, compressed on its own (``zf``)
        if full and last is not None and (keep or up_keep or prompt_keep):
            prefixes = (record.request[:keep], record.upstream_request[:up_keep], prompt_ids[:prompt_keep])
            kept = zlib.compress(b"".join(prefixes), LEVEL)
        z = zlib.compressobj(LEVEL)
        packed = b"".join((z.compress(tail), z.compress(request_new), z.compress(upstream_new)))
        if found is not None:
            packed += z.compress(found[1].encode())
        packed += z.flush()
        head = {"v": FORMAT_VERSION, **{k: record.head[k] for k in HEAD_KEYS}}
        head |= {
            "base": last.id if last is not None and (kept is not None or not full) else None,
            "request_keep": keep,
            "upstream_keep": up_keep,
            "prompt_keep": prompt_keep,
            "sizes": [len(tail), len(request_new)] + ([len(upstream_new)] if found is not None else []),
            "z": base64.b64encode(packed).decode("ascii"),
        }
        if kept is not None:
            head["zf"] = base64.b64encode(kept).decode("ascii")
        line = (json.dumps(head, ensure_ascii=False).encode("utf-8")[:-1],)
        since = 0 if full or last is None else last.since_full + 1
        self._remember(session, _Last(record.head["id"], record.request, record.upstream_request, prompt_ids, since))
        return (*line, crc_tail(line))


class Lazy:
    """A request body of a v2 record, built when first asked for: its base record's first ``keep`` bytes and its
    own new ones (a reader that never needs a call's request never copies it)."""

    __slots__ = ("_base", "_keep", "_new", "_value")

    def __init__(self, base: Lazy | None, keep: int, new: bytes) -> None:
        self._base, self._keep, self._new = base, keep, new
        self._value: bytes | None = None if base is not None and keep else new

    def get(self) -> bytes:
        if self._value is not None:
            return self._value
        # Back to a body already built, taking from each body on the way only the bytes this one keeps of it: one
        # copy, and none of the bodies between is built and kept (a session's records may all chain).
        pieces: list[bytes | memoryview] = [self._new]
        need, base = self._keep, self._base
        while base is not None and base._value is None:
            if need > base._keep:
                pieces.append(memoryview(base._new)[: need - base._keep])
                need = base._keep
            base = base._base
        assert base is not None and base._value is not None  # a body without a base is built from the start
        pieces.append(memoryview(base._value)[:need])
        self._value, self._base = b"".join(reversed(pieces)), None
        return self._value


@dataclass(frozen=True, slots=True)
class _Seen:
    """A reader's last record of a session: what the session's next record may refer to."""

    id: str
    request: Lazy
    upstream_request: Lazy
    prompt_array: bytes  # its answer's prompt id array, "[" and the digits (b"" when none)


@dataclass(frozen=True, slots=True)
class Parts:
    """A v2 record's parts, its base resolved (:meth:`Expander.parts`): the v1 record it stands for without building
    its line."""

    head: dict[str, Any]  # the v1 head members (HEAD_KEYS), as the v2 record has them
    tail: bytes  # the tail members' JSON as stored: the kept prompt ids left out (at ``prompt_at``), and a
    #   streamed answer's templated events too (``stream``)
    prompt_at: int  # where in ``tail`` the prompt ids start (-1: the tail holds none)
    prompt_keep: int  # how many bytes of the array's digits ``tail`` leaves out at ``prompt_at``
    prompt_array: bytes  # the answer's whole prompt id array: "[" and its digits, no "]" (b"" when none)
    request: Lazy
    upstream_request: Lazy
    stream: Stream | None

    def full_tail(self) -> bytes:
        """The v1 line's tail members: the prompt ids put back, and the stream."""
        tail = self.tail
        if self.prompt_keep:
            kept = memoryview(self.prompt_array)[1 : 1 + self.prompt_keep]
            tail = b"".join((tail[: self.prompt_at], kept, tail[self.prompt_at :]))
        if self.stream is not None:
            members = json.loads(tail)
            members["response_body"] = self.stream.text(members["response_body"])
            tail = json.dumps(members, ensure_ascii=False).encode("utf-8")
        return tail


class Expander:
    """A reader's side: v2 records (parsed, checksum checked) back to the v1 records they stand for. Feed each
    session's records in file order; one Expander may serve many sessions and files."""

    def __init__(self) -> None:
        self._last: dict[str, _Seen] = {}

    def parts(self, v2: dict[str, Any]) -> Parts:
        """The parts of the v2 record ``v2``; :class:`Unresolved` when its base is not the session's last record fed,
        ``ValueError`` naming the field when it is malformed."""
        session, base, rid = v2.get("session_id"), v2.get("base"), v2.get("id")
        if not isinstance(session, str) or not isinstance(rid, str):
            raise ValueError("a v2 record without a session_id or id")
        last = self._last.pop(session, None)  # a record that fails leaves the session without a base
        if base is None or last is None or last.id != base:
            if base is not None and "zf" not in v2:
                raise Unresolved(f"record {rid}: its base record {base} was not read before it (torn or lost)")
            last = None  # a full record: what it keeps of its base, it holds in ``zf`` too
        try:
            sizes, keeps = v2["sizes"], (v2["request_keep"], v2["upstream_keep"], v2.get("prompt_keep", 0))
            if not all(isinstance(k, int) and k >= 0 for k in keeps):
                raise ValueError("a *_keep that is not a count")
            data = zlib.decompress(base64.b64decode(v2["z"], validate=True))
            tail_end, request_end = sizes[0], sizes[0] + sizes[1]
            upstream_end = request_end + sizes[2] if len(sizes) > 2 else len(data)
            stream = Stream.decode(data[upstream_end:]) if len(sizes) > 2 else None
            kept = b""  # what the record keeps of its base, from its own ``zf`` (read only without that base)
            if last is None and any(keeps):
                if base is None or "zf" not in v2:
                    raise ValueError("a full record keeps bytes of a base")
                kept = zlib.decompress(base64.b64decode(v2["zf"], validate=True))
                if len(kept) != sum(keeps):
                    raise ValueError("zf does not hold the bytes the *_keep fields count")
        except (KeyError, TypeError, IndexError, zlib.error, ValueError) as e:
            raise ValueError(f"record {rid}: malformed v2 fields (sizes, *_keep, z, zf): {e}") from e
        tail = data[:tail_end]
        if tail[:1] != b"{" or tail[-1:] != b"}":
            raise ValueError(f"record {rid}: malformed v2 fields (z): its tail is not a JSON object")
        at = _prompt_start(tail)
        if keeps[2]:
            if at < 0:
                raise ValueError(f"record {rid}: malformed v2 fields (prompt_keep): its tail holds no prompt ids")
            stop = tail.find(b"]", at)
            ids = memoryview(last.prompt_array)[1 : 1 + keeps[2]] if last else memoryview(kept)[-keeps[2] :]
            prompt_array = b"".join((b"[", ids, tail[at : stop if stop >= 0 else at]))
        else:
            span = prompt_span(tail)
            prompt_array = tail[span[0] - 1 : span[1]] if span else b""
        if last is not None:
            request = Lazy(last.request, keeps[0], data[tail_end:request_end])
            upstream = Lazy(last.upstream_request, keeps[1], data[request_end:upstream_end])
        else:
            request = Lazy(None, 0, kept[: keeps[0]] + data[tail_end:request_end])
            upstream = Lazy(None, 0, kept[keeps[0] : keeps[0] + keeps[1]] + data[request_end:upstream_end])
        self._last[session] = _Seen(rid, request, upstream, prompt_array)
        head = {k: v2.get(k) for k in HEAD_KEYS}
        return Parts(head, tail, at, keeps[2], prompt_array, request, upstream, stream)

    def expand(self, v2: dict[str, Any], *, checksum: bool = True) -> bytes:
        """The v1 line (no newline) that the v2 record ``v2`` stands for; :class:`Unresolved` when its base is not
        the session's last record fed, ``ValueError`` naming the field when it is malformed. Without ``checksum``
        the line ends without its ``crc`` member (a reader that checked the v2 line needs no second check)."""
        return self.line(v2, self.parts(v2), checksum=checksum)

    @staticmethod
    def line(v2: dict[str, Any], parts: Parts, *, checksum: bool = False) -> bytes:
        """The v1 line (no newline) of the v2 record ``v2`` from its :meth:`parts`."""
        try:
            tail = parts.full_tail()
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"record {v2.get('id')}: malformed v2 fields (z): its stream does not rebuild: {e}") from e
        # The tail's members are spliced in as the writer's JSON encoder wrote them: the very bytes v1 holds, and
        # no decoding and encoding of a streamed answer's text again (one stored column-wise is encoded again).
        head = json.dumps({"v": 1, **parts.head}, ensure_ascii=False).encode("utf-8")
        request, upstream = parts.request.get(), parts.upstream_request.get()
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


# ---------------------------------------------------------------- a streamed answer, column-wise

# What a template slot takes, loosely as JSON writes it (a looser pattern is a faster split, and a value that fits
# no slot leaves its event raw): a string (no line break, no quote but escaped ones), a number, a flat array of
# numbers, a literal. None holds a line break, so a column's values are joined with "\n" and split back exactly.
_STR = r'"[^"\\\n]*(?:\\[^\n][^"\\\n]*)*"'
_NUM = r"-?[0-9][0-9.eE+-]*"
_ARRAY = rf"\[(?:{_NUM}(?:,{_NUM})*)?\]"
_SLOT = rf"({_STR}|{_NUM}|{_ARRAY}|null|true|false)"  # a slot whose value was null, true or false in the sample
# A slot whose value was a string, number or array in the sample takes only that (fewer tries: the split is the
# writer's cost); an event whose value there is of another type is kept raw.
_TYPED = {'"': f"({_STR})", "[": f"({_ARRAY})", **dict.fromkeys("-0123456789", f"({_NUM})")}
# The one key that is a slot too: what a token's delta holds (vLLM sends reasoning and content tokens alike).
_DELTA_KEYS = ("content", "reasoning", "reasoning_content")
_KEY_SLOT = '("(?:content|reasoning|reasoning_content)")'
# One JSON token of an event (after blanks): a string (with the colon that makes it a key), a slot's value, or
# punctuation.
_TOKEN = re.compile(rf"[ \t]*(?:({_STR})([ \t]*:)?|(\[(?:{_NUM}(?:,{_NUM})*)?\]|{_NUM}|null|true|false)|[\[\]{{}},])")
# Keys whose values stay columns even when every event has the same one (the reader takes them from columns).
KEEP_COLUMNS = ('"token_ids":', '"logprob":', '"finish_reason":')
# Members whose value stays the same through a stream: before an event's first slot, matched but not captured.
_CONSTANT_KEYS = frozenset(("id", "object", "created", "model", "system_fingerprint", "index", "type", "role"))
MIN_EVENTS = 8  # fewer events than this fit a template: the stream is kept as it is
_TEMPLATES: dict[tuple[str, ...], re.Pattern[str]] = {}  # compiled per template (a session's calls share one)


@dataclass(frozen=True, slots=True)
class Stream:
    """A streamed answer column-wise: the events that fit one template (``literals`` around its slots) as one
    column of values per slot, and the rest of the text (``raw``, in the record's ``response_body``) in ``gaps``:
    ``[i, n]`` puts the next ``n`` characters of ``raw`` before the ``i``-th templated event."""

    literals: tuple[str, ...]  # k + 1 pieces around k slots
    columns: tuple[str, ...]  # k columns, each its n values joined by "\n"
    n: int  # templated events
    gaps: tuple[tuple[int, int], ...]

    def encode(self) -> bytes:
        head = json.dumps({"t": self.literals, "n": self.n, "gaps": self.gaps}, ensure_ascii=False)
        return "\n".join((head, "\n\n".join(self.columns))).encode("utf-8")

    @classmethod
    def decode(cls, data: bytes) -> Stream:
        head, _, body = data.decode("utf-8").partition("\n")
        spec = json.loads(head)
        literals, n, gaps = tuple(spec["t"]), spec["n"], tuple((int(i), int(m)) for i, m in spec["gaps"])
        columns = tuple(body.split("\n\n")) if len(literals) > 1 else ()
        if not (
            isinstance(n, int)
            and n > 0
            and all(isinstance(s, str) for s in literals)
            and len(columns) == len(literals) - 1
            and all(c.count("\n") == n - 1 for c in columns)
            and all(0 <= i <= n and m > 0 for i, m in gaps)
        ):
            raise ValueError("a stream's columns do not fit its template")
        return cls(literals, columns, n, gaps)

    def resized(self, at: int, by: int) -> Stream:
        """The same stream with ``by`` more characters of raw text at ``at`` (a reader that cut an array out of it)."""
        gaps, done = list(self.gaps), 0
        for g, (i, size) in enumerate(gaps):
            if done <= at < done + size:
                gaps[g] = (i, size + by)
                return Stream(self.literals, self.columns, self.n, tuple(gaps))
            done += size
        raise ValueError("no raw text there")

    def events(self) -> list[str]:
        """The templated events' text, in order."""
        form = "%s".join(s.replace("%", "%%") for s in self.literals)
        if not self.columns:
            return [form % ()] * self.n
        return [form % values for values in zip(*(c.split("\n") for c in self.columns), strict=True)]

    def text(self, raw: str) -> str:
        """The stream as received, from the rest of its text."""
        events = self.events()
        parts: list[str] = []
        at = done = 0
        for i, size in self.gaps:
            parts += events[done:i]
            parts.append(raw[at : at + size])
            at, done = at + size, i
        if at != len(raw):
            raise ValueError("a stream's gaps do not cover the rest of its text")
        parts += events[done:]
        return "".join(parts)


def split_stream(text: str) -> tuple[str, Stream] | None:
    """``text`` (an event stream) as the rest of its text and its events column-wise; None when too few events fit
    the template of the event in its middle (a short answer, a stream of another shape, not an event stream)."""
    if not text.startswith(("data:", "event:", ":")) or "\r" in text:
        return None
    # The first event stays raw: it is not split (a vLLM stream's holds the prompt ids, often most of its text).
    first = text.find("\n\n") + 2
    if first < 2:
        return None
    rest = text[first:]
    for share in (2, 4, 3):  # the template of the event in the middle; if too few fit, of another
        start = rest.find("\n\n", len(rest) // share)
        end = rest.find("\n\n", start + 2)
        if start < 0 or end < 0:
            return None
        pattern, literals, fixed = _template(rest[start + 2 : end + 2])
        if pattern is None:
            continue
        parts = pattern.split(rest)
        k = len(literals) - 1
        n = (len(parts) - 1) // (k + 1)
        # Every event that fits starts with the sample's very text up to its first slot (else: no wildcards).
        if fixed is not None and rest.count(fixed) != n + "".join(parts[:: k + 1]).count(fixed):
            pattern, literals, fixed = _template(rest[start + 2 : end + 2], wildcards=False)
            assert pattern is not None
            parts = pattern.split(rest)
            k = len(literals) - 1
            n = (len(parts) - 1) // (k + 1)
        if n >= MIN_EVENTS:
            break
    else:
        return None
    parts[0] = text[:first] + parts[0]
    raws = parts[:: k + 1]
    # An event that fits must start one: at the text's start or after a blank line (else its text is another's).
    if any(not r.endswith("\n\n") for r in filter(None, raws[:-1])):
        return None
    columns = [parts[j + 1 :: k + 1] for j in range(k)]
    # A slot whose value never changes goes back into the template.
    kept_literals, kept = [literals[0]], []
    for j, column in enumerate(columns):
        if column.count(column[0]) == n and not literals[j].endswith(KEEP_COLUMNS):
            kept_literals[-1] += column[0] + literals[j + 1]
        else:
            kept.append("\n".join(column))
            kept_literals.append(literals[j + 1])
    gaps = tuple((i, len(r)) for i, r in enumerate(raws) if r)
    return "".join(raws), Stream(tuple(kept_literals), tuple(kept), n, gaps)


def _template(event: str, *, wildcards: bool = True) -> tuple[re.Pattern[str] | None, tuple[str, ...], str | None]:
    """The pattern of events shaped like ``event`` (the value of every member that is a scalar or a flat array of
    numbers is a slot, and the key of a delta's member too), the literal pieces around its slots as ``event`` has
    them, and (with ``wildcards``) the event's text before its first slot, where the values of members that stay
    the same through a stream (:data:`_CONSTANT_KEYS`: its id, model, ...) are matched but not captured: fewer
    slots, a faster split, and a pattern that serves every stream of that shape (the caller checks that every event
    that fits has that very text). The event's JSON is read token by token from its first ``{``."""
    pos = event.find("{")
    if pos < 0:
        return None, (), None
    pieces: list[str] = []
    slots: list[str] = []
    wild: list[tuple[int, int, str]] = []  # (start, end, pattern) of each value matched but not captured
    at = 0
    key: str | None = None  # the member's key when the last token was a key and its colon
    while (token := _TOKEN.match(event, pos)) is not None:
        string, colon, scalar = token.group(1, 2, 3)
        if string is not None and colon:
            if string[1:-1] in _DELTA_KEYS and re.search(r'"delta":\s*\{\s*$', event[at : token.start(1)]):
                pieces.append(event[at : token.start(1)])
                slots.append(_KEY_SLOT)
                at = token.end(1)
            key = string[1:-1]
        elif key is not None and (string is not None or scalar is not None):
            begin = token.start(1) if string is not None else token.start(3)
            slot = _TYPED.get(event[begin], _SLOT)
            if wildcards and not slots and key in _CONSTANT_KEYS:
                wild.append((begin, token.end(), "(?:" + slot[1:]))
            else:
                pieces.append(event[at:begin])
                slots.append(slot)
                at = token.end()
            key = None
        else:
            key = None
        pos = token.end()
    pieces.append(event[at:])
    if not slots:
        return None, (), None
    first: list[str] = []  # the first piece's pattern: its literal text and its wildcards
    done = 0
    for begin, end, slot in wild:
        first += (re.escape(event[done:begin]), slot)
        done = end
    first.append(re.escape(pieces[0][done:]))
    shape = ("".join(first), *pieces[1:])
    pattern = _TEMPLATES.get(shape)
    if pattern is None:
        if len(_TEMPLATES) > 256:
            _TEMPLATES.clear()
        source = shape[0] + "".join(s + re.escape(p) for s, p in zip(slots, pieces[1:], strict=True))
        pattern = _TEMPLATES[shape] = re.compile(source)
    return pattern, tuple(pieces), pieces[0] if wild else None
