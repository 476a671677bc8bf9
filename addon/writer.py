"""Append-only capture files, written by a background thread so the proxy's event loop never waits on disk.

A record is handed over with :meth:`CaptureWriter.submit` and reaches the OS (one ``write`` per
batch, no user-space buffer) as soon as the thread wakes, typically well under a millisecond later,
so a ``kill -9`` of mitmdump loses nothing that ended before it. With ``fsync`` each batch is also
forced to the disk. When a write fails the batch is kept and retried every second, and
:attr:`CaptureWriter.failure` says why, so the addon can refuse new calls until recording works.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

from addon.record import Exchange, encode

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0
_STOP = object()


class CaptureWriter:
    def __init__(
        self,
        directory: Path,
        *,
        rotate_bytes: int,
        fsync: bool,
        decode_content: Callable[[bytes, str], bytes],
    ) -> None:
        self.directory = directory
        self.rotate_bytes = rotate_bytes
        self.fsync = fsync
        self.decode_content = decode_content
        self.failure: str | None = None
        self.path: Path | None = None
        self.records_written = 0
        self._fd: int | None = None
        self._size = 0
        self._stem = time.strftime("capture-%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}"
        self._part = 0
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="polar-writer", daemon=True)
        self._thread.start()

    def submit(self, exchange: Exchange) -> None:
        self._queue.put(exchange)

    def close(self, timeout: float = 30.0) -> None:
        """Write everything submitted so far, then stop."""
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:  # drain what else is waiting: one write for a burst of calls
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = _STOP in batch
            lines = []
            for item in batch:
                if isinstance(item, Exchange):
                    try:
                        lines.append(encode(item, self.decode_content))
                    except Exception:  # a bug here loses this record only
                        log.exception("polar: could not encode record %s; it is lost", item.id)
            group: list[bytes] = []
            size = self._size
            for line in lines:  # one write per burst, but a file ends near its size limit
                group.append(line)
                size += len(line)
                if size >= self.rotate_bytes:
                    self._write_until_done(b"".join(group))
                    group, size = [], 0
            if group:
                self._write_until_done(b"".join(group))
            if stop:
                return

    def _write_until_done(self, data: bytes) -> None:
        if self._fd is not None and self._size >= self.rotate_bytes:
            self._close_fd()
        pending = memoryview(data)
        while pending:
            try:
                if self._fd is None:
                    self._open_next()
                assert self._fd is not None
                while pending:  # a failed write keeps what already reached the file
                    n = os.write(self._fd, pending)
                    pending = pending[n:]
                    self._size += n
                if self.fsync:
                    os.fsync(self._fd)
            except OSError as e:
                if self.failure is None:
                    log.error("polar: capture write failed (%s); refusing model calls until it works", e)
                self.failure = f"{type(e).__name__}: {e}"
                time.sleep(RETRY_SECONDS)
                continue
        if self.failure is not None:
            log.warning("polar: capture writes work again")
            self.failure = None
        self.records_written += data.count(b"\n")

    def _open_next(self) -> None:
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
            return

    def _close_fd(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
