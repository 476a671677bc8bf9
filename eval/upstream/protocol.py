"""The reference server's protocol bodies, apart from its HTTP routes (eval/upstream/server.py): a chat request
parsed and checked the way vLLM (or SGLang) checks it, the answer as one completion body or as stream chunks
with the token fields the capture proxy relies on, and vLLM's own ``/v1/responses`` on top of the chat path.
Pure functions of the request and the engine's pieces: no sockets, no model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from addon import native, responses
from eval.upstream.engine import Piece
from eval.upstream.toolparse import Content, Reasoning, ToolCall

__all__ = [
    "BadRequest",
    "ChatRequest",
    "ResponsesCall",
    "completion_body",
    "get_field",
    "parse_request",
    "stream_chunks",
]


class BadRequest(Exception):
    """A request the server refuses with 400 and an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": "invalid_request_error", "param": self.param, "code": None}}


@dataclasses.dataclass
class ChatRequest:
    """The fields of a chat completion request that this server acts on; vLLM ignores unknown ones too."""

    model: str
    messages: list[dict[str, Any]]  # tool-call arguments already objects, as the template wants them
    tools: list[dict[str, Any]] | None
    max_tokens: int | None
    max_tokens_field: str  # the name the client used for it (max_completion_tokens or max_tokens): errors say it
    sampling: dict[str, Any]  # eval.upstream.engine.Sampling fields except max_tokens, fixed once the prompt is known
    stream: bool
    include_usage: bool
    return_token_ids: bool
    sglang: dict[str, bool] = dataclasses.field(default_factory=dict)  # SGLang's token fields, as sent


_ROLES = {"system", "developer", "user", "assistant", "tool"}
_KINDS: dict[Any, tuple[tuple[type, ...], str]] = {
    bool: ((bool,), "a boolean"),
    int: ((int,), "an integer"),
    float: ((int, float), "a number"),
    str: ((str,), "a string"),
    list: ((list,), "an array"),
    dict: ((dict,), "an object"),
}


