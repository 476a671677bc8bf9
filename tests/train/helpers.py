"""Synthetic trajectory files for the trainer's tests, written through reconstruct.schema like the real ones."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import polars as pl

from reconstruct import schema


def trace(
    *,
    session: str = "s0",
    task: str | None = "t0",
    prompt: Sequence[int] = (1, 2, 3),
    response: Sequence[int] = (4, 5, 6),
    mask: Sequence[int] | None = None,
    logprobs: Sequence[float] | None = None,
    reward: float | None = 1.0,
    chain: int = 0,
) -> dict:
    """One row of the trajectory table; ``mask`` defaults to all 1, ``logprobs`` to None (not captured)."""
    return {
        "trace_id": f"{session}/{chain}",
        "session_id": session,
        "task_id": task,
        "sample_id": 0,
        "chain_index": chain,
        "prompt_ids": list(prompt),
        "response_ids": list(response),
        "loss_mask": list(mask) if mask is not None else [1] * len(response),
        "logprobs": list(logprobs) if logprobs is not None else None,
        "token_source": "captured" if logprobs is not None else "retokenized",
        "n_calls": 1,
        "exchange_ids": ["x"],
        "finish_reason": "stop",
        "drift_turns": [],
        "model": "tiny",
        "api": "chat",
        "messages": "[]",
        "reward": reward,
    }


def write(path: Path, rows: list[dict]) -> Path:
    return schema.write(pl.DataFrame(rows, schema=schema.SCHEMA), path)


def groups(
    rewards: dict[str, Sequence[float]], *, prompt_len: int = 6, response_len: int = 5, traces: int = 1
) -> list[dict]:
    """Sessions ``<task>-<i>`` with the given rewards per task, ``traces`` traces each, deterministic token ids."""
    rows = []
    for t, (task, rs) in enumerate(rewards.items()):
        for i, r in enumerate(rs):
            for c in range(traces):
                base = 10 + 97 * t + 13 * i + 5 * c
                rows.append(
                    trace(
                        session=f"{task}-{i}",
                        task=task,
                        prompt=[(base + k) % 4000 for k in range(prompt_len)],
                        response=[(base * 7 + k) % 4000 for k in range(response_len)],
                        mask=[1 if k % 4 != 2 else 0 for k in range(response_len)],
                        logprobs=[-1.0 - 0.1 * k if k % 4 != 2 else 0.0 for k in range(response_len)]
                        if (i + c) % 3
                        else None,
                        reward=r,
                        chain=c,
                    )
                )
    return rows
