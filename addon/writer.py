"""Append-only capture files, written by a background thread so the proxy's event loop never waits on disk.

A record is handed over with :meth:`CaptureWriter.submit` and reaches the OS (one ``write`` per
batch, no user-space buffer) as soon as the thread wakes, typically well under a millisecond later,
so a ``kill -9`` of mitmdump loses nothing that ended before it. With ``fsync`` each batch is also
forced to the disk.

After each write the file is checked to still have a name (``st_nlink``): a file removed while open (``rm -rf``
of the capture folder) would swallow every later record unseen, so its last batch is written again to a new file,
and a removed folder is a failure like a full disk until it exists again (issue 27).

When a write fails (disk full, quota, I/O error, a removed folder) the lines that did not fully reach the file are
cut off again (``ftruncate`` back to the last whole line, so no torn line is left), kept, and
retried every :data:`RETRY_SECONDS`; :attr:`CaptureWriter.failure` says why, so the addon refuses
new model calls until recording works. :attr:`CaptureWriter.backlog_bytes` is what waits in memory;
the addon also refuses calls while it is over its bound, and a session's calls while that session's own part of it
(:meth:`CaptureWriter.session_backlog`) is over its share. On :meth:`CaptureWriter.close` the writer
keeps trying for a bounded time, then gives up and logs every record it could not write (id,
session, API, status), also kept in :attr:`CaptureWriter.unwritten`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from addon import record_v2
from addon.record import Exchange, Record, to_record, v1_parts

log = logging.getLogger(__name__)

RETRY_SECONDS = 0.5
IOV_MAX = 512  # buffers per writev call (Linux allows 1024)
CLOSE_SECONDS = 5.0  # how long close() keeps retrying a failing disk before it gives up and says what it lost
_STOP = object()


@dataclass(frozen=True)
class Line:
    """One record, encoded once its file is known (a v2 record refers to records of its file), and what to say about
    it if it never reaches the disk."""

    record: Record
    length: int  # of its v1 line: what a batch counts towards the file's size before it is encoded
    id: str
    session_id: str
    api: str
    status: int | None
    size: int  # what submit() counted into the backlog for it

    def describe(self) -> str:
        return f"record {self.id} (session {self.session_id}, {self.api}, status {self.status}, {self.length} bytes)"


class CaptureWriter:
    def __init__(
        self,
        directory: Path,
        *,
        rotate_bytes: int,
        fsync: bool,
        decode_content: Callable[[bytes, str], bytes],
        format_version: int = record_v2.FORMAT_VERSION,
    ) -> None:
        self.directory = directory
        self.format_version = format_version
        self._encoder = record_v2.Encoder()  # v2: each session's last record in the current file
        self.rotate_bytes = rotate_bytes
        self.fsync = fsync
        self.decode_content = decode_content
        self.failure: str | None = None
        self.path: Path | None = None
        self.records_written = 0
        self.unwritten: list[str] = []  # records given up at close, described
        self._backlog = 0
        self._by_session: dict[str, int] = {}  # the backlog by session id; a session leaves once its part is written
        self._lock = threading.Lock()
        self._give_up_at: float | None = None  # set by close(): past it, each write gets one try
        self._fd: int | None = None
        self._size = 0
        # The pid and the second are not unique across hosts and containers (a container's proxy is often pid 1):
        # a random part is, so that the folders of several nodes can be read, or copied, together.
        start = time.strftime("capture-%Y%m%dT%H%M%SZ", time.gmtime())
        self._stem = f"{start}-{os.getpid()}-{secrets.token_hex(4)}"
        self._part = 0
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="polar-writer", daemon=True)
        self._thread.start()

    @property
    def folder_removed(self) -> bool:
        """The folder held a capture file and is gone (``rm -rf``): nothing can be written until it is back."""
        return self.path is not None and not self.directory.is_dir()

    @property
    def backlog_bytes(self) -> int:
        """Bytes of records submitted and not yet on disk (bodies and chunks, before encoding)."""
        return self._backlog

    def session_backlog(self, session_id: str) -> int:
        """The part of :attr:`backlog_bytes` that is ``session_id``'s records."""
        return self._by_session.get(session_id, 0)

    def submit(self, exchange: Exchange) -> None:
        size = exchange_size(exchange)
        with self._lock:
            self._backlog += size
            self._by_session[exchange.session_id] = self._by_session.get(exchange.session_id, 0) + size
        self._queue.put((exchange, size))

    def close(self, timeout: float | None = None) -> list[str]:
        """Write everything submitted so far, then stop; a failing disk gets ``timeout`` seconds (default
        :data:`CLOSE_SECONDS`). Returns (and logs) the records that could not be written.
        """
        timeout = CLOSE_SECONDS if timeout is None else timeout
        self._give_up_at = time.monotonic() + timeout
        self._queue.put(_STOP)
        # Past the deadline each remaining batch gets one more try; encoding a large backlog takes time too.
        self._thread.join(timeout + 10.0)
        if self._thread.is_alive():
            log.error(
                "polar: the capture writer did not finish within %.0f s; %d bytes of records may be lost",
                timeout + 10,
                self._backlog,
            )
        self._close_fd()
        if self.unwritten:
            log.error("polar: %d records were NOT written to %s:", len(self.unwritten), self.directory)
            for what in self.unwritten:
                log.error("polar: NOT WRITTEN: %s", what)
        return self.unwritten

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:  # drain what else is waiting: one write for a burst of calls
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            lines = [line for item in batch if isinstance(item, tuple) and (line := self._encode(*item))]
            group: list[Line] = []
            size = self._size
            for line in lines:  # one write per burst, but a file ends near its size limit
                group.append(line)
                size += line.length
                if size >= self.rotate_bytes:
                    self._write_until_done(group)
                    group, size = [], 0
            if group:
                self._write_until_done(group)
            if _STOP in batch:
                return

    def _encode(self, exchange: Exchange, size: int) -> Line | None:
        try:
            record = to_record(exchange, self.decode_content)
        except Exception as e:  # a bug here loses this record only, and says so
            log.exception("polar: could not encode record %s; it is lost", exchange.id)
            self._done(exchange.session_id, size)
            self.unwritten.append(f"record {exchange.id} (session {exchange.session_id}): not encodable: {e}")
            return None
        length = len(record.request) + len(record.upstream_request) + len(record.head.get("response_body") or "")
        return Line(record, length, exchange.id, exchange.session_id, exchange.api, exchange.status, size)

    def _encode_lines(self, lines: list[Line]) -> list[tuple[bytes, ...]]:
        """The lines in pieces, in the writer's format; a v2 line refers to the session's last line of this file."""
        if self.format_version == 1:
            return [v1_parts(line.record) for line in lines]
        return [self._encoder.encode(line.record) for line in lines]

    def _done(self, session_id: str, size: int) -> None:
        with self._lock:
            self._backlog -= size
            left = self._by_session.pop(session_id, 0) - size
            if left > 0:
                self._by_session[session_id] = left

    def _write_until_done(self, lines: list[Line]) -> None:
        if self._fd is not None and self._size >= self.rotate_bytes:
            self._close_fd()
        while lines:
            whole = self._write_once(lines)  # lines fully on disk
            for line in lines[:whole]:
                self._done(line.session_id, line.size)
            self.records_written += whole
            lines = lines[whole:]
            if not lines:
                break
            if self._give_up_at is not None and time.monotonic() >= self._give_up_at:
                for line in lines:
                    self._done(line.session_id, line.size)
                    self.unwritten.append(f"{line.describe()}: {self.failure}")
                return
            time.sleep(RETRY_SECONDS)
        if self.failure is not None:
            log.warning("polar: capture writes work again")
            self.failure = None

    def _write_once(self, lines: list[Line]) -> int:
        """Write ``lines`` (one ``writev`` per burst, no joined copy); on failure cut a partial line back off
        the file. Returns how many lines are fully on disk."""
        start, done = self._size, 0
        encoded: list[tuple[bytes, ...]] = []
        before = self._encoder.snapshot()
        try:
            if self._fd is None:
                self._open_next()
                start, before = self._size, self._encoder.snapshot()
            assert self._fd is not None
            encoded = self._encode_lines(lines)
            pending = [memoryview(part) for parts in encoded for part in parts if part]
            while pending:
                n = os.writev(self._fd, pending[:IOV_MAX])
                done += n
                self._size += n
                while pending and n >= len(pending[0]):  # drop what went out, keep the rest of a part cut short
                    n -= len(pending.pop(0))
                if n:
                    pending[0] = pending[0][n:]
            if self.fsync:
                os.fsync(self._fd)
            if os.fstat(self._fd).st_nlink == 0:  # issue 27: written into a file someone removed (rm -rf)
                self._removed()
                return 0
            return len(lines)
        except OSError as e:
            if self.failure is None:
                log.error("polar: capture write failed (%s); refusing model calls until it works", e)
            self.failure = f"{type(e).__name__}: {e}"
        whole, keep = 0, 0
        for parts in encoded:
            length = sum(map(len, parts))
            if keep + length > done:
                break
            whole, keep = whole + 1, keep + length
        self._encoder.restore(before)  # the lines that did not make it are encoded again when retried
        self._encode_lines(lines[:whole])
        if done > keep and self._fd is not None:
            # Keep the whole lines that made it; cut the torn tail so the file never holds half a record.
            try:
                os.ftruncate(self._fd, start + keep)
                self._size = start + keep
            except OSError as e:  # cannot cut: leave the torn tail (readers skip it) and go on in a new file
                log.error("polar: could not cut a partial record off %s (%s); continuing in a new file", self.path, e)
                self._close_fd()
        return whole

    def _removed(self) -> None:
        """The current file was removed while open: what went into it is gone, so the batch is written again, to a
        new file; if the folder went too, that fails (a removed folder is not made again) until someone makes it."""
        log.error(
            "polar: the capture file %s was removed while open; writing its last batch again in a new file", self.path
        )
        self._close_fd()
        if not self.directory.is_dir():
            self.failure = f"the capture folder {self.directory} was removed"

    def _open_next(self) -> None:
        if self.path is None:  # the first file makes the folder; a folder removed later is not made again
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        while True:
            suffix = f".{self._part}" if self._part else ""
            path = self.directory / f"{self._stem}{suffix}.jsonl"
            self._part += 1
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
            except FileExistsError:  # never reopen someone's file
                continue
            self.path, self._size = path, 0
            self._encoder = record_v2.Encoder()  # a file's first record of each session is full
            return

    def _close_fd(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


def exchange_size(ex: Exchange) -> int:
    """What a record holds in memory until it is written: its bodies and response chunks."""
    size = sum(len(c) for c in ex.chunks)
    for body in (ex.request, ex.upstream_request):
        if body is not None and body.json_bytes is not None:
            size += len(body.json_bytes)
        elif body is not None and body.raw is not None:
            size += sum(len(v) for v in body.raw.values())
    return size
