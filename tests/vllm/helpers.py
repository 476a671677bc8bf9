"""What the tier's tests share: clients through the proxy, the records, and reconstruction of one session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import polars as pl

from eval.upstream.vllm import SERVED_NAME
from reconstruct import Stats, reconstruct
from tests.captures import read_records, session_lines, tokens_of

__all__ = ["SERVED_NAME", "TOOLS", "openai_client", "read_records", "rebuild", "tokens_of"]

# One function tool, keys in the order the Anthropic translator used to send them (parameters before description).
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
            "description": "Run a shell command.",
        },
    }
]


def openai_client(proxy: Any, session: str) -> openai.OpenAI:
    """The API key is the session id; vLLM on two busy cores answers in seconds, the deadline is minutes."""
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=session, max_retries=0, timeout=600)


def rebuild(captures: Path, session: str, tmp: Path, *, calls: int, **options: Any) -> tuple[pl.DataFrame, Stats]:
    """The trajectories and stats of one session's ``calls`` records (tests share a capture folder, one session
    each). It waits for all of them: the addon writes a record just after its client has the answer."""
    records = read_records(captures, session=session, expect=calls)
    assert len(records) == calls, f"session {session}: {len(records)} records, expected {calls}"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / f"{session}.jsonl").write_bytes(b"".join(line + b"\n" for line in session_lines(captures, session)))
    return reconstruct([tmp / f"{session}.jsonl"], **options)
