"""OpenAI Responses (what Codex speaks) ⇄ Chat Completions, translated chunk by chunk as the upstream streams.

The contract is addon/native.py's. A request becomes one Chat Completions request:

- ``instructions`` and every system/developer message merge into one leading system message;
- ``message`` items keep their role, their text parts joined (images become ``image_url`` parts);
- ``function_call`` / ``local_shell_call`` items become assistant ``tool_calls``: consecutive ones, and an
  assistant message right before them, are one assistant message, since the model sampled them as one turn;
  ``function_call_output`` / ``local_shell_call_output`` items become ``tool`` messages;
- a ``reasoning`` item's ``encrypted_content`` (minted here, see ``native.mint_reasoning``) is decoded into
  ``reasoning`` on the next assistant message, so the next prompt renders the tokens the model sampled;
  anyone else's ``encrypted_content`` is dropped;
- function tools map to chat tools; hosted ones (``web_search``, ``namespace``, ``local_shell``…) are dropped,
  and ``tool_choice`` with them when no tool is left;
- ``max_output_tokens``, ``temperature``, ``top_p``, ``text.format`` map; a ``reasoning`` config turns on
  ``chat_template_kwargs.enable_thinking`` unless the client set it;
- the upstream is asked for ``polar_model`` when set, else the client's model; the client always sees its own.

The answer is built as the upstream's chunks arrive: ``response.created``, ``response.in_progress``, then one
output item per reasoning / text / tool call (``output_item.added``, deltas, ``output_item.done``), then
``response.completed`` (``response.incomplete`` when cut at ``max_output_tokens``; ``response.failed`` when the
stream broke). Reasoning is sent as ``reasoning_text`` content, as vLLM's own Responses API does for open
models: it is the model's raw reasoning, not a summary. A non-streamed answer is the same machine fed one chunk,
so both shapes agree. Requests that need server-side state (``previous_response_id``, …) are refused.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from typing import Any

from addon import native

# Request fields that point at state kept by OpenAI's servers; this proxy keeps none.
_STATEFUL = ("previous_response_id", "conversation", "prompt", "background")
# vLLM's and SGLang's wording of a prompt that does not fit, as far as it is stable.
_CONTEXT_OVERFLOW = re.compile(
    r"context length|context window|maximum context|too many tokens|prompt is too long", re.I
)
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}
LOCAL_SHELL = "local_shell"  # the chat tool name a local_shell_call is rendered under

# The fields the translation reads, by kind (native.mismatch): anything else of the wrong kind is a 400 naming it.
_PART = {"type": str, "text": str, "refusal": str, "image_url": str, "detail": str}
_CONTENT = native.OneOf(str, [_PART])
_ITEM = {"type": str, "role": str, "content": _CONTENT, "output": _CONTENT, "encrypted_content": str, "id": str,
         "call_id": str, "name": str, "arguments": str, "action": dict}  # fmt: skip
REQUEST = {
    "model": str, "instructions": str, "input": native.OneOf(str, [_ITEM]), "stream": bool, "store": bool,
    "tools": [{"type": str, "name": str, "description": str, "parameters": dict}],
    "tool_choice": native.OneOf(str, {"type": str, "name": str}), "parallel_tool_calls": bool,
    "max_output_tokens": native.INTEGER, "temperature": native.NUMBER, "top_p": native.NUMBER,
    "text": {"format": {"type": str, "name": str, "schema": dict, "strict": bool, "description": str}},
    "reasoning": {"effort": str, "summary": str}, "include": [str], "metadata": dict, "truncation": str,
    "chat_template_kwargs": dict, "previous_response_id": str, "background": bool,
}  # fmt: skip
OUTPUT_LOGPROBS = "message.output_text.logprobs"


def vllm_token_fields(body: dict[str, Any]) -> dict[str, Any]:
    """Fields that make vLLM's own /v1/responses return token ids, for a Responses call passed through untranslated
    (``polar_translate=never``): ``enable_response_messages`` puts the prompt's and the sampled token ids on the
    final response object (vLLM refuses it for background requests), the ``include`` entry the log-probs of its
    output text. Only what the client did not set itself; ``include`` is extended, not replaced."""
    if body.get("background") is True:
        return {}
    added: dict[str, Any] = {}
    if "enable_response_messages" not in body:
        added["enable_response_messages"] = True
    include = body.get("include")
    if include is None or (isinstance(include, list) and OUTPUT_LOGPROBS not in include):
        added["include"] = [*(include or []), OUTPUT_LOGPROBS]
    if "top_logprobs" not in body:
        added["top_logprobs"] = 0
    return added


def start(body: dict[str, Any], path: str, headers: dict[str, str], options: native.Options) -> Translation:
    if not path.partition("?")[0].rstrip("/").endswith("/responses"):
        # Detected by body shape alone ("input"): /embeddings and /moderations bodies have one too.
        raise native.BadRequest(f"POST {path.partition('?')[0]} is not a Responses call; only /responses is translated")
    if found := native.mismatch(body, REQUEST):
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in found.path).lstrip(".") or "body"
        raise native.BadRequest(
            f"Invalid type for '{where}': expected {found.expected}, but got {found.got} instead.", param=where
        )
    for name in _STATEFUL:
        if body.get(name):
            raise native.BadRequest(
                f"'{name}' needs state kept by the server, and this proxy keeps none: "
                "send the whole conversation in 'input' (with store: false)"
            )
    return Translation(body, options)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape (``param``: the offending field); a context overflow gets the code that makes Codex
    compact its history."""
    if status == 400 and _CONTEXT_OVERFLOW.search(message):
        return {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": "input",
                "code": "context_length_exceeded",
            }
        }
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


