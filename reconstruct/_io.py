"""The edges: capture files in (indexed, then read one session at a time), sessions table in, stats file out.

Memory stays bounded by the largest session, not by the files: a first pass indexes where each record line is
and which session it belongs to (reading only the head of each line), a second reads one session's lines back
with ``pread`` and drops them once its traces are built.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl

from reconstruct._errors import CaptureError, ConfigError
from reconstruct._json import dumps, loads
from reconstruct._lines import LineIndexer, parse_head

__all__ = ["CaptureIndex", "discover", "read_sessions", "write_text_atomic"]

BLOCK = 8 << 20

FORMAT_VERSION = 1  # of capture records (addon/record.py)


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
    corrupt: int = 0  # lines that do not parse as a record
    torn: int = 0  # unterminated last lines (a writer killed mid-line)
    unsupported: int = 0  # records of another format version


class CaptureIndex:
    """Where each session's record lines are; ``records(session)`` reads and parses them back."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files
        self.counts = IndexCounts()
        self.sessions: dict[str, list[tuple[int, int, int]]] = {}  # session -> [(file, offset, length)]
        self._fds: list[int] = []
        try:
            for number, path in enumerate(files):
                self._fds.append(os.open(path, os.O_RDONLY))
                self._index(number)
        except OSError as e:
            self.close()
            raise CaptureError(f"cannot read capture file: {e}") from e

    def _index(self, number: int) -> None:
        # Read in blocks rather than mapped: a mapping would count the whole file as this process's memory.
        indexer = LineIndexer()
        fd = self._fds[number]
        offset = 0
        while block := os.pread(fd, BLOCK, offset):
            offset += len(block)
            for ref in indexer.decode(block):
                self._add(number, ref.offset, ref.length, ref.head)
        if indexer.flush() is not None:
            self.counts.torn += 1

    def _add(self, number: int, offset: int, length: int, head: bytes) -> None:
        if length == 0:
            return
        self.counts.lines += 1
        found = parse_head(head)
        if found is not None:
            version, session = found.version, found.session_id
        else:  # not the writer's usual layout: parse the whole line for its session
            record = self._parse(os.pread(self._fds[number], length, offset))
            if record is None:
                return
            version, session = record.get("v"), record.get("session_id")
        if version != FORMAT_VERSION or not isinstance(session, str):
            self.counts.unsupported += 1
            return
        self.sessions.setdefault(session, []).append((number, offset, length))

    def _parse(self, line: bytes) -> dict[str, Any] | None:
        try:
            record = loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            self.counts.corrupt += 1
            return None
        return record

    def records(self, session: str) -> Iterator[dict[str, Any]]:
        """The session's records, in file order; a line that does not parse is counted and skipped."""
        for number, offset, length in self.sessions.get(session, []):
            record = self._parse(os.pread(self._fds[number], length, offset))
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


def read_sessions(path: Path) -> dict[str, tuple[str | None, int | None]]:
    """session_id -> (task_id, sample_id) from a sessions table (``python -m eval`` writes one per run:
    ``session_id``, ``task_id``, ``sample_id`` and more columns, which are ignored)."""
    try:
        columns = pl.read_parquet_schema(path)
    except (OSError, pl.exceptions.ComputeError) as e:
        raise ConfigError(f"{path}: not a readable Parquet sessions table: {e}") from e
    if "session_id" not in columns or "task_id" not in columns:
        raise ConfigError(f"{path}: a sessions table needs session_id and task_id columns, it has {list(columns)}")
    df = pl.read_parquet(path, columns=[c for c in ("session_id", "task_id", "sample_id") if c in columns])
    if df["session_id"].is_duplicated().any():
        raise ConfigError(f"{path}: a session_id appears more than once")
    samples = df["sample_id"].cast(pl.Int32).to_list() if "sample_id" in df.columns else [None] * df.height
    tasks = df["task_id"].cast(pl.String).to_list()
    return {str(s): (t, n) for s, t, n in zip(df["session_id"].cast(pl.String).to_list(), tasks, samples)}


def write_text_atomic(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def json_text(value: Any) -> str:
    return dumps(value) + "\n"
