"""The edges: capture files in (indexed, then read one session at a time), sessions table in, stats file out.

Memory stays bounded by the largest session, not by the files: a first pass indexes where each record line is
and which session it belongs to (reading only the head of each line), a second reads one session's lines back
with ``pread`` and drops them once its traces are built.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl

from addon import record_v2
from reconstruct._errors import CaptureError, ConfigError
from reconstruct._json import dumps, loads, loads_like_upstream
from reconstruct._lines import HEAD_BYTES, RECORD_START, LineIndexer, LineRef, parse_head
from reconstruct._tokens import TokenText

__all__ = [
    "CaptureIndex",
    "CaptureRecord",
    "discover",
    "has_upstream_request",
    "lifted_prompt",
    "parse_record",
    "read_session_ids",
    "read_session_tasks",
    "read_v2",
    "stored_stream",
]

BLOCK = 8 << 20
_SESSION_KEY = b'", "session_id": "'  # in every record head, right after the record id (see _Cuts)

FORMAT_VERSIONS = (1, record_v2.FORMAT_VERSION)  # of capture records (addon/record.py, addon/record_v2.py)


def discover(paths: list[Path]) -> list[Path]:
    """Capture files: each folder's ``*.jsonl`` (current and rotated), each file as given; sorted, no repeats."""
    files: set[Path] = set()
    for path in paths:
        if path.is_dir():
            files.update(p for p in path.rglob("*.jsonl") if p.is_file())
        elif path.is_file():
            files.add(path)
        else:
            raise CaptureError(f"{path}: no such capture file or folder")
    if not files:
        raise CaptureError(f"no *.jsonl capture files under {', '.join(map(str, paths))}")
    return sorted(files)


@dataclasses.dataclass
class IndexCounts:
    lines: int = 0
    corrupt: int = 0  # lines that do not parse as a record, or fail their checksum
    torn: int = 0  # unterminated last lines (a writer killed mid-line)
    unsupported: int = 0  # records of another format version
    duplicates: int = 0  # records whose id an earlier line already had (a copied capture file): skipped
    glued: int = 0  # lines holding more than one record (a torn line the next record was appended to): split
    unresolved: int = 0  # v2 records whose base record was torn, lost or corrupt: skipped (addon/record_v2.py)


