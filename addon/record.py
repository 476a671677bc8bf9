"""The capture record: one JSON line per model call, the format everything downstream reads.

This module is the single source of truth for the format. Standard library only.

Files
-----
Records go to ``<polar_dir>/capture-<UTC start>-<pid>-<8 random hex>[.<n>].jsonl`` (the random part keeps
names of proxies on different hosts or containers apart; files of earlier versions lack it and are read alike).
Each mitmdump process writes its own files, opened with ``O_EXCL`` (never overwritten, never truncated)
and mode 0600; a file is rotated to the next ``.<n>`` name once it passes ``polar_rotate_mb``. Readers take every
``*.jsonl`` under the folder. Lines end with ``\\n``; split on that byte only (JSON strings may hold
U+2028, which ``str.splitlines`` would also split on). A ``kill -9`` can leave a torn last line:
readers skip a line that does not parse and count it.

Record, format version 1
------------------------
=====================  ==========================================================================
field                  meaning
=====================  ==========================================================================
``v``                  format version, ``1``
``id``                 record id: 32 hex chars, unique per exchange
``session_id``         who made the call (see ``session_source``)
``session_source``     ``header`` (x-polar-session) | ``path`` (/s/<id>/...) | ``api_key`` (the key
                       was a session id) | ``key_hash`` (salted hash of a key) | ``id_hash`` (salted
                       hash of a header or path session id that is not a valid id: too long, control
                       characters, ``../``; added in issue 27) | ``anonymous``
``api``                ``chat`` | ``anthropic`` | ``responses`` | ``google`` | ``other`` (a path the
                       addon does not know: forwarded untouched)
``upstream``           the ``polar_upstream`` mode that shaped the request: vllm | sglang | plain
``method``, ``path``   the client's HTTP method and path (session prefix stripped; a ``key`` query
                       parameter removed); a translated call went upstream to /v1/chat/completions
``status``             upstream HTTP status, or null when no response arrived
``streamed``           true when the response was ``text/event-stream``
``t_start``            Unix seconds when the client's request began
``t_first_byte``       Unix seconds when the upstream's answer began (its headers), or null;
                       when each streamed chunk arrived is in ``chunks``
``t_end``              Unix seconds when the exchange ended (finished, failed or abandoned)
``request_headers``    client headers, credentials and cookies removed
``response_headers``   upstream response headers, or null
``request``            the client's body as JSON, or null when empty or not JSON
``request_raw``        null, or the body when it is not JSON: ``{"text": str}`` or ``{"base64": str}``
``injected``           fields the addon added to the body sent upstream, dotted keys for nested
                       ones (``stream_options.include_usage``); ``{}`` when none
``translated``         true when a native call (anthropic | responses | google) went upstream as
                       Chat Completions (then ``upstream_request`` is that body and ``response_body``
                       the upstream's chat answer); false otherwise. Records written before this
                       field existed lack it: readers then look at ``upstream_request`` itself
``constrained``        the fields of the body sent upstream that constrain decoding (``tool_choice``
                       required or named, ``response_format`` / ``text.format`` with a schema, vLLM's
                       ``structured_outputs`` / ``guided_*``; addon/constrained.py): the sampled ids'
                       log-probs are then not the policy's. ``[]`` when none. Added in issue 15 without
                       a version change (an added field); records written before lack it
``clamped``            null, or ``{"field": "max_tokens" | "max_completion_tokens", "asked": int,
                       "sent": int}``: the output cap of the body sent upstream was cut to the model's
                       context (``polar_clamp_max_tokens``, addon/clamp.py); ``upstream_request`` then
                       holds that body. Added in issue 15 without a version change; older records lack it
``upstream_request``   the body sent upstream when it differs from ``request`` in more than the
                       ``injected`` keys (null otherwise: then it is ``request`` with ``injected``
                       merged in, see :func:`upstream_body`)
``response_body``      the upstream's body as received (content-encoding undone), as text: JSON or the
                       SSE stream; null when there was none or it is not UTF-8. Kept as text, not
                       parsed: the proxy only records, reconstruction interprets
``response_b64``       the body in base64 when it is not UTF-8 (e.g. torn inside a character)
``chunks``             ``[[ms since t_start, bytes], ...]`` per network chunk of a stream (one
                       entry for a buffered answer)
``complete``           false when the exchange did not finish (stream broken, client gone, error)
``crc``                the last member: CRC-32 of the line's bytes before ``, "crc": ``, as 8 lower-case
                       hex digits; a line whose bytes do not match (two torn records spliced into one
                       line that still parses) is not a record. Added in issue 27 without a version
                       change; records written before lack it, and readers then take the line as it is
``error``              null, or ``{"kind": str, "message": str}``: ``upstream`` (refused, reset),
                       ``client`` (disconnected), ``decode`` (a content-encoding that is not gzip or
                       deflate, is corrupt, or decodes past ``polar_max_decoded_mb``: the body is then
                       kept encoded, in ``response_b64``; addon/content.py), ``translate``
                       (a native request or answer that could not be mapped), ``request`` (a body
                       the addon refused with a 400, e.g. JSON nested too deeply), ``addon``
=====================  ==========================================================================

Translated calls (``api`` anthropic | responses | google with ``polar_translate=auto``): ``request``
is the harness's native body, ``upstream_request`` the Chat Completions body sent upstream (token
fields included, also listed in ``injected``) and ``response_body`` the upstream's Chat Completions
answer; what the harness received is derived from it (see addon/native.py). With
``polar_translate=never`` the native call passes through and ``response_body`` is the native answer.

Interpretation (token ids, log-probs, assembling streams) is the reconstruction's job; the addon
only records what crossed the wire.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import zlib
from dataclasses import dataclass, field
from typing import Any

FORMAT_VERSION = 1
_FOLD = bytes.maketrans(b"\r\n", b"  ")


def new_record_id() -> str:
    return secrets.token_hex(16)


LEAN_BYTES = 8 << 20  # bodies larger than this are parsed lean (see Body.parse): less memory, more CPU
KEEP_CHARS = 1 << 16  # a bulk member longer than this (as text) is checked, not kept, in a lean parse
# Top-level members that carry a conversation's bulk in the APIs the addon speaks; none of them is read
# to decide the token fields, so a lean parse may leave them out.
BULK_KEYS = frozenset(
    ("messages", "tools", "functions", "input", "instructions", "contents", "system", "systemInstruction", "prompt")
)


class Elided:
    """A member of a large body that was checked as JSON but not kept (see :meth:`Body.parse`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<elided>"


ELIDED = Elided()


@dataclass
class Body:
    """A message body as captured: parsed JSON when it is JSON, else raw.

    ``json_bytes`` keeps the exact bytes (line breaks folded to spaces, which is lossless: outside
    strings they are whitespace, inside strings JSON allows them only escaped) so a record line
    embeds a 100 KB prompt without re-serialising it.

    A body over :data:`LEAN_BYTES` is parsed ``lean``: checked as JSON as a whole, but its large
    bulk members (:data:`BULK_KEYS`: the messages, the tools, ...) are checked element by element
    and left out of ``value`` (:data:`ELIDED`), so a 50 MB prompt never exists as Python objects next
    to its decoded text; :meth:`full` parses the whole value when something needs it (translation).
    """

    value: Any = None
    json_bytes: bytes | None = None
    raw: dict[str, str] | None = None
    too_deep: bool = False  # JSON nested deeper than the parser recurses: kept raw, the call is refused
    lean: bool = False  # value holds ELIDED members

    @classmethod
    def parse(cls, data: bytes, *, lean_over: int = LEAN_BYTES) -> Body:
        if not data:
            return cls()
        lean = len(data) > lean_over
        try:
            text = data.decode("utf-8")  # strict UTF-8: the record line must be UTF-8
            value = _lean_loads(text) if lean else json.loads(text)
            del text
        except (UnicodeDecodeError, ValueError):
            return cls(raw=raw_body(data))
        except RecursionError:
            return cls(raw=raw_body(data), too_deep=True)
        return cls(value=value, json_bytes=fold_line_breaks(data), lean=lean and isinstance(value, dict))

    def full(self) -> Any:
        """The whole parsed value (parsing the body again after a lean parse)."""
        if self.lean and self.json_bytes is not None:
            self.value, self.lean = json.loads(self.json_bytes.decode("utf-8")), False
        return self.value

    @property
    def is_json(self) -> bool:
        return self.json_bytes is not None


def fold_line_breaks(data: bytes) -> bytes:
    """JSON bytes with line breaks as spaces, for a record line. The body itself when it has none (what JSON
    encoders write): a 50 MB prompt costs no copy here; else one copy with the breaks folded."""
    return data.translate(_FOLD) if b"\n" in data or b"\r" in data else data


_WS = re.compile(r"[ \t\n\r]*")  # JSON's whitespace, as the json module reads it
# A JSON string as the json module's strict scanner accepts it: no raw control characters, only JSON's escapes.
_STRING = re.compile(r'"[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*"')
_DECODER = json.JSONDecoder()


def _ws(s: str, i: int) -> int:
    return _WS.match(s, i).end()  # type: ignore[union-attr]  # matches the empty string too


def _lean_loads(s: str) -> Any:
    """``json.loads(s)`` for a top-level object, accepting and refusing the same texts, but with the bulk
    members longer than KEEP_CHARS checked without building them and left out (ELIDED)."""
    i = _ws(s, 0)
    if s[i : i + 1] != "{":
        return json.loads(s)
    body: dict[str, Any] = {}
    i = _ws(s, i + 1)
    if s[i : i + 1] == "}":
        i += 1
    else:
        while True:
            if s[i : i + 1] != '"':
                raise ValueError(f"expected a property name at char {i}")
            key, i = _DECODER.raw_decode(s, i)
            i = _ws(s, i)
            if s[i : i + 1] != ":":
                raise ValueError(f"expected ':' at char {i}")
            start = i = _ws(s, i + 1)
            if key in BULK_KEYS:
                i = _check(s, i)
                body[key] = json.loads(s[start:i]) if i - start <= KEEP_CHARS else ELIDED
            else:
                body[key], i = _DECODER.raw_decode(s, i)
            i = _ws(s, i)
            if s[i : i + 1] == ",":
                i = _ws(s, i + 1)
                continue
            if s[i : i + 1] != "}":
                raise ValueError(f"expected ',' or '}}' at char {i}")
            i += 1
            break
    if _ws(s, i) != len(s):
        raise ValueError(f"extra data at char {i}")
    return body


def _check(s: str, i: int) -> int:
    """Check the JSON value at ``s[i]`` without building its strings, arrays or objects; its end.

    Strings are matched by a regular expression, numbers and constants by the json module itself, so
    the cost in Python is per array element and object member, not per byte.
    """
    c = s[i : i + 1]
    if c == '"':
        if (m := _STRING.match(s, i)) is None:
            raise ValueError(f"invalid string at char {i}")
        return m.end()
    if c not in ("[", "{"):
        return _DECODER.raw_decode(s, i)[1]  # a number, true, false, null, NaN, Infinity
    close = "]" if c == "[" else "}"
    i = _ws(s, i + 1)
    if s[i : i + 1] == close:
        return i + 1
    while True:
        if close == "}":
            if s[i : i + 1] != '"' or (m := _STRING.match(s, i)) is None:
                raise ValueError(f"expected a property name at char {i}")
            i = _ws(s, m.end())
            if s[i : i + 1] != ":":
                raise ValueError(f"expected ':' at char {i}")
            i = _ws(s, i + 1)
        i = _ws(s, _check(s, i))
        if s[i : i + 1] == ",":
            i = _ws(s, i + 1)
        elif s[i : i + 1] == close:
            return i + 1
        else:
            raise ValueError(f"expected ',' or '{close}' at char {i}")


def raw_body(data: bytes) -> dict[str, str]:
    try:
        return {"text": data.decode("utf-8")}
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(data).decode("ascii")}


