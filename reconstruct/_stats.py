"""What a reconstruction did: sessions, calls, traces, tokens, and every chain break and dropped call by cause.

Kept next to the trajectories as ``<name>.stats.json`` (sorted keys, no timings: the same input gives the same
bytes), printed at the end of a run and by ``python -m reconstruct stats FILE``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import polars as pl
from rich.table import Table

from reconstruct._merge import CAUSES

__all__ = ["Stats", "file_stats"]


@dataclasses.dataclass
class Stats:
    # Input
    files: int = 0
    lines: int = 0
    corrupt_lines: int = 0  # did not parse as a record or failed its checksum: counted, skipped
    torn_lines: int = 0  # unterminated last line of a file
    unsupported_records: int = 0  # another capture format version
    duplicate_records: int = 0  # a record id seen before (a copied capture file): skipped, never trained twice
    glued_lines: int = 0  # lines holding more than one record (a torn line with the next appended): split apart
    unresolved_records: int = 0  # v2 records whose base record was torn or lost: calls lost, never misbuilt
    unreadable_bodies: int = 0  # records whose request bodies did not parse: answer kept, messages/tools/model lost
    other_records: int = 0  # not model calls (/v1/models, count_tokens, unknown paths)
    # Calls
    sessions: int = 0
    calls: int = 0  # model calls found (one per choice)
    merged_calls: int = 0  # of them, in a trace
    retokenized_calls: int = 0
    dropped: dict[str, int] = dataclasses.field(default_factory=dict)  # calls with no usable tokens, by problem
    notes: dict[str, int] = dataclasses.field(default_factory=dict)  # anomalies (ids vs usage), by kind
    # Traces
    traces: int = 0
    max_calls_per_trace: int = 0
    breaks: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(CAUSES, 0))
    drift_turns: int = 0  # drifted turns merged under --on-drift keep
    tokens_prompt: int = 0
    tokens_trainable: int = 0  # loss mask 1
    tokens_masked: int = 0  # loss mask 0 in responses
    # Settings that shaped the result
    mode: str = "prefix"
    on_drift: str = "split"
    eot_id: int | None = None  # the end-of-turn token that cuts drift under keep (None: voted per session)
    shard: str | None = None

    @property
    def calls_per_trace(self) -> float:
        return self.merged_calls / self.traces if self.traces else 0.0

    def add(self, part: Stats) -> None:
        """Fold in the per-session counts of a part of the run (a worker's batch of sessions)."""
        for name in ("sessions", "calls", "merged_calls", "retokenized_calls", "other_records", "traces",
                     "drift_turns", "tokens_prompt", "tokens_trainable", "tokens_masked", "corrupt_lines",
                     "unreadable_bodies", "unresolved_records"):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(part, name))
        self.max_calls_per_trace = max(self.max_calls_per_trace, part.max_calls_per_trace)
        for mine, theirs in ((self.dropped, part.dropped), (self.notes, part.notes), (self.breaks, part.breaks)):
            for key, n in theirs.items():
                mine[key] = mine.get(key, 0) + n

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Stats:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def table(self, title: str = "reconstruction") -> Table:
        t = Table(title=title, show_header=False)
        t.add_column("what")
        t.add_column("value", justify="right")
        rows: list[tuple[str, Any]] = [
            ("capture files / lines", f"{self.files:,} / {self.lines:,}"),
            ("corrupt / torn lines (skipped)", f"{self.corrupt_lines:,} / {self.torn_lines:,}"),
            ("records of another version / not model calls", f"{self.unsupported_records:,} / {self.other_records:,}"),
            ("duplicate records (skipped) / glued lines (split)", f"{self.duplicate_records:,} / {self.glued_lines:,}"),
            ("records with unreadable request bodies", f"{self.unreadable_bodies:,}"),
            ("v2 records whose base was lost (skipped)", f"{self.unresolved_records:,}"),
            ("sessions", f"{self.sessions:,}"),
            ("model calls / in traces", f"{self.calls:,} / {self.merged_calls:,}"),
            ("retokenized calls", f"{self.retokenized_calls:,}"),
            ("traces", f"{self.traces:,} ({self.mode}, drift: {self.on_drift})"),
            ("calls per trace: mean / max", f"{self.calls_per_trace:.2f} / {self.max_calls_per_trace:,}"),
            ("prompt tokens", f"{self.tokens_prompt:,}"),
            ("response tokens: trainable / masked", f"{self.tokens_trainable:,} / {self.tokens_masked:,}"),
            ("drifted turns merged (keep)", f"{self.drift_turns:,}"),
        ]
        rows += [(f"break: {cause.replace('_', ' ')}", f"{n:,}") for cause, n in self.breaks.items()]
        rows += [(f"dropped call: {why.replace('_', ' ')}", f"{n:,}") for why, n in sorted(self.dropped.items())]
        rows += [(f"note: {what}", f"{n:,}") for what, n in sorted(self.notes.items())]
        for name, value in rows:
            t.add_row(name, str(value))
        return t


def file_stats(df: pl.DataFrame, saved: Stats | None) -> Stats:
    """Stats of a trajectory table; what only the run knew (breaks, dropped calls, input lines) comes from
    ``saved`` when its stats file is there."""
    stats = dataclasses.replace(saved) if saved is not None else Stats()
    mask_sum = df["loss_mask"].list.sum().cast(pl.Int64)
    stats.sessions = df["session_id"].n_unique()
    stats.traces = df.height
    stats.merged_calls = int(df["n_calls"].sum() or 0)
    stats.max_calls_per_trace = int(df.select(pl.col("n_calls").max()).item() or 0) if df.height else 0
    stats.tokens_prompt = int(df["prompt_ids"].list.len().sum() or 0)
    stats.tokens_trainable = int(mask_sum.sum() or 0)
    stats.tokens_masked = int(df["response_ids"].list.len().sum() or 0) - stats.tokens_trainable
    stats.drift_turns = int(df["drift_turns"].list.len().sum() or 0)
    stats.retokenized_calls = int(df.filter(pl.col("token_source") == "retokenized")["n_calls"].sum() or 0)
    return stats