class _Cuts:
    """Where records start in the middle of a line, found block by block as a file is indexed.

    A writer killed mid-line leaves a torn record; a later writer appends the next record right after it, so one
    line holds the end of one session's record and the start of another's. A record starts with ``RECORD_START``
    (the writer's layout); inside a line that can only be a record glued on, since JSON strings escape quotes and
    a request body would need the writer's own head fields in its order to match ``parse_head``.

    The scan looks for ``_SESSION_KEY`` rather than ``RECORD_START``: every head ``parse_head`` accepts holds it
    within ``HEAD_BYTES`` of its start, and being longer and made of rarer bytes it is searched about three times
    faster (prompt ids are mostly digits, which a search for ``{"v": `` keeps stopping at). Each hit is then
    traced back to the last ``RECORD_START`` before it, the only one whose head can reach it.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._tail = b""  # the previous block's last bytes: a head may straddle two blocks
        self.found: list[int] = []  # file offsets, ascending, of the starts not yet passed

    def scan(self, block: bytes | bytearray, offset: int) -> None:
        # Searched in the block itself (no copy of it): only a key near its start needs the previous block's tail.
        joint = self._tail + bytes(block[: len(_SESSION_KEY) - 1])
        straddling = joint.find(_SESSION_KEY, max(0, len(self._tail) - len(_SESSION_KEY) + 1))
        if straddling >= 0:
            self._check(joint, offset - len(self._tail), straddling)
        i = block.find(_SESSION_KEY)
        while i >= 0:
            if i > HEAD_BYTES:
                self._check(block, offset, i)
            else:
                self._check(self._tail + bytes(block[: i + 1]), offset - len(self._tail), len(self._tail) + i)
            i = block.find(_SESSION_KEY, i + 1)
        self._tail = bytes(block[-(HEAD_BYTES + len(_SESSION_KEY) + 1) :])

    def _check(self, data: bytes | bytearray, base: int, key: int) -> None:
        """Note the record start that the session key at ``data[key]`` (file offset ``base + key``) belongs to."""
        start = data.rfind(RECORD_START, max(0, key - HEAD_BYTES), key)
        # Not the file's first byte nor a line's (those are ordinary lines); the tail keeps the byte before any
        # start that a key in the next block can lead back to.
        new = start > 0 and data[start - 1] != 0x0A and (not self.found or self.found[-1] != base + start)
        if new and parse_head(os.pread(self._fd, HEAD_BYTES, base + start)) is not None:
            self.found.append(base + start)

    def split(self, ref: LineRef) -> list[LineRef]:
        """``ref`` cut at the record starts inside it (itself when there is none)."""
        end = ref.offset + ref.length
        if not self.found or self.found[0] >= end:
            return [ref]
        inside = [c for c in self.found if ref.offset < c < end]
        self.found = [c for c in self.found if c >= end]  # lines come in file order
        if not inside:
            return [ref]
        starts = [ref.offset, *inside]
        pieces = []
        for start, stop in zip(starts, [*inside, end], strict=True):
            head = ref.head if start == ref.offset else os.pread(self._fd, HEAD_BYTES, start)
            pieces.append(LineRef(start, stop - start, head[: stop - start]))
        return pieces


class CaptureIndex:
    """Where each session's record lines are; ``records(session)`` reads and parses them back."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files
        self.counts = IndexCounts()
        self.sessions: dict[str, list[tuple[int, int, int]]] = {}  # session -> [(file, offset, length)]
        self._ids: set[str] = set()  # record ids seen, to skip a record met twice (a copied capture file)
        self._fds: list[int] = []
        try:
            for number, path in enumerate(files):
                self._fds.append(os.open(path, os.O_RDONLY))
                self._index(number)
        except OSError as e:
            self.close()
            raise CaptureError(f"cannot read capture file: {e}") from e

    @classmethod
    def located(cls, files: list[Path], sessions: dict[str, list[tuple[int, int, int]]]) -> CaptureIndex:
        """An index built elsewhere (a worker process gets its share of sessions from the parent's index)."""
        index = cls([])
        index.files, index.sessions = files, sessions
        try:
            for path in files:
                index._fds.append(os.open(path, os.O_RDONLY))
        except OSError as e:
            index.close()
            raise CaptureError(f"cannot read capture file: {e}") from e
        return index

    def _index(self, number: int) -> None:
        # Read in blocks rather than mapped: a mapping would count the whole file as this process's memory.
        indexer = LineIndexer()
        fd = self._fds[number]
        cuts = _Cuts(fd)
        offset = 0
        buffer = bytearray(BLOCK)  # read into, block after block: no fresh 8 MB (and its page faults) per block
        while size := os.preadv(fd, [buffer], offset):
            block = buffer if size == BLOCK else buffer[:size]
            cuts.scan(block, offset)  # before the lines: a line ends in this block, so do its cuts
            offset += size
            for ref in indexer.decode(block):
                if ref.length == 0:
                    continue
                self.counts.lines += 1
                pieces = cuts.split(ref)
                self.counts.glued += len(pieces) > 1
                for piece in pieces:
                    self._add(number, piece.offset, piece.length, piece.head)
        if indexer.flush() is not None:
            self.counts.torn += 1

    def _add(self, number: int, offset: int, length: int, head: bytes) -> None:
        found = parse_head(head)
        version: int | None
        record_id: str | None
        session: str | None
        if found is not None:
            version, record_id, session = found.version, found.id, found.session_id
        else:  # not the writer's usual layout: parse the whole line for its session
            record = self._parse(os.pread(self._fds[number], length, offset))
            if record is None:
                return
            version, record_id, session = record.get("v"), record.get("id"), record.get("session_id")
        if version not in FORMAT_VERSIONS or not isinstance(session, str):
            self.counts.unsupported += 1
            return
        if isinstance(record_id, str):
            if record_id in self._ids:
                self.counts.duplicates += 1
                return
            self._ids.add(record_id)
        self.sessions.setdefault(session, []).append((number, offset, length))

    def _parse(self, line: bytes | bytearray) -> dict[str, Any] | None:
        """The record of a line: v1 as ``parse_record`` reads it, v2 as it is (see :meth:`records`)."""
        line = bytearray(line) if isinstance(line, bytes) else line
        record = parse_v2(line) if line.startswith(record_v2.V2_START) else parse_record(line)
        if record is None:
            self.counts.corrupt += 1
        return record

    def records(self, session: str) -> Iterator[dict[str, Any]]:
        """The session's records, in file order, each as its v1 record (a v2 one expanded: addon/record_v2.py); a
        line that does not parse is counted and skipped, as is a v2 record whose base was not read before it."""
        expander = record_v2.Expander()
        for number, offset, length in self.sessions.get(session, []):
            line = bytearray(length)
            os.preadv(self._fds[number], [line], offset)
            record = self._parse(line)
            if record is not None and record.get("v") == record_v2.FORMAT_VERSION:
                try:
                    parts = expander.parts(record)
                    # Read from its parts; where only its v1 line will do, that line (checked as v2)
                    record = read_v2(parts) or parse_record(bytearray(expander.line(record, parts)))
                except record_v2.Unresolved:
                    self.counts.unresolved += 1
                    continue
                except ValueError:
                    self.counts.corrupt += 1
                    continue
            if record is not None:
                yield record

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __enter__(self) -> CaptureIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The writer (addon/record.py ``encode``) ends every line with the request bodies, spliced in as received:
# ``..., "response_body": <str|null>, "request": <json>, "upstream_request": <json|null>}``.
_RESPONSE_KEY = b'"response_body": '
_BODIES = b', "request": '
_NO_UPSTREAM = b', "upstream_request": null}'
_BODY_KEYS = frozenset(("request", "upstream_request"))
# The prompt id array's key inside the response body, as the JSON-escaped string of the line holds it.
_PROMPT_IN_BODY = b'\\"prompt_token_ids\\":'
_CHUNKS = b', "chunks": '
_CRC_KEY = b', "crc": "'  # the line's last member: '..., "crc": "<8 hex>"}'
_CRC_TAIL = len(_CRC_KEY) + 10
_REQUEST_RAW = b', "request_raw": '


