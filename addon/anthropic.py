"""anthropic wire API ⇄ Chat Completions (being written; see addon/native.py for the contract)."""

from __future__ import annotations

from typing import Any

from addon import native


def start(body: dict[str, Any], path: str, headers: dict[str, str], options: native.Options) -> native.Translation:
    raise native.BadRequest("anthropic translation is not available yet")


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "code": status}}