class Translation:
    """One Responses call: the chat request to send upstream, and the answer built from the upstream's."""

    def __init__(self, body: dict[str, Any], options: native.Options) -> None:
        self.chat_body = chat_request(body, options)
        self.stream = body.get("stream") is True
        self._body = body
        self._state = _Answer(body)

    def events(self, chunk: dict[str, Any]) -> bytes:
        return b"".join(self._state.feed(chunk))

    def finish(self, complete: bool, message: str | None = None) -> bytes:
        return b"".join(self._state.finish(complete, message))

    def answer(self, response: dict[str, Any]) -> dict[str, Any]:
        state = _Answer(self._body, quiet=True)
        state.feed(native.answer_chunk(response))
        state.finish(True)
        return state.response

    def error(self, status: int, message: str) -> dict[str, Any]:
        return error_body(status, message)


# --- request ------------------------------------------------------------------------------------------------


def chat_request(body: dict[str, Any], options: native.Options) -> dict[str, Any]:
    """The Chat Completions body for a Responses body (token fields are the addon's to add)."""
    instructions = body.get("instructions")
    if not isinstance(instructions, str | None):
        raise native.BadRequest("'instructions' must be a string")
    chat: dict[str, Any] = {"messages": native.merge_system(_messages(body.get("input")), [instructions or ""])}
    if model := options.model or body.get("model"):
        chat["model"] = model
    chat["stream"] = body.get("stream") is True
    tools = [_tool(t) for t in body.get("tools") or [] if isinstance(t, dict) and t.get("type") == "function"]
    if tools:  # SGLang rejects a tool_choice without tools, and hosted tools have no chat equivalent
        chat["tools"] = tools
        if (choice := _tool_choice(body.get("tool_choice"))) is not None:
            chat["tool_choice"] = choice
        if isinstance(body.get("parallel_tool_calls"), bool):
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    fmt = (body.get("text") or {}).get("format") or {}
    if fmt.get("type") == "json_schema":
        keys = ("name", "schema", "strict", "description")
        chat["response_format"] = {"type": "json_schema", "json_schema": {k: fmt[k] for k in keys if k in fmt}}
    elif fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    kwargs = dict(body.get("chat_template_kwargs") or {})  # vLLM's extension, passed on when a client sends it
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and "enable_thinking" not in kwargs:
        kwargs["enable_thinking"] = reasoning.get("effort") != "none"
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    return chat


