"""What the native-API translators (anthropic.py, responses.py, google.py) share, and the contract they keep.

A harness that speaks Anthropic Messages, OpenAI Responses or Google generateContent is answered
by an upstream that speaks Chat Completions, because only Chat Completions returns token ids and
log-probs on every streamed chunk (vLLM, SGLang). Each translator module exposes::

    start(body: dict, path: str, headers: dict[str, str], options: Options) -> Translation | LocalAnswer

raising :class:`BadRequest` for a body it cannot translate. A :class:`Translation` carries the
Chat Completions body to send upstream (without token fields: the addon adds those as for any chat
call) and turns the upstream's answer back into the harness's format, chunk by chunk as it
streams. Translators are pure: no I/O, no mitmproxy; the addon does the plumbing.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

REASONING_PREFIX = "polar1:"


@dataclass(frozen=True)
class Options:
    model: str  # served model name to ask the upstream for; "" keeps the client's
    upstream: str  # vllm | sglang


class BadRequest(ValueError):
    """A native request the translator cannot map; the client gets a 400 in its API's error shape."""


@dataclass
class LocalAnswer:
    """A reply the addon gives itself, without calling the upstream (e.g. Anthropic count_tokens)."""

    status: int
    body: dict[str, Any]


class Translation(Protocol):
    chat_body: dict[str, Any]  # the Chat Completions request for the upstream
    stream: bool  # the client asked for a streamed answer

    def events(self, chunk: dict[str, Any]) -> bytes:
        """Native SSE bytes for one upstream ``chat.completion.chunk`` (b"" when nothing is due yet)."""

    def finish(self, complete: bool) -> bytes:
        """Closing native events once the upstream stream ended (``complete`` false: it broke)."""

    def answer(self, response: dict[str, Any]) -> dict[str, Any]:
        """The native non-streamed body for an upstream ``chat.completion``."""

    def error(self, status: int, message: str) -> dict[str, Any]:
        """The native error body for an upstream failure (status kept by the addon)."""


class ChatStream:
    """Incremental SSE decoder for an upstream Chat Completions stream: bytes in, chunk dicts out.

    Network chunks split events anywhere (mid-line, mid-UTF-8); ``decode`` buffers until an event
    is complete. ``data: [DONE]`` and comments are skipped; an event that is not JSON raises.
    """

    def __init__(self) -> None:
        self._buffer = b""

    def decode(self, data: bytes) -> Iterator[dict[str, Any]]:
        self._buffer += data
        while True:
            end, sep = _event_end(self._buffer)
            if end < 0:
                return
            event, self._buffer = self._buffer[:end], self._buffer[end + sep :]
            if chunk := _parse_event(event):
                yield chunk

    def flush(self) -> Iterator[dict[str, Any]]:
        event, self._buffer = self._buffer, b""
        if chunk := _parse_event(event):
            yield chunk


def _event_end(buffer: bytes) -> tuple[int, int]:
    """Where the first complete event ends, and the separator's length (-1, 0 when none yet)."""
    ends = [(i, len(sep)) for sep in (b"\n\n", b"\r\n\r\n") if (i := buffer.find(sep)) >= 0]
    return min(ends) if ends else (-1, 0)


def _parse_event(event: bytes) -> dict[str, Any] | None:
    data = b"".join(line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:"))
    if not data or data == b"[DONE]":
        return None
    return json.loads(data)


def sse(event: str | None, payload: dict[str, Any]) -> bytes:
    """One SSE event; ``event`` names it (Anthropic, Responses) or is None (Google: data only)."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode("utf-8")


def mint_reasoning(text: str) -> str:
    """An opaque token (signature, encrypted_content, thoughtSignature) that carries reasoning text.

    The harness stores it and sends it back on the next request; :func:`read_reasoning` turns it
    into the upstream's ``reasoning`` field, so the next prompt renders the tokens the model sampled.
    """
    return REASONING_PREFIX + base64.urlsafe_b64encode(text.encode("utf-8")).decode("ascii")


def read_reasoning(token: str | None) -> str | None:
    """The reasoning text in a token from :func:`mint_reasoning`; None for anyone else's token."""
    if not token or not token.startswith(REASONING_PREFIX):
        return None
    try:
        return base64.urlsafe_b64decode(token[len(REASONING_PREFIX) :].encode("ascii")).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None


def merge_system(messages: list[dict[str, Any]], instructions: list[str]) -> list[dict[str, Any]]:
    """One leading system message from ``instructions`` and every system/developer message.

    Chat templates (Qwen, vLLM's) accept one system message, first. Order is kept.
    """
    texts = [t for t in instructions if t]
    rest = []
    for message in messages:
        if message.get("role") in ("system", "developer"):
            content = message.get("content")
            texts.append(content if isinstance(content, str) else text_of(content))
        else:
            rest.append(message)
    return ([{"role": "system", "content": "\n\n".join(texts)}] if texts else []) + rest


def text_of(parts: Any) -> str:
    """The text of a content value: a string, or a list of parts with ``text``."""
    if isinstance(parts, str):
        return parts
    if isinstance(parts, list):
        return "".join(p.get("text", "") for p in parts if isinstance(p, dict))
    return ""
