"""Capture files → trajectory table: index the files, then per session extract calls, merge them, emit rows.

    df, stats = reconstruct([Path("captures")], tokenizer=tok)        # a polars DataFrame in reconstruct.schema
    write_trajectories(df, stats, Path("trajectories.parquet"))        # + trajectories.stats.json

Sessions are processed in sorted order and traces numbered in the order of their first call, so the same
captures give the same table (and file) byte for byte.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import multiprocessing
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import polars as pl

from reconstruct import files, schema
from reconstruct._calls import Call
from reconstruct._errors import ConfigError
from reconstruct._extract import check_prompt_count, extract
from reconstruct._io import CaptureIndex, discover, json_text
from reconstruct._json import dumps
from reconstruct._merge import Trace, merge, vote_eot
from reconstruct._retokenize import Retokenizer
from reconstruct._stats import Stats

__all__ = ["parse_shard", "reconstruct", "stats_path", "write_trajectories"]


def parse_shard(spec: str) -> tuple[int, int]:
    """``--shard I/N``: this process takes the sessions whose stable hash is I modulo N."""
    i, slash, n = spec.partition("/")
    if not (slash and i.isdigit() and n.isdigit() and 0 <= int(i) < int(n)):
        raise ConfigError(f"--shard must be I/N with 0 <= I < N, not {spec!r}")
    return int(i), int(n)


def in_shard(session: str, shard: tuple[int, int] | None) -> bool:
    return shard is None or zlib.crc32(session.encode("utf-8")) % shard[1] == shard[0]


def reconstruct(
    paths: list[Path],
    *,
    tokenizer: Any | None = None,
    sessions: dict[str, tuple[str | None, int | None]] | None = None,
    mode: str = "prefix",
    on_drift: str = "split",
    eot_id: int | None = None,
    shard: tuple[int, int] | None = None,
    skip: frozenset[str] = frozenset(),
    jobs: int = 1,
    progress: Callable[[list[str]], Iterable[Any]] | None = None,
) -> tuple[pl.DataFrame, Stats]:
    """The trajectory table of the captures under ``paths``, and what happened on the way.

    ``tokenizer`` rebuilds ids for calls recorded without them and gives the end-of-turn token (``eot_id``
    overrides it); ``sessions`` maps session ids to (task_id, sample_id); ``skip``: session ids left out (a Ray
    round's lost attempts, eval/sessions/ray_rollout.py); ``jobs`` > 1 builds batches of sessions
    in that many worker processes (the same table, byte for byte); ``progress`` wraps the session list (tqdm, for
    instance)."""
    if jobs < 1:
        raise ConfigError(f"jobs must be >= 1, not {jobs}")
    retokenizer = Retokenizer(tokenizer, eot_id) if tokenizer is not None else None
    eot = eot_id if eot_id is not None else (retokenizer.eot_id if retokenizer else None)
    stats = Stats(mode=mode, on_drift=on_drift, eot_id=eot, shard=f"{shard[0]}/{shard[1]}" if shard else None)
    files = discover(paths)
    stats.files = len(files)
    options = _Options(retokenizer, mode, on_drift, eot)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_rare_collections())
        pool = None
        if jobs > 1:
            # spawn, not fork: polars' thread pool does not survive a fork. Started before the index pass, so the
            # workers import while this process reads the files.
            pool = stack.enter_context(ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")))
            for _ in range(jobs):
                pool.submit(_ready)
        index = stack.enter_context(CaptureIndex(files))
        names = sorted(s for s in index.sessions if in_shard(s, shard) and s not in skip)
        ticks = iter(progress(names)) if progress else iter(names)
        if pool is None or len(names) < 2:
            frames, part = _build(index, names, sessions or {}, options, ticks)
            stats.add(part)
        else:
            frames = []
            # Contiguous batches, results taken in submission order: the table is the one a single process builds.
            size = max(1, len(names) // (jobs * 8))
            batches = [names[i : i + size] for i in range(0, len(names), size)]
            work = [
                (
                    files,
                    {s: index.sessions[s] for s in b},
                    {s: (sessions or {}).get(s, (None, None)) for s in b},
                    options,
                )
                for b in batches
            ]
            for batch, (batch_frames, part) in zip(batches, pool.map(_build_batch, work), strict=True):
                frames += batch_frames
                stats.add(part)
                for _ in batch:
                    next(ticks, None)
        collections.deque(ticks, maxlen=0)  # finish the progress bar
        stats.lines = index.counts.lines
        stats.corrupt_lines += index.counts.corrupt  # found indexing here, and (single process) reading back
        stats.torn_lines = index.counts.torn
        stats.unsupported_records = index.counts.unsupported
        stats.duplicate_records = index.counts.duplicates
        stats.glued_lines = index.counts.glued
        stats.unresolved_records += index.counts.unresolved  # single process: found reading back here
    if not frames:
        frames = [_frame({name: [] for name in schema.SCHEMA})]
    # Not rechunked: a copy of the whole table would double the peak for nothing (the writer takes chunks).
    return schema.conform(pl.concat(frames, rechunk=False)), stats


@contextlib.contextmanager
def _rare_collections() -> Iterator[None]:
    """Run the cyclic garbage collector rarely while building: decoding a session makes containers by the
    hundred thousand (parsed answers, stream chunks), and at Python's default threshold (700 allocations) the
    collector keeps walking the session's live ones for nothing: they form no cycles worth collecting early.
    The threshold is restored afterwards."""
    threshold = gc.get_threshold()
    gc.set_threshold(100_000, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)


@dataclasses.dataclass(frozen=True)
class _Options:
    retokenizer: Retokenizer | None
    mode: str
    on_drift: str
    eot: int | None


def _ready() -> None:
    """Nothing: a worker that runs it has imported this module, which is the point (see ``reconstruct``)."""


def _build_batch(
    work: tuple[list[Path], dict[str, list[tuple[int, int, int]]], dict[str, tuple[str | None, int | None]], _Options],
) -> tuple[list[pl.DataFrame], Stats]:
    """A worker process's share: the given sessions' traces (their record lines already located)."""
    files, located, sessions, options = work
    with _rare_collections(), CaptureIndex.located(files, located) as index:
        frames, stats = _build(index, sorted(located), sessions, options, iter(()))
    stats.corrupt_lines = index.counts.corrupt  # lines that failed to parse in full here
    stats.unresolved_records = index.counts.unresolved
    return frames, stats


def _build(
    index: CaptureIndex,
    names: list[str],
    sessions: dict[str, tuple[str | None, int | None]],
    options: _Options,
    ticks: Iterator[Any],
) -> tuple[list[pl.DataFrame], Stats]:
    """Traces of ``names``, session by session, as DataFrames of a few sessions each, and their stats."""
    stats = Stats()
    rows: dict[str, list[Any]] = {name: [] for name in schema.SCHEMA}
    frames: list[pl.DataFrame] = []  # rows move into Arrow memory every few sessions: 9 bytes a token, not ~70
    mode, on_drift, eot = options.mode, options.on_drift, options.eot
    for session in names:
        next(ticks, None)
        calls, records = [], []
        for record in index.records(session):
            records.append(record)
            found = extract(record, options.retokenizer)
            if found is None:
                stats.other_records += 1
            else:
                calls += found
        if not calls:
            continue
        stats.sessions += 1
        cut_at = eot if eot is not None else vote_eot(calls) if on_drift == "keep" and mode == "prefix" else None
        traces = merge(calls, mode=mode, on_drift=on_drift, eot_id=cut_at)
        for trace in traces:
            for call in trace.calls:
                check_prompt_count(call)
        _count_calls(calls, stats)
        task, sample = sessions.get(session, (None, None))
        for k, trace in enumerate(traces):
            _add_row(rows, session, k, task, sample, trace)
            _count_trace(trace, stats)
        # Request bodies are parsed when first needed, so only now is it known which ones were and did not parse.
        stats.unreadable_bodies += sum(getattr(r, "unreadable_bodies", False) for r in records)
        if len(rows["trace_id"]) >= FRAME_ROWS:
            frames.append(_frame(rows))
    if rows["trace_id"]:
        frames.append(_frame(rows))
    return frames, stats


FRAME_ROWS = 64


def _frame(rows: dict[str, list[Any]]) -> pl.DataFrame:
    """The rows so far as a DataFrame; ``rows`` is emptied."""
    df = pl.DataFrame({name: pl.Series(name, values, dtype=schema.SCHEMA[name]) for name, values in rows.items()})
    for values in rows.values():
        values.clear()
    return df


def _count_calls(calls: list[Call], stats: Stats) -> None:
    stats.calls += len(calls)
    dropped = collections.Counter(c.problem for c in calls if c.problem is not None)
    for problem, n in dropped.items():
        stats.dropped[problem] = stats.dropped.get(problem, 0) + n
    for c in calls:
        stats.retokenized_calls += c.source == "retokenized" and c.usable
        for note in c.notes:
            stats.notes[note] = stats.notes.get(note, 0) + 1


def _count_trace(trace: Trace, stats: Stats) -> None:
    stats.traces += 1
    stats.merged_calls += len(trace.calls)
    stats.max_calls_per_trace = max(stats.max_calls_per_trace, len(trace.calls))
    if trace.cause is not None:
        stats.breaks[trace.cause] = stats.breaks.get(trace.cause, 0) + 1
    stats.drift_turns += len(trace.drift_turns)
    stats.tokens_prompt += len(trace.prompt_ids)
    trainable = sum(trace.loss_mask)
    stats.tokens_trainable += trainable
    stats.tokens_masked += len(trace.loss_mask) - trainable


def _add_row(
    rows: dict[str, list[Any]], session: str, k: int, task: str | None, sample: int | None, trace: Trace
) -> None:
    last = trace.calls[-1]
    conversation = {"messages": [*(last.messages or []), last.answer], "tools": last.tools}
    values = {
        "trace_id": f"{session}/{k}",
        "session_id": session,
        "task_id": task,
        "sample_id": sample,
        "chain_index": k,
        "prompt_ids": trace.prompt_ids,
        "response_ids": trace.response_ids,
        "loss_mask": trace.loss_mask,
        "logprobs": trace.logprobs,
        "token_source": last.source,
        "n_calls": len(trace.calls),
        "exchange_ids": [c.exchange_id for c in trace.calls],
        "finish_reason": last.finish_reason,
        "drift_turns": trace.drift_turns,
        "model": last.model,
        "api": last.api,
        "messages": dumps(conversation),
        "reward": None,
    }
    for name, value in values.items():
        rows[name].append(value)


def stats_path(trajectories: Path) -> Path:
    return trajectories.with_name(trajectories.stem + ".stats.json")


def write_trajectories(df: pl.DataFrame, stats: Stats, path: Path) -> Path:
    """The table (atomically, via reconstruct.schema) and its stats file next to it."""
    schema.write(df, path)
    files.write_atomic(stats_path(path), json_text(stats.to_dict()).encode())
    return path