def get_field(body: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    types, what = _KINDS[kind]
    if not isinstance(value, types) or (kind is not bool and isinstance(value, bool)):
        raise BadRequest(f"'{name}' must be {what}", name)
    return value


SGLANG_FIELDS = (
    "return_prompt_token_ids",
    "return_meta_info",
    "return_input_ids_in_sglext",
    "return_output_ids_in_sglext",
)
SGLANG_NOT_STREAMED = ("return_token_ids", "return_prompt_token_ids", "return_meta_info")


def parse_request(body: Any, default_model: str, flavor: str = "vllm") -> ChatRequest:
    """Checks a decoded JSON body; raises BadRequest naming the offending field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    messages = get_field(body, "messages", list)
    if not messages:
        raise BadRequest("'messages' must be a non-empty array", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise BadRequest(f"messages[{i}] must be an object with a role in {sorted(_ROLES)}", f"messages[{i}]")
        if not isinstance(m.get("content"), str | list | None):
            raise BadRequest(f"messages[{i}].content must be a string, an array of parts or null", f"messages[{i}]")
    tools = get_field(body, "tools", list)
    for i, t in enumerate(tools or []):
        if not (isinstance(t, dict) and isinstance(t.get("function"), dict) and "name" in t["function"]):
            raise BadRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "auto", "none"):
        raise BadRequest("only tool_choice 'auto' and 'none' are supported (no guided decoding here)", "tool_choice")
    if get_field(body, "n", int, 1) != 1:
        raise BadRequest("only n=1 is supported", "n")
    max_tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = get_field(body, max_tokens_field, int)  # OpenAI's newer name wins, as in vLLM
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest(f"{max_tokens_field} must be at least 1", max_tokens_field)
    temperature = get_field(body, "temperature", float, 1.0)
    if not 0 <= temperature <= 2:
        raise BadRequest("temperature must be between 0 and 2", "temperature")
    top_p = get_field(body, "top_p", float, 1.0)
    if not 0 < top_p <= 1:
        raise BadRequest("top_p must be in (0, 1]", "top_p")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise BadRequest("'stop' must be a string or an array of non-empty strings", "stop")
    stream = get_field(body, "stream", bool, False)
    stream_options = get_field(body, "stream_options", dict)
    if stream_options is not None and not stream:
        raise BadRequest("stream_options can only be set when stream is true", "stream_options")
    logprobs = get_field(body, "logprobs", bool, False)
    top_logprobs = get_field(body, "top_logprobs", int, 0)
    if not -1 <= top_logprobs <= 20:
        raise BadRequest("top_logprobs must be between 0 and 20, or -1 for all", "top_logprobs")
    if top_logprobs and not logprobs:
        raise BadRequest("top_logprobs needs logprobs set to true", "top_logprobs")
    sampling = {
        "temperature": temperature,
        "top_p": top_p,
        "seed": get_field(body, "seed", int),
        "stop": stop,
        "logprobs": logprobs,
        "top_logprobs": top_logprobs,
        # vLLM parses tool calls only when the request has tools and tool_choice is not "none".
        "parse_tools": bool(tools) and tool_choice != "none",
    }
    sglang = {name: get_field(body, name, bool, False) for name in SGLANG_FIELDS} if flavor == "sglang" else {}
    if flavor == "sglang" and stream:
        for name in SGLANG_NOT_STREAMED:
            if body.get(name):  # SGLang raises a ValueError, answered 400
                raise BadRequest(f"{name} is not supported with stream=true; use return_*_ids_in_sglext", name)
    return ChatRequest(
        model=get_field(body, "model", str, default_model),
        messages=_object_arguments(messages),
        tools=tools or None,
        max_tokens=max_tokens,
        max_tokens_field=max_tokens_field,
        sampling=sampling,
        stream=stream,
        include_usage=get_field(stream_options or {}, "include_usage", bool, False),
        return_token_ids=get_field(body, "return_token_ids", bool, False),
        sglang=sglang,
    )


def _object_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool-call arguments arrive as JSON text; render them as objects, as vLLM does before templating."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and isinstance(m.get("tool_calls"), list):
            calls = []
            for call in m["tool_calls"]:
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    with contextlib.suppress(json.JSONDecodeError):  # else rendered verbatim, as the client sent it
                        call = {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
                calls.append(call)
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _finish_reason(reason: str | None, tool_calls: int) -> str | None:
    # A truncated answer stays "length", so a trainer can tell it was cut off.
    return "tool_calls" if reason == "stop" and tool_calls else reason


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(req: ChatRequest, prompt_ids: list[int], pieces: Iterator[Piece]) -> dict[str, Any]:
    """The non-streamed ``chat.completion`` object, with vLLM's token fields when asked for."""
    token_ids, logprobs, calls, finish = [], [], [], None
    text = {Content: "", Reasoning: ""}
    for piece in pieces:
        token_ids.append(piece.token_id)
        logprobs += [piece.logprob] if piece.logprob else []
        for event in piece.events:
            if isinstance(event, ToolCall):
                calls.append(_tool_call(event))
            else:
                text[type(event)] += event.text
        finish = piece.finish_reason
    message = {"role": "assistant", "content": text[Content] or None, "reasoning": text[Reasoning] or None}
    choice: dict[str, Any] = {
        "index": 0,
        "message": {**message, "tool_calls": calls},
        "logprobs": {"content": logprobs} if req.sampling["logprobs"] else None,
        "finish_reason": _finish_reason(finish, len(calls)),
    }
    body: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
    }
    if req.sglang:  # SGLang: everything per choice
        if req.sglang["return_prompt_token_ids"]:
            choice["prompt_token_ids"] = prompt_ids
        if req.return_token_ids:
            choice["response_token_ids"] = token_ids
        if req.sglang["return_meta_info"]:
            triples = [[e["logprob"], t, None] for e, t in zip(logprobs, token_ids, strict=True)] if logprobs else None
            choice["meta_info"] = {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(token_ids),
                "cached_tokens": 0,
                "output_token_logprobs": triples,
            }
    elif req.return_token_ids:
        choice["token_ids"] = token_ids
        body["prompt_token_ids"] = prompt_ids
    return {**body, "choices": [choice], "usage": _usage(len(prompt_ids), len(token_ids))}


