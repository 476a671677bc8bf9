"""Scripted assistant messages for eval.upstream.server --script, handed out in order per session.

The file is a JSON list, or JSONL, of ``{"content": str | null, "reasoning": str | null, "tool_calls": [{"name":
str, "arguments": object}]}``. Each request of a session takes that session's next message; a session past the
end gets the last message again, because harnesses make side calls (titles, summaries) after their final turn
and a final text answer ends them cleanly. End a script with a text message, or a harness loops on a tool call.

Or a JSON object ``{"<glob>": [messages], ...}``: a session follows the first list whose shell-style pattern
matches its id (``*pager-1*``: every session of that task under ``python -m eval rollout``'s ids), so one server
replays a different worked session per task, or per sample (``*-0``). A session no pattern matches is refused.
"""

from __future__ import annotations

import fnmatch
import json
import threading
from pathlib import Path
from typing import Any

__all__ = ["Script"]


class Script:
    """Scripted assistant messages, handed out in order per session."""

    def __init__(self, scripts: dict[str, list[dict[str, Any]]]) -> None:
        self._scripts = scripts  # session-id pattern -> messages; "*" for a plain list
        self._taken: dict[str, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: Path) -> Script:
        text = path.read_text()
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
        scripts = items if isinstance(items, dict) and items else {"*": items}
        for pattern, messages in scripts.items():
            if not (isinstance(messages, list) and messages):
                raise ValueError(
                    f"{path}: expected a non-empty JSON list or JSONL of assistant messages, or an "
                    f"object of such lists by session-id pattern (pattern {pattern!r})"
                )
        return cls(
            {
                pattern: [_scripted_message(path, i, item) for i, item in enumerate(messages)]
                for pattern, messages in scripts.items()
            }
        )

    def take(self, session: str) -> dict[str, Any]:
        """The session's next message; KeyError when no pattern matches the session id."""
        messages = next((m for pattern, m in self._scripts.items() if fnmatch.fnmatchcase(session, pattern)), None)
        if messages is None:
            raise KeyError(f"no script for session {session!r}: patterns {list(self._scripts)}")
        with self._lock:
            i = self._taken.get(session, 0)
            self._taken[session] = i + 1
        return messages[min(i, len(messages) - 1)]


def _scripted_message(path: Path, i: int, item: Any) -> dict[str, Any]:
    calls = (item.get("tool_calls") or []) if isinstance(item, dict) else None
    if not (
        isinstance(item, dict)
        and isinstance(item.get("content"), str | None)
        and isinstance(item.get("reasoning"), str | None)
        and isinstance(calls, list)
        and all(isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c for c in calls)
    ):
        raise ValueError(
            f'{path}: message {i} must be {{"content", "reasoning", "tool_calls": [{{"name", "arguments"}}]}}'
        )
    return {
        "role": "assistant",
        "content": item.get("content"),
        "reasoning": item.get("reasoning"),
        "tool_calls": [
            {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls
        ],
    }