class CaptureRecord(dict):  # type: ignore[type-arg]
    """A parsed record line whose request bodies are parsed when first read: they are the larger half of a line
    and most calls never need them (merging works on the token ids in the response). ``prompt`` is the answer's
    prompt id array when it was lifted out of the line before parsing (see ``parse_record``): the response body
    then says ``"prompt_token_ids":null`` in its place. A v2 record read from its parts (``read_v2``) gives its
    bodies as ``record_v2.Lazy`` ones, and a streamed answer stored column-wise as ``stream`` (the stream and the
    rest of its text): its ``response_body`` is built from them when first read."""

    def __init__(
        self,
        head: dict[str, Any],
        bodies: memoryview | tuple[record_v2.Lazy, record_v2.Lazy],
        prompt: TokenText | None = None,
        stream: tuple[record_v2.Stream, str] | None = None,
    ) -> None:
        super().__init__(head)
        # '{"request": ..., "upstream_request": ...}', or the two bodies of a v2 record
        self._bodies: memoryview | tuple[record_v2.Lazy, record_v2.Lazy] | None = bodies
        self.prompt = prompt
        self.stream = stream
        self._text = stream is not None  # response_body is still to be built from ``stream``
        self.unreadable_bodies = False  # the bodies were read and did not parse (counted in the stats)

    def _load(self) -> None:
        if self._bodies is not None:
            bodies, self._bodies = self._bodies, None
            if isinstance(bodies, tuple):
                request, upstream = bodies[0].get(), bodies[1].get()
                bodies = memoryview(b"".join((b'{"request": ', request, b', "upstream_request": ', upstream, b"}")))
            try:
                parsed = loads_like_upstream(bodies)  # NaN and Infinity as vLLM reads them
            except ValueError:  # the head parsed, the bodies do not: keep the answer, lose the request
                parsed, self.unreadable_bodies = {}, True
            self["request"] = parsed.get("request")
            self["upstream_request"] = parsed.get("upstream_request")

    def _build_text(self) -> None:
        if self._text and self.stream is not None:
            self._text = False
            self["response_body"] = self.stream[0].text(self.stream[1])

    def __getitem__(self, key: str) -> Any:
        if key in _BODY_KEYS:
            self._load()
        elif key == "response_body":
            self._build_text()
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        if key in _BODY_KEYS:
            self._load()
        elif key == "response_body":
            self._build_text()
        return super().get(key, default)

    def sent_upstream_request(self) -> bool:
        """Whether ``upstream_request`` is set, without parsing the bodies."""
        if isinstance(self._bodies, tuple):
            return self._bodies[1].get() != b"null"
        if self._bodies is not None:
            return self._bodies[-len(_NO_UPSTREAM) :] != _NO_UPSTREAM
        return self.get("upstream_request") is not None


