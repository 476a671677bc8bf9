"""Capture files → trajectory table: index the files, then per session extract calls, merge them, emit rows.

    df, stats = reconstruct([Path("captures")], tokenizer=tok)        # a polars DataFrame in reconstruct.schema
    write_trajectories(df, stats, Path("trajectories.parquet"))        # + trajectories.stats.json

Sessions are processed in sorted order and traces numbered in the order of their first call, so the same
captures give the same table (and file) byte for byte.
"""

from __future__ import annotations

import collections
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl

from reconstruct import schema
from reconstruct._calls import Call
from reconstruct._errors import ConfigError
from reconstruct._extract import extract
from reconstruct._io import CaptureIndex, discover, json_text, write_text_atomic
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
    progress: Callable[[list[str]], Any] | None = None,
) -> tuple[pl.DataFrame, Stats]:
    """The trajectory table of the captures under ``paths``, and what happened on the way.

    ``tokenizer`` rebuilds ids for calls recorded without them and gives the end-of-turn token (``eot_id``
    overrides it); ``sessions`` maps session ids to (task_id, sample_id); ``progress`` wraps the session list
    (tqdm, for instance)."""
    retokenizer = Retokenizer(tokenizer, eot_id) if tokenizer is not None else None
    eot = eot_id if eot_id is not None else (retokenizer.eot_id if retokenizer else None)
    stats = Stats(mode=mode, on_drift=on_drift, eot_id=eot, shard=f"{shard[0]}/{shard[1]}" if shard else None)
    files = discover(paths)
    stats.files = len(files)
    rows: dict[str, list[Any]] = {name: [] for name in schema.SCHEMA}
    frames: list[pl.DataFrame] = []  # rows move into Arrow memory every few sessions: 9 bytes a token, not ~70
    with CaptureIndex(files) as index:
        names = sorted(s for s in index.sessions if in_shard(s, shard))
        for session in progress(names) if progress else names:
            calls = []
            for record in index.records(session):
                found = extract(record, retokenizer)
                if found is None:
                    stats.other_records += 1
                else:
                    calls += found
            if not calls:
                continue
            stats.sessions += 1
            _count_calls(calls, stats)
            cut_at = eot if eot is not None else vote_eot(calls) if on_drift == "keep" and mode == "prefix" else None
            traces = merge(calls, mode=mode, on_drift=on_drift, eot_id=cut_at)
            task, sample = (sessions or {}).get(session, (None, None))
            for k, trace in enumerate(traces):
                _add_row(rows, session, k, task, sample, trace)
                _count_trace(trace, stats)
            if len(rows["trace_id"]) >= FRAME_ROWS:
                frames.append(_frame(rows))
        stats.lines = index.counts.lines
        stats.corrupt_lines = index.counts.corrupt
        stats.torn_lines = index.counts.torn
        stats.unsupported_records = index.counts.unsupported
    frames.append(_frame(rows))
    # Not rechunked: a copy of the whole table would double the peak for nothing (the writer takes chunks).
    return schema.conform(pl.concat(frames, rechunk=False)), stats


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
    write_text_atomic(stats_path(path), json_text(stats.to_dict()))
    return path