@dataclass
class Exchange:
    """Everything known about one model call while it is in flight; becomes one record."""

    session_id: str
    session_source: str
    api: str
    upstream: str
    method: str
    path: str
    t_start: float
    request_headers: dict[str, str]
    id: str = field(default_factory=new_record_id)
    request: Body = field(default_factory=Body)
    injected: dict[str, Any] = field(default_factory=dict)
    upstream_request: Body | None = None
    translated: bool = False  # the native request went upstream as Chat Completions
    constrained: list[str] = field(default_factory=list)  # the upstream body's decoding constraints
    clamped: dict[str, Any] | None = None  # the output cap cut to the model's context (addon/clamp.py)
    status: int | None = None
    streamed: bool = False
    response_headers: dict[str, str] | None = None
    content_encoding: str = ""
    t_first_byte: float | None = None
    t_end: float | None = None
    chunks: list[bytes] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)
    complete: bool = False
    error: dict[str, str] | None = None
    written: bool = False


@dataclass(frozen=True, slots=True)
class Record:
    """One finished call as a record holds it, in any format: the head members in v1's order (``v`` left out) and
    the two request bodies as the line holds them (``upstream_request`` ``b"null"`` when there is none)."""

    head: dict[str, Any]
    request: bytes
    upstream_request: bytes