def _messages(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise native.BadRequest("'input' must be a string or an array of items")
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None  # decoded from reasoning items, for the next assistant message
    joinable = False  # the last message is an assistant turn that a following tool call belongs to
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise native.BadRequest(f"input[{i}]: each 'input' item must be an object", param=f"input[{i}]")
        kind = item.get("type") or "message"  # an easy input message has no type
        if kind == "reasoning":
            text = _reasoning_text(item)
            reasoning = text if reasoning is None else reasoning + (text or "")
            joinable = False
        elif kind in ("function_call", "local_shell_call"):
            if not joinable:
                messages.append(_assistant(None, reasoning))
                reasoning = None
            messages[-1].setdefault("tool_calls", []).append(_tool_call(item))
            joinable = True
        elif kind in ("function_call_output", "local_shell_call_output"):
            call_id = item.get("call_id") or item.get("id")
            messages.append(
                {"role": "tool", "tool_call_id": call_id, "content": _content(item.get("output"), f"input[{i}].output")}
            )
            joinable = False
        elif kind == "message" and item.get("role") == "assistant":
            messages.append(_assistant(native.text_of(item.get("content")), reasoning))
            reasoning, joinable = None, True
        elif kind == "message" and item.get("role") in ("user", "system", "developer"):
            messages.append({"role": item["role"], "content": _content(item.get("content"), f"input[{i}].content")})
            joinable = False
        elif kind == "item_reference":
            raise native.BadRequest(
                f"input[{i}]: 'item_reference' needs items stored by the server, and this proxy keeps none",
                param=f"input[{i}]",
            )
        else:
            raise native.BadRequest(
                f"input[{i}]: items of type {kind!r} (role {item.get('role')!r}) cannot be translated",
                param=f"input[{i}]",
            )
    return messages


def _reasoning_text(item: dict[str, Any]) -> str | None:
    """The reasoning text of an item: our own encrypted_content, else its raw reasoning_text (someone else's
    encrypted_content is opaque to us, and a summary is not what the model sampled)."""
    if item.get("encrypted_content"):
        return native.read_reasoning(item["encrypted_content"])
    parts = [p for p in item.get("content") or [] if isinstance(p, dict) and p.get("type") == "reasoning_text"]
    return native.text_of(parts) if parts else None


def _assistant(content: str | None, reasoning: str | None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if reasoning is not None:
        message["reasoning"] = reasoning  # vLLM's name; it renders it as the turn's thinking
    return message


def _tool_call(item: dict[str, Any]) -> dict[str, Any]:
    name: str | None
    arguments: str | None
    if item["type"] == "local_shell_call":
        action = {k: v for k, v in (item.get("action") or {}).items() if k != "type"}
        name, arguments = LOCAL_SHELL, json.dumps(action, ensure_ascii=False)
    else:
        name, arguments = item.get("name"), item.get("arguments")
    return {"id": item.get("call_id"), "type": "function", "function": {"name": name, "arguments": arguments or "{}"}}


def _content(content: Any, where: str) -> Any:
    """Chat content for Responses content: a string, or parts (text only: one string, as templates expect)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise native.BadRequest(f"{where}: must be a string or an array of parts", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": part.get("text") or part.get("refusal") or ""})
        elif kind == "input_image" and part.get("image_url"):
            parts.append(
                {"type": "image_url", "image_url": {"url": part["image_url"], "detail": part.get("detail") or "auto"}}
            )
        else:
            raise native.BadRequest(
                f"{where}[{j}]: content parts of type {kind!r} cannot be translated", param=f"{where}[{j}]"
            )
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return None  # a hosted tool or an allowed_tools subset: Chat Completions cannot say that


# --- answer -------------------------------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class _Answer:
    """The Responses answer as the upstream's chat chunks arrive: output items, events, the final object.

    One output item is open at a time; a chunk for another one closes it, as OpenAI streams items in order.
    ``quiet`` builds the object without serialising events (the non-streamed answer).
    """

    def __init__(self, body: dict[str, Any], *, quiet: bool = False) -> None:
        self.quiet = quiet
        self.mint = "reasoning.encrypted_content" in (body.get("include") or [])
        self.response: dict[str, Any] = {
            "id": _id("resp"),
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": body.get("model"),  # the harness sees the model it asked for
            "output": [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "reasoning": body.get("reasoning"),
            "store": body.get("store", False),
            "temperature": body.get("temperature"),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [],
            "top_p": body.get("top_p"),
            "truncation": body.get("truncation") or "disabled",
            "usage": None,
            "metadata": body.get("metadata") or {},
        }
        self.seq = 0
        self.out: list[bytes] = []
        self.started = False
        self.open: tuple[str, int] | None = None  # ("reasoning" | "message" | "call", chat tool-call index)
        self.texts: dict[int, str] = {}  # output index -> reasoning or message text so far
        self.tool_calls = native.ToolCalls()
        self.calls: dict[int, int] = {}  # chat tool-call index -> output index
        self.finish_reason: str | None = None
        self.ended = False  # the closing events went out

    def emit(self, kind: str, **fields: Any) -> None:
        if not self.quiet:
            self.out.append(native.sse(kind, {"type": kind, "sequence_number": self.seq, **fields}))
        self.seq += 1

    def begin(self) -> None:
        if not self.started:
            self.started = True
            self.emit("response.created", response=self.response)
            self.emit("response.in_progress", response=self.response)

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        self.begin()
        if chunk.get("usage"):
            self.response["usage"] = _usage(chunk["usage"])
        if (delta := native.chat_delta(chunk)) is not None:
            if delta.reasoning:
                self.text("reasoning", delta.reasoning)
            if delta.content:
                self.text("message", delta.content)
            for piece in delta.tool_calls:
                self.call(piece)
            self.finish_reason = delta.finish_reason or self.finish_reason
        out, self.out = self.out, []
        return out

    def add(self, key: tuple[str, int], item: dict[str, Any]) -> int:
        if self.open is not None:
            self.close()
        self.open, index = key, len(self.response["output"])
        self.response["output"].append(item)
        self.emit("response.output_item.added", output_index=index, item=item)
        return index

    def text(self, kind: str, delta: str) -> None:
        index = len(self.response["output"]) - 1
        if self.open != (kind, 0):
            if kind == "reasoning":
                index = self.add((kind, 0), {"id": _id("rs"), "type": "reasoning", "summary": [], "content": []})
            else:
                item = {
                    "id": _id("msg"),
                    "type": "message",
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [],
                }
                index = self.add((kind, 0), item)
                self.emit(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=_text_part(""),
                )
            self.texts[index] = ""
        self.texts[index] += delta
        item_id = self.response["output"][index]["id"]
        if kind == "reasoning":
            self.emit(
                "response.reasoning_text.delta", item_id=item_id, output_index=index, content_index=0, delta=delta
            )
        else:
            self.emit(
                "response.output_text.delta",
                item_id=item_id,
                output_index=index,
                content_index=0,
                delta=delta,
                logprobs=[],
            )

    def call(self, piece: dict[str, Any]) -> None:
        index, call = self.tool_calls.add(piece)
        if self.open != ("call", index):
            if index in self.calls:
                raise ValueError(f"the upstream continued tool call {index} after another output had begun")
            item = {
                "id": _id("fc"),
                "type": "function_call",
                "status": "in_progress",
                "arguments": "",
                "call_id": call.id or _id("call"),
                "name": call.name,
            }
            self.calls[index] = self.add(("call", index), item)
        item = self.response["output"][-1]
        item["name"] = call.name
        if arguments := call.unsent():
            item["arguments"] += arguments
            self.emit(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=self.calls[index],
                delta=arguments,
            )

    def close(self) -> None:
        """Finish the open item: its done events, with what the model produced in it."""
        assert self.open is not None
        kind, index = self.open[0], len(self.response["output"]) - 1
        item = self.response["output"][index]
        status = "incomplete" if self.finish_reason in _INCOMPLETE else "completed"
        if kind == "reasoning":
            text = self.texts[index]
            self.emit(
                "response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0, text=text
            )
            item["content"] = [{"type": "reasoning_text", "text": text}]
            if self.mint:
                item["encrypted_content"] = native.mint_reasoning(text)
        elif kind == "message":
            text, part = self.texts[index], _text_part(self.texts[index])
            self.emit(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            )
            self.emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
            item.update(content=[part], status=status)
        else:
            self.emit(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=item["arguments"],
                name=item["name"],
            )
            item["status"] = status
        self.emit("response.output_item.done", output_index=index, item=item)
        self.open = None

    def finish(self, complete: bool, message: str | None = None) -> list[bytes]:
        """The closing events; a stream that ended without a finish reason broke, whatever the transport said
        (``message``: why, when the upstream broke it off)."""
        if self.ended:
            return []
        self.ended = True
        self.begin()
        if complete and self.finish_reason is not None:
            if self.open is not None:
                self.close()
            reason = _INCOMPLETE.get(self.finish_reason)
            self.response["status"] = "incomplete" if reason else "completed"
            self.response["incomplete_details"] = {"reason": reason} if reason else None
            self.emit("response.incomplete" if reason else "response.completed", response=self.response)
        else:
            message = message or "the upstream stream ended before the model finished its answer"
            self.response.update(status="failed", error={"code": "server_error", "message": message})
            self.emit("response.failed", response=self.response)
        out, self.out = self.out, []
        return out


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            "cache_write_tokens": 0,
        },
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
        },
        "total_tokens": usage.get("total_tokens") or prompt + completion,
    }


# --- an answer recorded untranslated, back to Chat Completions (reconstruction) ------------------------------


def to_chat_completion(text: str, streamed: bool) -> dict[str, Any] | None:
    """A Responses answer (vLLM's own /v1/responses, or OpenAI's) as a ``chat.completion`` (contract: native.py).

    Token ids only where the answer has them: vLLM with ``enable_response_messages`` puts the prompt's and the
    sampled ids on the final response object (``input_messages`` / ``output_messages``, ``raw_message_tokens``),
    and ``include: ["message.output_text.logprobs"]`` the log-probs of the output text (see
    :func:`vllm_token_fields`); they are kept when they cover every sampled token.
    """
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
            calls.append(native.chat_tool_call(item.get("call_id"), item.get("name"), item.get("arguments")))
    incomplete = response.get("status") == "incomplete"
    finish = "length" if incomplete else "tool_calls" if calls else "stop"
    usage = u if isinstance(u := response.get("usage"), dict) else {}
    counts = {"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens")}
    body = native.chat_completion(content, reasoning, calls, finish, counts, response.get("model"))
    prompt, sampled = _raw_tokens(response.get("input_messages")), _raw_tokens(response.get("output_messages"))
    if prompt and sampled:
        body["prompt_token_ids"] = prompt
        body["choices"][0]["token_ids"] = sampled
        # Only text has log-probs in the Responses API: with reasoning or tool calls they cover part of the ids,
        # and a call then has none (the trainer recomputes them).
        if len(logprobs) == len(sampled):
            body["choices"][0]["logprobs"] = {"content": logprobs}
    return body


def _final_response(text: str, streamed: bool) -> dict[str, Any] | None:
    if not streamed:
        return native.json_object(text)
    final = None
    for event in native.sse_payloads(text):
        done = ("response.completed", "response.incomplete", "response.failed")
        if isinstance(event, dict) and event.get("type") in done and isinstance(event.get("response"), dict):
            final = event["response"]
    return final


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
