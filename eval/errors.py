"""The eval commands' own error: what ``python -m eval`` prints as one line. Anything else is a bug and keeps its
traceback."""

from __future__ import annotations

__all__ = ["EvalError"]


class EvalError(ValueError):
    """Bad input to an eval command (an option, a task file, a run folder); the message names it. A ValueError, so
    callers that validate input keep catching it as one."""