def parse_record(line: bytearray) -> dict[str, Any] | None:
    """One record line; None when the line is not a JSON object, or its checksum does not match its bytes.

    When the line has the writer's layout, only its head is parsed, and not all of it: the request bodies are
    left for later (``CaptureRecord``); the prompt id array of a Chat Completions answer is lifted out of the
    line as bytes, most of a line that merging compares as text (``TokenText``) and never needs decoded; the
    ``chunks`` timings, hundreds of small lists in a streamed record that nothing here reads, become null.
    ``line`` is changed in place (its checksum is cut off; its bodies become ``{"request": ...``: parsed later
    through a view)."""
    if not _checksum_holds(line):
        return None
    key = line.find(_RESPONSE_KEY)
    prompt = _prompt_span(line, key) if key >= 0 else None
    # The first ", "request": " after the response body's key ends the head: inside the JSON string of the
    # response body every quote is escaped. A prompt array found beyond it is not the answer's.
    cut = line.find(_BODIES, key, prompt[0]) if prompt is not None else -1
    if cut >= 0:
        prompt = None
    elif key >= 0:
        cut = line.find(_BODIES, prompt[1] if prompt is not None else key)
    if cut >= 0:
        chunks = _chunks_span(line, key)
        head = _parse_head(line, cut, [s for s in (chunks, prompt) if s is not None])
        if prompt is not None and isinstance(head, dict) and head.get("api") != "chat" and not head.get("translated"):
            prompt, head = None, _parse_head(line, cut, [chunks] if chunks else [])  # a native answer: read whole
        if isinstance(head, dict) and "response_body" in head:
            ids = TokenText.lifted(bytes(memoryview(line)[prompt[0] : prompt[1] - 1])) if prompt else None
            line[cut + 1] = 0x7B  # ', "request": ...' -> ',{"request": ...': the bodies as one JSON object
            return CaptureRecord(head, memoryview(line)[cut + 1 :], ids)
    try:
        record = loads_like_upstream(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


_TAIL_CHUNKS = b'{"chunks": '  # a v2 record's tail starts with the chunk timings (addon/record_v2.py TAIL_KEYS)
_TAIL_RAW = b', "request_raw": '
_LIFTED_TEXT = '"prompt_token_ids":'


def read_v2(parts: record_v2.Parts) -> CaptureRecord | None:
    """The record a v2 record stands for, read from its parts as ``parse_record`` reads the v1 line (the same
    record: its prompt ids lifted out, its chunk timings null, its bodies parsed when first read), without building
    that line: a delta record's prompt ids are its base's first ``prompt_keep`` bytes and its own, and a streamed
    answer stored column-wise stays so (the chat reader takes its ids and log-probs from the columns). None where
    the v1 line is needed to read it the same way (unusual layouts); the caller then builds it."""
    tail = parts.tail
    holes: list[tuple[int, int]] = []
    if tail.startswith(_TAIL_CHUNKS) and (stop := tail.find(_TAIL_RAW)) >= 0:
        holes.append((len(_TAIL_CHUNKS), stop))
    key = tail.find(_RESPONSE_KEY)
    chat = parts.head.get("api") == "chat" or bool(parts.head.get("translated"))
    prompt: TokenText | None = None
    lifted = -1  # how many characters the lifted array had in the response text
    at = tail.find(_PROMPT_IN_BODY, key) if key >= 0 and chat else -1
    if at >= 0 and tail[at - 1] != 0x5C:
        start = at + len(_PROMPT_IN_BODY)
        while tail[start : start + 1] == b" ":
            start += 1
        stop = tail.find(b"]", start) if tail[start : start + 1] == b"[" else -1
        if stop >= 0 and tail.find(b"\\", start, stop) < 0 and tail.find(b'"', start, stop) < 0:
            if parts.prompt_keep:
                array = parts.prompt_array  # the base's kept ids and this record's
                if start + 1 != parts.prompt_at or b"\\" in array or b'"' in array:
                    return None
            else:
                array = tail[start:stop]
            prompt, lifted = TokenText.lifted(array), len(array) + 1
            holes.append((start, stop + 1))
    if parts.prompt_keep and prompt is None:
        return None  # the ids it keeps are only in the line
    pieces: list[bytes] = []
    done = 0
    for start, stop in holes:
        pieces += (tail[done:start], b"null")
        done = stop
    pieces.append(tail[done:])
    try:
        members = loads(b"".join(pieces))
    except ValueError:
        return None
    if not isinstance(members, dict) or "response_body" not in members:
        return None
    stream = None
    if parts.stream is not None:
        raw = members["response_body"]
        if not isinstance(raw, str):
            return None
        found = parts.stream
        if prompt is not None:  # the raw text's array became null: its gap is that much shorter
            if not parts.prompt_array.isascii():
                return None
            hole = raw.find("null", raw.find(_LIFTED_TEXT) + len(_LIFTED_TEXT))
            try:
                found = found.resized(hole, 4 - lifted)
            except ValueError:
                return None
        stream = (found, raw)
        members["response_body"] = None  # built from the stream when first read
    head = {"v": 1, **parts.head, **members}
    return CaptureRecord(head, (parts.request, parts.upstream_request), prompt, stream)


def parse_v2(line: bytearray) -> dict[str, Any] | None:
    """A v2 record line as it is (``Expander.expand`` makes it the v1 record it stands for); None when it does not
    parse or fails its checksum."""
    if not _checksum_holds(line):
        return None
    try:
        record = loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _checksum_holds(line: bytearray) -> bool:
    """Whether the line's ``crc`` member (addon/record.py, its last) matches the bytes before it; the member is then
    cut off. A line without one (written before issue 27) holds. A line spliced from two torn records, which may
    still parse, ends with the second one's checksum: it does not hold."""
    tail = len(line) - _CRC_TAIL
    if tail < 0 or line[tail : tail + len(_CRC_KEY)] != _CRC_KEY or line[-2:] != b'"}':
        return True
    try:
        expected = int(line[-10:-2], 16)
    except ValueError:
        return False
    if zlib.crc32(memoryview(line)[:tail]) != expected:
        return False
    del line[tail + 1 :]
    line[tail] = 0x7D  # '}'
    return True


def _prompt_span(line: bytearray, key: int) -> tuple[int, int] | None:
    """Where the first ``"prompt_token_ids":[...]`` of the response body lies in ``line`` (``line[start:stop]``
    is the array), when the array is plain digits, commas and spaces in the line's bytes: it then reads the same
    whether the JSON string holding it is decoded or not. Found and checked with ``find``: memchr speed."""
    at = line.find(_PROMPT_IN_BODY, key)
    if at < 0 or line[at - 1] == 0x5C:  # preceded by a backslash: a key inside a string, not the body's own
        return None
    start = at + len(_PROMPT_IN_BODY)
    while line[start : start + 1] == b" ":
        start += 1
    if line[start : start + 1] != b"[":
        return None
    stop = line.find(b"]", start)
    if stop < 0 or line.find(b"\\", start, stop) >= 0 or line.find(b'"', start, stop) >= 0:
        return None  # escaped characters, strings or a record glued in: leave it to the parser
    return start, stop + 1


def _chunks_span(line: bytearray, key: int) -> tuple[int, int] | None:
    """Where the writer's ``chunks`` array lies: the last ``"chunks"`` key before the response body (headers
    come earlier), up to the ``request_raw`` key the writer puts next (the array holds only numbers)."""
    at = line.rfind(_CHUNKS, 0, key)
    stop = line.find(_REQUEST_RAW, at) if at >= 0 else -1
    return (at + len(_CHUNKS), stop) if stop >= 0 else None


def _parse_head(line: bytearray, cut: int, holes: list[tuple[int, int]]) -> Any:
    """The record before its request bodies, with ``null`` for each of ``holes`` (spans of ``line``, in
    order); None when that does not parse."""
    view = memoryview(line)
    pieces: list[Any] = []
    at = 0
    for start, stop in holes:
        pieces += (view[at:start], b"null")
        at = stop
    pieces += (view[at:cut], b"}")
    try:
        return loads(b"".join(pieces))
    except ValueError:
        return None  # not the writer's layout after all (or damaged): the whole line decides


def lifted_prompt(record: dict[str, Any]) -> TokenText | None:
    """The prompt id array ``parse_record`` lifted out of the record's response body, if it did."""
    return record.prompt if isinstance(record, CaptureRecord) else None


def stored_stream(record: dict[str, Any]) -> tuple[record_v2.Stream, str] | None:
    """A v2 record's streamed answer as stored column-wise, and the rest of its text (``read_v2``), if it is so."""
    return record.stream if isinstance(record, CaptureRecord) and record._text else None


def has_upstream_request(record: dict[str, Any]) -> bool:
    if isinstance(record, CaptureRecord):
        return record.sent_upstream_request()
    return record.get("upstream_request") is not None


def read_session_tasks(path: Path) -> dict[str, tuple[str | None, int | None]]:
    """session_id -> (task_id, sample_id) from a sessions table (``python -m eval`` writes one per run:
    ``session_id``, ``task_id``, ``sample_id`` and more columns, which are ignored)."""
    try:
        columns = pl.read_parquet_schema(path)
    except (OSError, pl.exceptions.ComputeError) as e:
        raise ConfigError(f"{path}: not a readable Parquet sessions table: {e}") from e
    if "session_id" not in columns or "task_id" not in columns:
        raise ConfigError(f"{path}: a sessions table needs session_id and task_id columns, it has {list(columns)}")
    wanted: list[str] = [c for c in ("session_id", "task_id", "sample_id") if c in columns]
    df = pl.read_parquet(path, columns=wanted)
    if df["session_id"].is_duplicated().any():
        raise ConfigError(f"{path}: a session_id appears more than once")
    samples = df["sample_id"].cast(pl.Int32).to_list() if "sample_id" in df.columns else [None] * df.height
    tasks = df["task_id"].cast(pl.String).to_list()
    return {str(s): (t, n) for s, t, n in zip(df["session_id"].cast(pl.String).to_list(), tasks, samples, strict=True)}


def read_session_ids(path: Path) -> frozenset[str]:
    """The ``session_id`` column of a Parquet table (``lost.parquet`` of a Ray round, eval/sessions/ray_rollout.py)."""
    try:
        columns = pl.read_parquet_schema(path)
    except (OSError, pl.exceptions.ComputeError) as e:
        raise ConfigError(f"{path}: not a readable Parquet table: {e}") from e
    if "session_id" not in columns:
        raise ConfigError(f"{path}: needs a session_id column, it has {list(columns)}")
    return frozenset(pl.read_parquet(path, columns=["session_id"])["session_id"].drop_nulls().cast(pl.String))


def json_text(value: Any) -> str:
    return dumps(value) + "\n"
