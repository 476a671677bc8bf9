"""Native-API calls that reached their upstream untranslated, rewritten as the Chat Completions exchanges the
chat extractor reads (``_extract.NATIVE_CONVERTERS``).

A native call is recorded untranslated when the addon runs with ``polar_translate=never`` (vLLM's own
``/v1/responses`` or ``/v1/messages`` then answers), or in transparent capture-only mode in front of a closed
API (distillation data). The converter turns the record into a chat-shaped one:

- ``upstream_request``: the Chat Completions body the addon's own translator (addon/anthropic.py, responses.py,
  google.py) makes of the native request, so retokenization renders what a translated call would have sent;
- ``response_body``: a non-streamed ``chat.completion`` with the assistant message the native answer (streamed
  or not) carried, its finish reason and, when the upstream is an open server, its usage;
- token ids only where the answer has them: vLLM's Responses API with ``enable_response_messages`` puts the
  prompt's and the sampled ids on the final response object (``input_messages`` / ``output_messages``,
  ``raw_message_tokens``), and ``include: ["message.output_text.logprobs"]`` the log-probs of the output text;
  they are kept when they cover every sampled token. Everything else has no ids and is retokenized
  (``--tokenizer``), its usage dropped when a closed API counted it with another tokenizer.

Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from addon import anthropic, google, native, responses
from addon.sse import SSEDecoder
from reconstruct._json import dumps, loads

__all__ = ["CONVERTERS", "anthropic_record", "google_record", "responses_record"]

# Upstream modes (the record's ``upstream``) whose usage counts tokens the way our tokenizer would.
_OPEN_UPSTREAMS = ("vllm", "sglang")
_OPTIONS = native.Options(model="", upstream="vllm")


def _convert(record: dict[str, Any], answer: Callable[[str, bool], dict[str, Any] | None]) -> dict[str, Any] | None:
    """The chat-shaped record, or None when the request does not translate or the answer holds nothing."""
    request, text = record.get("request"), record.get("response_body")
    if not isinstance(request, dict) or not isinstance(text, str) or record.get("status") != 200:
        return None
    try:
        start = {"anthropic": anthropic.start, "responses": responses.start, "google": google.start}[record["api"]]
        translation = start(request, str(record.get("path") or ""), {}, _OPTIONS)
    except (native.BadRequest, KeyError):
        return None
    chat_body = getattr(translation, "chat_body", None)  # count_tokens answers locally: not a model call
    body = answer(text, bool(record.get("streamed")))
    if chat_body is None or body is None:
        return None
    if record.get("upstream") not in _OPEN_UPSTREAMS:
        body.pop("usage", None)
    return {**record, "upstream_request": chat_body, "injected": {}, "response_body": dumps(body), "streamed": False}


def _completion(
    message: dict[str, Any], finish: str | None, usage: dict[str, Any] | None, model: Any
) -> dict[str, Any]:
    choice = {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}
    return {"object": "chat.completion", "model": model, "choices": [choice], "usage": usage}


def _events(text: str) -> list[Any]:
    """The JSON payloads of an SSE stream, in order; events that do not parse are skipped."""
    sse = SSEDecoder()
    events = sse.decode(text)
    sse.flush()
    out = []
    for event in events:
        try:
            out.append(loads(event.data))
        except ValueError:
            continue
    return out


def _message(content: list[str], reasoning: list[str], calls: list[dict[str, Any]]) -> dict[str, Any]:
    return {"content": "".join(content) or None, "reasoning": "".join(reasoning) or None, "tool_calls": calls}


def _call(call_id: Any, name: Any, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments or {}, ensure_ascii=False)
    return {"id": call_id or "", "type": "function", "function": {"name": name or "", "arguments": text}}


# ---- OpenAI Responses (vLLM's own /v1/responses, or OpenAI's)


def _final_response(text: str, streamed: bool) -> dict[str, Any] | None:
    if not streamed:
        try:
            body = loads(text)
        except ValueError:
            return None
        return body if isinstance(body, dict) else None
    final = None
    for event in _events(text):
        done = ("response.completed", "response.incomplete", "response.failed")
        if isinstance(event, dict) and event.get("type") in done and isinstance(event.get("response"), dict):
            final = event["response"]
    return final


def _responses_answer(text: str, streamed: bool) -> dict[str, Any] | None:
    response = _final_response(text, streamed)
    if response is None or response.get("status") == "failed":
        return None
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    logprobs: list[Any] = []
    for item in response.get("output") or []:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "message":
            for part in item.get("content") or []:
                if isinstance(part, dict) and part.get("type") == "output_text":
                    content.append(part.get("text") or "")
                    logprobs += part.get("logprobs") or []
        elif item.get("type") == "reasoning":
            # The addon's own encrypted_content holds the full text; OpenAI's is opaque, its summary not sampled.
            own = native.read_reasoning(item.get("encrypted_content")) if item.get("encrypted_content") else None
            reasoning += (
                [own]
                if own is not None
                else [p.get("text") or "" for p in item.get("content") or [] if isinstance(p, dict)]
            )
        elif item.get("type") == "function_call":
            calls.append(_call(item.get("call_id"), item.get("name"), item.get("arguments")))
    incomplete = response.get("status") == "incomplete"
    finish = "length" if incomplete else "tool_calls" if calls else "stop"
    usage = u if isinstance(u := response.get("usage"), dict) else {}
    counts = {"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens")}
    body = _completion(_message(content, reasoning, calls), finish, counts, response.get("model"))
    prompt, sampled = _raw_tokens(response.get("input_messages")), _raw_tokens(response.get("output_messages"))
    if prompt and sampled:
        body["prompt_token_ids"] = prompt
        body["choices"][0]["token_ids"] = sampled
        # Only text has log-probs in the Responses API: with reasoning or tool calls they cover part of the ids,
        # and a call then has none (the trainer recomputes them).
        if len(logprobs) == len(sampled):
            body["choices"][0]["logprobs"] = {"content": logprobs}
    return body


def _raw_tokens(messages: Any) -> list[int] | None:
    if not isinstance(messages, list) or not messages:
        return None
    ids: list[int] = []
    for m in messages:
        tokens = m.get("tokens") if isinstance(m, dict) and m.get("type") == "raw_message_tokens" else None
        if not isinstance(tokens, list):
            return None
        ids += tokens
    return ids


def responses_record(record: dict[str, Any]) -> dict[str, Any] | None:
    return _convert(record, _responses_answer)


# ---- Anthropic Messages


_ANTHROPIC_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "tool_use": "tool_calls", "max_tokens": "length"}


def _anthropic_answer(text: str, streamed: bool) -> dict[str, Any] | None:
    if streamed:
        message = _anthropic_stream(_events(text))
    else:
        try:
            message = loads(text)
        except ValueError:
            return None
    if not isinstance(message, dict) or message.get("type") != "message":
        return None
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in message.get("content") or []:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            content.append(block.get("text") or "")
        elif kind == "thinking":
            reasoning.append(block.get("thinking") or "")
        elif kind == "tool_use":
            calls.append(_call(block.get("id"), block.get("name"), block.get("input")))
    usage = u if isinstance(u := message.get("usage"), dict) else {}
    counts = {"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens")}
    finish = _ANTHROPIC_FINISH.get(str(message.get("stop_reason")))
    return _completion(_message(content, reasoning, calls), finish, counts, message.get("model"))


def _anthropic_stream(events: list[Any]) -> dict[str, Any] | None:
    """The message a stream of Messages events adds up to (text, thinking and tool-use blocks, stop reason)."""
    message: dict[str, Any] | None = None
    blocks: dict[int, dict[str, Any]] = {}
    for event in events:
        if not isinstance(event, dict):
            continue
        kind = event.get("type")
        if kind == "message_start" and isinstance(event.get("message"), dict):
            message = {**event["message"], "content": []}
        elif kind == "content_block_start" and isinstance(event.get("content_block"), dict):
            blocks[event.get("index", len(blocks))] = {**event["content_block"], "partial_json": ""}
        elif kind == "content_block_delta" and isinstance(event.get("delta"), dict):
            block, delta = blocks.setdefault(event.get("index", 0), {"partial_json": ""}), event["delta"]
            for key, field in (("text_delta", "text"), ("thinking_delta", "thinking")):
                if delta.get("type") == key:
                    block[field] = (block.get(field) or "") + (delta.get(field) or "")
            if delta.get("type") == "input_json_delta":
                block["partial_json"] += delta.get("partial_json") or ""
        elif kind == "message_delta" and message is not None:
            message["stop_reason"] = (event.get("delta") or {}).get("stop_reason")
            message["usage"] = {**(message.get("usage") or {}), **(event.get("usage") or {})}
    if message is None:
        return None
    for _, block in sorted(blocks.items()):
        if block.get("type") == "tool_use" and block["partial_json"]:
            try:
                block["input"] = loads(block["partial_json"])
            except ValueError:
                block["input"] = block["partial_json"]  # kept as sent: the call was cut off
        message["content"].append(block)
    return message


def anthropic_record(record: dict[str, Any]) -> dict[str, Any] | None:
    return _convert(record, _anthropic_answer)


# ---- Google generateContent / streamGenerateContent


_GOOGLE_FINISH = {"STOP": "stop", "MAX_TOKENS": "length"}


def _google_answer(text: str, streamed: bool) -> dict[str, Any] | None:
    if streamed:
        chunks = _events(text)
    else:
        try:
            chunks = [loads(text)]
        except ValueError:
            return None
    content: list[str] = []
    reasoning: list[str] = []
    signed: list[str] = []  # reasoning the addon signed into thoughtSignature (Google's own are opaque)
    calls: list[dict[str, Any]] = []
    usage: dict[str, Any] = {}
    finish, model, seen = None, None, False
    for chunk in chunks:
        if not isinstance(chunk, dict):
            continue
        usage = chunk.get("usageMetadata") or usage
        model = chunk.get("modelVersion") or model
        for candidate in (chunk.get("candidates") or [])[:1]:
            seen = True
            for part in (candidate.get("content") or {}).get("parts") or []:
                if not isinstance(part, dict):
                    continue
                decoded = google.read_signature(part.get("thoughtSignature"))
                if decoded is not None and decoded not in signed:
                    signed.append(decoded)
                if isinstance(part.get("text"), str):
                    (reasoning if part.get("thought") else content).append(part["text"])
                call = part.get("functionCall")
                if isinstance(call, dict):
                    calls.append(_call(call.get("id") or f"call_{len(calls)}", call.get("name"), call.get("args")))
            finish = candidate.get("finishReason") or finish
    if not seen:
        return None
    reason = "tool_calls" if calls and finish == "STOP" else _GOOGLE_FINISH.get(str(finish), "stop" if finish else None)
    counts = {"prompt_tokens": usage.get("promptTokenCount"), "completion_tokens": usage.get("candidatesTokenCount")}
    return _completion(_message(content, signed or reasoning, calls), reason, counts, model)


def google_record(record: dict[str, Any]) -> dict[str, Any] | None:
    return _convert(record, _google_answer)


CONVERTERS: dict[str, Callable[[dict[str, Any]], dict[str, Any] | None]] = {
    "anthropic": anthropic_record,
    "responses": responses_record,
    "google": google_record,
}
