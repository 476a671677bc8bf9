"""The trajectory Parquet table: the one source of truth for its columns, written and read here only.

A row is one *trace*: a token sequence ``prompt_ids ‖ response_ids`` rebuilt from one or more
captured model calls of a session. ``response_ids`` interleaves the tokens the model sampled
(``loss_mask`` 1, with the log-prob they were sampled with) and the tokens it did not (tool
results, template glue between turns: ``loss_mask`` 0). The trainer reads only
``session_id, task_id, prompt_ids, response_ids, loss_mask, logprobs, reward``.

Format version 1, stored in the Parquet key-value metadata under ``polar.trajectory.version``.
Writes are atomic and deterministic (same rows, same bytes): reconstruct/files.py.

Written by ``python -m reconstruct`` (reconstruct/_merge.py has the algorithm). Notes on some columns:

- ``messages`` is compact JSON ``{"messages": [...], "tools": [...] | null}`` in Chat Completions form: the
  request messages of the trace's last call (as sent upstream) followed by the assistant message it got back
  (``content``, ``reasoning``, ``tool_calls``), and that request's tools: enough to render the trace for SFT.
- ``drift_turns`` is empty under ``--on-drift split`` (the default): a re-rendered turn starts a new trace there.
- ``token_source`` is the same for every call of a trace: captured and retokenized calls never merge.
- Next to the file, ``<stem>.stats.json`` (reconstruct/_stats.py) keeps what the table cannot show: calls that
  had no usable tokens and why, every chain break by cause, corrupt and torn capture lines, records skipped as
  duplicates of an earlier one (same record id), lines split because two records were glued into one, and
  records whose request bodies did not parse (issue 16), and v2 records whose base record was torn or lost
  (``unresolved_records``, issue 27; added counters, the table itself is unchanged).
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from reconstruct import files

FORMAT_VERSION = 1
VERSION_KEY = "polar.trajectory.version"

SCHEMA = pl.Schema(
    {
        # Identity
        "trace_id": pl.String(),  # "<session_id>/<chain_index>": unique in a file
        "session_id": pl.String(),  # from the capture record
        "task_id": pl.String(),  # null unless a sessions table maps the session to a task
        "sample_id": pl.Int32(),  # which attempt at the task; null without a sessions table
        "chain_index": pl.Int32(),  # 0, 1, ... per session, in order of the chain's first call
        # Tokens: all three lists below have one entry per response token
        "prompt_ids": pl.List(pl.Int32),  # the first call's prompt, never trained on
        "response_ids": pl.List(pl.Int32),  # a1 ‖ u1 ‖ a2 ‖ ... ‖ aK (sampled a, interstitial u)
        "loss_mask": pl.List(pl.Int8),  # 1 on sampled tokens, 0 on interstitial ones
        "logprobs": pl.List(pl.Float32),  # sampling log-prob on mask-1 tokens, 0.0 on mask-0 ones;
        #   null when any sampled token has none (retokenized traces: the trainer recomputes them)
        "token_source": pl.String(),  # "captured" (ids from the upstream) | "retokenized"
        # Provenance
        "n_calls": pl.Int32(),  # model calls merged into this trace
        "exchange_ids": pl.List(pl.String),  # their capture record ids, in order
        "finish_reason": pl.String(),  # of the last call: stop | length | tool_calls | ...; null if unknown
        "drift_turns": pl.List(pl.Int32),  # call positions in this trace whose next prompt re-rendered
        #   the sampled turn differently (merged anyway under --on-drift keep)
        "model": pl.String(),  # model name the client asked for
        "api": pl.String(),  # wire API of the calls: chat | anthropic | responses | google
        "messages": pl.String(),  # the conversation as JSON text (last call's request + its answer)
        # Filled by evaluation
        "reward": pl.Float64(),  # null until rewards are joined
    }
)

TRAINER_COLUMNS = ("session_id", "task_id", "prompt_ids", "response_ids", "loss_mask", "logprobs", "reward")


class SchemaError(ValueError):
    """A table or file that does not match SCHEMA; the message names the file and the column."""


def conform(df: pl.DataFrame, *, source: str = "table") -> pl.DataFrame:
    """``df`` with exactly SCHEMA's columns, in order and cast to its types; refuses missing or extra ones."""
    return files.conform_table(df, SCHEMA, source=source, kind="trajectory", error=SchemaError)


def write(df: pl.DataFrame, path: Path) -> Path:
    """Write ``df`` to ``path`` atomically: readers never see a half-written file."""
    return files.write_versioned_parquet(conform(df, source=str(path)), Path(path), VERSION_KEY, FORMAT_VERSION)


def read(path: Path, columns: list[str] | tuple[str, ...] | None = None) -> pl.DataFrame:
    """Read a trajectory file, checking its version and (only) the requested columns."""
    wanted = list(columns) if columns is not None else list(SCHEMA)
    df = files.read_versioned_parquet(
        path, VERSION_KEY, FORMAT_VERSION, kind="trajectory", error=SchemaError, columns=wanted
    )
    for name in wanted:
        if name not in SCHEMA:
            raise SchemaError(f"{path}: {name!r} is not a trajectory column")
        if df.schema[name] != SCHEMA[name]:
            raise SchemaError(f"{path}: column {name!r} is {df.schema[name]}, expected {SCHEMA[name]}")
    return df