def encode(ex: Exchange, decode_content: Any) -> bytes:
    """One v1 record line for ``ex``. ``decode_content(bytes, encoding) -> bytes`` undoes gzip & co."""
    return b"".join(encode_parts(ex, decode_content))


def encode_parts(ex: Exchange, decode_content: Any) -> tuple[bytes, ...]:
    """The v1 record line for ``ex`` in pieces whose concatenation is the line (:func:`v1_parts`)."""
    return v1_parts(to_record(ex, decode_content))


def v1_parts(record: Record) -> tuple[bytes, ...]:
    """The v1 line of ``record`` in pieces: the request bodies are the very bytes the exchange holds, so a 50 MB
    prompt is written (``os.writev``) without a copy. Its checksum and newline end it."""
    head = json.dumps({"v": FORMAT_VERSION, **record.head}, ensure_ascii=False).encode("utf-8")
    return v1_line_parts(head, record.request, record.upstream_request)


def v1_line_parts(head: bytes, request: bytes, upstream_request: bytes, *, checksum: bool = True) -> tuple[bytes, ...]:
    """The v1 line from its head object's JSON (``{"v": 1, ...}``, every member but the request bodies) and the
    bodies' bytes. The request bodies go last, spliced in as the bytes they arrived as; the checksum of all that
    ends the line (without ``checksum``: just ``}``, as a line written before the checksum existed)."""
    parts = (head[:-1] + b', "request": ', request, b', "upstream_request": ', upstream_request)
    return (*parts, crc_tail(parts) if checksum else b"}\n")


