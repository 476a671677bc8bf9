"""What the native-API translators (anthropic.py, responses.py, google.py) share, and the contract they keep.

A harness that speaks Anthropic Messages, OpenAI Responses or Google generateContent is answered
by an upstream that speaks Chat Completions, because only Chat Completions returns token ids and
log-probs on every streamed chunk (vLLM, SGLang). Each translator module exposes::

    start(body: dict, path: str, headers: dict[str, str], options: Options) -> Translation | LocalAnswer

raising :class:`BadRequest` for a body it cannot translate: each module declares the types of the fields it
reads (a spec for :func:`mismatch`), so a malformed body is a 400 naming the field, never a crash
(issue 16; tests/addon/test_fuzz_native.py mutates real bodies to hold it). A :class:`Translation` carries the
Chat Completions body to send upstream (without token fields: the addon adds those as for any chat
call) and turns the upstream's answer back into the harness's format, chunk by chunk as it
streams. Translators are pure: no I/O, no mitmproxy; the addon does the plumbing. Each module is one entry of
the registry in addon/apis.py, and keeps the :class:`Translator` contract below.

What they share is here: :func:`chat_delta` reads a chunk's delta whatever names the upstream gave its fields,
:class:`ToolCalls` gathers streamed tool-call pieces, and :func:`answer_chunk` turns a non-streamed answer into the
one chunk each stream machine is fed, so both shapes of an answer come from the same code. The helpers at the end
turn a native answer recorded untranslated back into a ``chat.completion`` (for reconstruction).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from addon.sse import SSEDecoder, SSEEvent

REASONING_PREFIX = "polar1:"


@dataclass(frozen=True)
class Options:
    model: str  # served model name to ask the upstream for; "" keeps the client's
    upstream: str  # vllm | sglang


class BadRequest(ValueError):
    """A native request the translator cannot map; the client gets a 400 in its API's error shape.

    ``param`` names the offending field where one is known (OpenAI's error bodies carry it).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# --- the types of the fields a translator reads -----------------------------------------------------------
#
# A spec is a JSON kind (str, bool, dict, list, NUMBER, INTEGER), an object {field: spec} (fields absent or null
# pass: translators treat null as absent; fields not named are not looked at), an array [item spec], or
# OneOf(spec, ...) for a field of several kinds (Anthropic's "system": a string or an array of blocks).

NUMBER = "number"  # int or float, not bool
INTEGER = "integer"  # int, not bool


@dataclass(frozen=True)
class OneOf:
    options: tuple[Any, ...]

    def __init__(self, *options: Any) -> None:
        object.__setattr__(self, "options", options)


@dataclass(frozen=True)
class Mismatch:
    path: tuple[str | int, ...]  # from the body's top: field names and array indices
    expected: str  # "a string or an array"
    got: str  # "a number"


_KINDS = {
    str: "a string",
    bool: "a boolean",
    dict: "an object",
    list: "an array",
    NUMBER: "a number",
    INTEGER: "an integer",
}


def mismatch(value: Any, spec: Any, names: Callable[[Any], Any] = lambda v: v) -> Mismatch | None:
    """The first place where ``value`` does not have the kind ``spec`` says, or None. ``names`` rewrites each
    object before its fields are looked up (Google takes snake_case for camelCase)."""
    return _mismatch(value, spec, (), names)


def _mismatch(value: Any, spec: Any, path: tuple[str | int, ...], names: Callable[[Any], Any]) -> Mismatch | None:
    if isinstance(spec, OneOf):
        for option in spec.options:
            if _is(value, option):
                return _mismatch(value, option, path, names)
        return Mismatch(path, " or ".join(_describe(o) for o in spec.options), json_kind(value))
    if not _is(value, spec):
        return Mismatch(path, _describe(spec), json_kind(value))
    if isinstance(spec, dict):
        fields = names(value)
        for name, field_spec in spec.items():
            if fields.get(name) is not None and (found := _mismatch(fields[name], field_spec, (*path, name), names)):
                return found
    elif isinstance(spec, list):
        for i, item in enumerate(value):
            if found := _mismatch(item, spec[0], (*path, i), names):
                return found
    return None


def _is(value: Any, spec: Any) -> bool:
    kind = dict if isinstance(spec, dict) else list if isinstance(spec, list) else spec
    if kind in (NUMBER, INTEGER):
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return number and (kind == NUMBER or isinstance(value, int))
    return isinstance(value, kind)


def _describe(spec: Any) -> str:
    if isinstance(spec, list) and isinstance(spec[0], dict):
        return "an array of objects"
    if isinstance(spec, list) and spec[0] is str:
        return "an array of strings"
    return _KINDS[dict if isinstance(spec, dict) else list if isinstance(spec, list) else spec]


def json_kind(value: Any) -> str:
    """What a JSON value is, in words: "a number", "null", ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return _KINDS.get(type(value), type(value).__name__)


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

    def finish(self, complete: bool, message: str | None = None) -> bytes:
        """Closing native events once the upstream stream ended (``complete`` false: it broke; ``message``, when
        given, says the upstream broke it off, and the client gets its API's error event with it)."""

    def answer(self, response: dict[str, Any]) -> dict[str, Any]:
        """The native non-streamed body for an upstream ``chat.completion``."""

    def error(self, status: int, message: str) -> dict[str, Any]:
        """The native error body for an upstream failure (status kept by the addon)."""


class Translator(Protocol):
    """A translator module (anthropic.py, responses.py, google.py), as the registry (addon/apis.py) holds it."""

    def start(
        self, body: dict[str, Any], path: str, headers: dict[str, str], options: Options
    ) -> Translation | LocalAnswer:
        """The translation of one request; :class:`BadRequest` for a body it cannot translate."""

    def error_body(self, status: int, message: str, param: str | None = None) -> dict[str, Any]:
        """An error body in the API's shape (``param``: the offending field, where the API's shape has one)."""

    def to_chat_completion(self, text: str, streamed: bool) -> dict[str, Any] | None:
        """A native answer recorded untranslated (``polar_translate=never``, capture-only) as a non-streamed
        ``chat.completion``, or None when it holds no answer. Reconstruction reads it (reconstruct/_extract.py)."""


class ChatStream:
    """Incremental decoder for an upstream Chat Completions stream: bytes in, chunk dicts out.

    Network chunks split events anywhere (mid-line, mid-UTF-8); :class:`SSEDecoder` buffers until an
    event is complete. ``data: [DONE]`` and comments are skipped; an event that is not JSON raises.
    """

    def __init__(self) -> None:
        self._sse = SSEDecoder()

    def decode(self, data: bytes) -> Iterator[dict[str, Any]]:
        return _chunks(self._sse.decode(data))

    def flush(self) -> Iterator[dict[str, Any]]:
        # An upstream that closes right after its last event's data line still sent that event: end it.
        events = self._sse.decode(b"\n\n")
        self._sse.flush()
        return _chunks(events)


def _chunks(events: list[SSEEvent]) -> Iterator[dict[str, Any]]:
    for event in events:
        if event.data and event.data != "[DONE]":
            chunk: dict[str, Any] = json.loads(event.data)  # every event the APIs stream is a JSON object
            if chunk:
                yield chunk


# --- the upstream's answer, as the translators' stream machines read it ------------------------------------


@dataclass(slots=True)
class ChatDelta:
    """What one upstream chunk adds to the answer, whichever names the upstream gave its fields. Only the first
    choice: Messages, Responses and generateContent (``candidateCount`` 1) have one answer."""

    reasoning: str  # vLLM's "reasoning", SGLang's (and older vLLM's) "reasoning_content"
    content: str
    tool_calls: list[dict[str, Any]]  # pieces of calls, each naming its call by "index"
    finish_reason: str | None
    stop_reason: Any  # vLLM: the stop string that ended the answer, if one did
    token_count: int  # sampled token ids in the chunk (vLLM's token_ids)


def chat_delta(chunk: dict[str, Any]) -> ChatDelta | None:
    """The first choice's delta of a ``chat.completion.chunk``; None when the chunk has none (a usage chunk)."""
    for choice in chunk.get("choices") or []:
        if choice.get("index", 0) == 0:
            delta = choice.get("delta") or {}
            return ChatDelta(
                reasoning=delta.get("reasoning") or delta.get("reasoning_content") or "",
                content=delta.get("content") or "",
                tool_calls=delta.get("tool_calls") or [],
                finish_reason=choice.get("finish_reason") or None,
                stop_reason=choice.get("stop_reason"),
                token_count=len(choice.get("token_ids") or []),
            )
    return None


def answer_chunk(response: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed ``chat.completion`` as the one chunk that streams it: each translator's ``answer`` feeds it to
    its stream machine, so a streamed and a non-streamed answer are built by the same code."""
    choice = (response.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    delta = {
        "reasoning": message.get("reasoning") or message.get("reasoning_content"),
        "content": message.get("content"),
        "tool_calls": [{**call, "index": i} for i, call in enumerate(message.get("tool_calls") or [])],
    }
    fields = {k: choice[k] for k in ("finish_reason", "stop_reason", "token_ids") if k in choice}
    return {
        "id": response.get("id"),
        "prompt_token_ids": response.get("prompt_token_ids"),
        "choices": [{"index": 0, "delta": delta, **fields}],
        "usage": response.get("usage"),
    }


@dataclass(slots=True)
class ToolCall:
    """One tool call gathered from its streamed pieces."""

    id: str | None
    name: str
    arguments: str  # the JSON text so far
    sent: int = 0  # how much of ``arguments`` has been passed on to the client

    def unsent(self) -> str:
        """The argument text not yet passed on, now counted as passed on."""
        text, self.sent = self.arguments[self.sent :], len(self.arguments)
        return text


class ToolCalls:
    """The tool calls of one answer, gathered from the pieces the upstream streams: a piece names its call by
    ``index`` (a piece without one starts a new call), the first carries the id and name, the rest argument text."""

    def __init__(self) -> None:
        self.calls: dict[int, ToolCall] = {}

    def add(self, piece: dict[str, Any]) -> tuple[int, ToolCall]:
        """The index and the call a piece belongs to, with the piece added."""
        index = piece.get("index", len(self.calls))
        function = piece.get("function") or {}
        call = self.calls.get(index)
        if call is None:
            call = self.calls[index] = ToolCall(piece.get("id"), "", "")
        call.id = call.id or piece.get("id")
        call.name += function.get("name") or ""
        call.arguments += function.get("arguments") or ""
        return index, call

    def __bool__(self) -> bool:
        return bool(self.calls)


def sse(event: str | None, payload: dict[str, Any]) -> bytes:
    """One SSE event; ``event`` names it (Anthropic, Responses) or is None (Google: data only)."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode()


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
        return "".join(p.get("text") or "" for p in parts if isinstance(p, dict))
    return ""


# --- native answers back to Chat Completions (each module's ``to_chat_completion``) ---------------------------


def sse_payloads(text: str) -> list[Any]:
    """The JSON payloads of a recorded SSE stream, in order; events that do not parse are skipped."""
    decoder = SSEDecoder()
    events = decoder.decode(text)
    decoder.flush()
    out = []
    for event in events:
        try:
            out.append(json.loads(event.data))
        except ValueError:
            continue
    return out


def json_object(text: str) -> dict[str, Any] | None:
    """The JSON object ``text`` holds (a recorded answer's body, a tool call's arguments), or None when it holds
    none."""
    try:
        body = json.loads(text)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def chat_completion(
    content: list[str],
    reasoning: list[str],
    calls: list[dict[str, Any]],
    finish: str | None,
    usage: dict[str, Any] | None,
    model: Any,
) -> dict[str, Any]:
    """A non-streamed ``chat.completion`` with one assistant message made of the pieces an answer held."""
    message = {"content": "".join(content) or None, "reasoning": "".join(reasoning) or None, "tool_calls": calls}
    choice = {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}
    return {"object": "chat.completion", "model": model, "choices": [choice], "usage": usage}


def chat_tool_call(call_id: Any, name: Any, arguments: Any) -> dict[str, Any]:
    """A Chat Completions tool call; ``arguments`` as JSON text, or a value written as JSON text."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments or {}, ensure_ascii=False)
    return {"id": call_id or "", "type": "function", "function": {"name": name or "", "arguments": text}}