def stream_chunks(req: ChatRequest, prompt_ids: list[int], pieces: Iterator[Piece]) -> Iterator[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects of a stream: the role chunk, one chunk per token, then usage."""
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": req.model,
    }
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    yield {**head, "choices": [role]} | ({"prompt_token_ids": prompt_ids} if req.return_token_ids else {})
    n_calls = n_tokens = 0
    sampled: list[int] = []  # for SGLang's sglext chunk
    for piece in pieces:
        n_tokens += 1
        delta: dict[str, Any] = {}
        for event in piece.events:
            if isinstance(event, ToolCall):
                delta.setdefault("tool_calls", []).append({"index": n_calls, **_tool_call(event)})
                n_calls += 1
            else:
                key = "content" if isinstance(event, Content) else "reasoning"
                delta[key] = delta.get(key, "") + event.text
        choice = {
            "index": 0,
            "delta": delta or {"content": ""},  # text held back (or swallowed by a parser): the ids still go out
            "logprobs": {"content": [piece.logprob]} if piece.logprob else None,
            "finish_reason": _finish_reason(piece.finish_reason, n_calls),
        }
        if req.return_token_ids:
            choice["token_ids"] = [piece.token_id]
        sampled.append(piece.token_id)
        yield {**head, "choices": [choice]}
    ext: dict[str, Any] = {}
    if req.sglang.get("return_input_ids_in_sglext"):
        ext["input_ids"] = prompt_ids
    if req.sglang.get("return_output_ids_in_sglext"):
        ext["output_ids"] = [sampled]  # one list per choice
    if ext:
        yield {**head, "choices": [], "sglext": ext}
    if req.include_usage:
        yield {**head, "choices": [], "usage": _usage(len(prompt_ids), n_tokens)}


class ResponsesCall:
    """vLLM's own ``/v1/responses`` on top of the chat path: the request and answer mapped by the capture addon's
    Responses translator (what vLLM's does, for this purpose), plus vLLM's token fields on the final response
    object: ``enable_response_messages`` adds ``input_messages`` / ``output_messages`` (``raw_message_tokens``:
    the rendered text and its ids), ``include: ["message.output_text.logprobs"]`` the log-probs of the output
    text's tokens (tokens of reasoning and tool calls have none in this API)."""

    def __init__(self, body: Any, default_model: str) -> None:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        try:
            self.translation = responses.start(body, "/v1/responses", {}, native.Options(model="", upstream="vllm"))
        except native.BadRequest as e:
            raise BadRequest(str(e)) from e
        chat = {**self.translation.chat_body, "return_token_ids": True, "logprobs": True, "top_logprobs": 0}
        if chat.get("stream") is True:
            chat["stream_options"] = {"include_usage": True}
        self.chat = parse_request(chat, default_model)
        self.messages = body.get("enable_response_messages") is True
        self.logprobs = responses.OUTPUT_LOGPROBS in (body.get("include") or [])
        self.pieces: list[Piece] = []

    def tap(self, pieces: Iterator[Piece]) -> Iterator[Piece]:
        for piece in pieces:
            self.pieces.append(piece)
            yield piece

    def finish(self, response: dict[str, Any], prompt_ids: list[int], decode: Any) -> dict[str, Any]:
        """The final response object with vLLM's token fields."""
        sampled = [p.token_id for p in self.pieces]
        if self.messages:
            response["input_messages"] = [
                {"type": "raw_message_tokens", "message": decode(prompt_ids), "tokens": prompt_ids}
            ]
            response["output_messages"] = [
                {"type": "raw_message_tokens", "message": decode(sampled), "tokens": sampled}
            ]
        if self.logprobs:
            text = [p.logprob for p in self.pieces if p.logprob and any(isinstance(e, Content) for e in p.events)]
            for item in response.get("output") or []:
                for part in item.get("content") or [] if item.get("type") == "message" else []:
                    part["logprobs"] = text
        return response

    def events(self, prompt_ids: list[int], pieces: Iterator[Piece], decode: Any) -> Iterator[bytes]:
        """The SSE bytes of a streamed answer; the final event carries the token fields."""
        for chunk in stream_chunks(self.chat, prompt_ids, self.tap(pieces)):
            if out := self.translation.events(chunk):
                yield out
        for raw in self.translation.finish(True).split(b"\n\n"):
            name, _, data = raw.partition(b"\ndata: ")
            if name in (b"event: response.completed", b"event: response.incomplete"):
                event = json.loads(data)
                event["response"] = self.finish(event["response"], prompt_ids, decode)
                raw = name + b"\ndata: " + json.dumps(event, ensure_ascii=False).encode()
            if raw:
                yield raw + b"\n\n"