def to_record(ex: Exchange, decode_content: Any) -> Record:
    """What the record of ``ex`` holds, in any format. Runs on the writer thread: the event loop never serialises
    bodies."""
    body = b"".join(ex.chunks)
    error = ex.error
    if ex.content_encoding and body:
        try:
            body = decode_content(body, ex.content_encoding)
        except Exception as e:  # noqa: BLE001 - keep the encoded bytes rather than lose the response
            error = error or {"kind": "decode", "message": str(e) if isinstance(e, ValueError) else repr(e)}
    response_body, response_b64 = None, None
    if body:
        try:
            response_body = body.decode("utf-8")
        except UnicodeDecodeError:
            response_b64 = base64.b64encode(body).decode("ascii")
    head = {
        "id": ex.id,
        "session_id": ex.session_id,
        "session_source": ex.session_source,
        "api": ex.api,
        "upstream": ex.upstream,
        "method": ex.method,
        "path": ex.path,
        "status": ex.status,
        "streamed": ex.streamed,
        "t_start": ex.t_start,
        "t_first_byte": ex.t_first_byte,
        "t_end": ex.t_end,
        "complete": ex.complete,
        "error": error,
        "request_headers": ex.request_headers,
        "response_headers": ex.response_headers,
        "injected": ex.injected,
        "translated": ex.translated,
        "constrained": ex.constrained,
        "clamped": ex.clamped,
        "chunks": [[round((t - ex.t_start) * 1000, 3), len(c)] for t, c in zip(ex.chunk_times, ex.chunks, strict=True)],
        "request_raw": ex.request.raw,
        "response_b64": response_b64,
        "response_body": response_body,
    }
    upstream = _json_bytes(ex.upstream_request) if ex.upstream_request else b"null"
    return Record(head, _json_bytes(ex.request), upstream)


def crc_tail(parts: tuple[bytes, ...]) -> bytes:
    """The end of a record line: its ``crc`` member (CRC-32 of the line's bytes before it), ``}`` and the newline."""
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return b', "crc": "%08x"}\n' % crc


def _json_bytes(body: Body) -> bytes:
    if body.json_bytes is not None:
        return body.json_bytes
    return b"null" if body.value is None else json.dumps(body.value, ensure_ascii=False).encode("utf-8")


def merge_fields(body: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``body`` with ``fields`` (dotted keys for nested ones) set."""
    merged = dict(body)
    for dotted, value in fields.items():
        *parents, leaf = dotted.split(".")
        target = merged
        for key in parents:
            target[key] = dict(target.get(key) or {})
            target = target[key]
        target[leaf] = value
    return merged


def upstream_body(record: dict[str, Any]) -> Any:
    """The JSON body that was sent upstream, from a parsed record."""
    if record.get("upstream_request") is not None:
        return record["upstream_request"]
    request = record.get("request")
    if isinstance(request, dict) and record.get("injected"):
        return merge_fields(request, record["injected"])
    return request
