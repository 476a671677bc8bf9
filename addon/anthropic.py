"""Anthropic Messages ⇄ Chat Completions: Claude Code's wire API, answered by a vLLM/SGLang upstream.

``start`` maps a ``POST /v1/messages`` body onto one Chat Completions request (contract: addon/native.py);
:class:`MessagesTranslation` turns each streamed chunk into the Anthropic events it completes, as it
arrives; a buffered ``chat.completion`` is the same machine fed one chunk (``native.answer_chunk``), so a
non-streamed Message is what the events add up to.

Choices beyond renaming:

- Every system text (``system``, Claude Code's mid-conversation ``role:"system"`` messages) goes
  into one leading system message, without the per-request ``x-anthropic-billing-header:`` line:
  it changes every turn and would break the prompt prefix that consecutive calls share.
- Reasoning: answers carry thinking blocks signed with :func:`native.mint_reasoning`; one sent back
  is decoded into the assistant message's ``reasoning`` (what vLLM renders), so the next prompt holds
  the tokens the model sampled. A signature the addon did not mint is opaque to it and dropped.
- Images become ``image_url`` parts: a multimodal upstream sees them, a text-only one answers 400
  (in Anthropic's shape). Images in a ``tool_result`` follow the tool messages in a user message,
  as tool messages carry text. A failed tool result is prefixed ``[Tool Error]``, having no flag.
- Tools without an ``input_schema`` (server tools: web search & co.) are dropped, and
  ``tool_choice`` with them when no tool is left.
- ``/v1/messages/count_tokens`` is answered here: the addon has no tokenizer, so it estimates one
  token per four characters of text and tool schemas (images not counted).
- Context-length errors are worded as Anthropic words them, which is what makes Claude Code compact
  (``prompt is too long: N tokens > M maximum``) or lower ``max_tokens`` (``input length and
  `max_tokens` exceed context limit: P + C > M``).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from addon import native

BILLING_PREFIX = "x-anthropic-billing-header:"
CHARS_PER_TOKEN = 4
SAMPLING = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
            "stop_sequences": "stop"}  # fmt: skip
TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               504: "timeout_error", 529: "overloaded_error"}  # fmt: skip
# Context-length errors of vLLM (old and new wording, engine) and SGLang: limit, prompt and completion sizes.
_LIMIT = re.compile(r"maximum (?:context|model) length (?:is |of )?(\d+)|context length \((\d+) tokens\)")
_PROMPT = re.compile(
    r"(\d+) in the messages|has (\d+) input tokens|contains at least (\d+) input tokens|[Pp]rompt \(length (\d+)\)"
    r"|[Pp]rompt length of (\d+)"
    r"|(\d+) tokens from the input|input \((\d+) tokens\)"
)
_COMPLETION = re.compile(r"(\d+) in the completion|is too large: (\d+)|(\d+) tokens for the completion")

# The fields the translation reads, by kind (native.mismatch): anything else of the wrong kind is a 400 naming it.
_SOURCE = {"type": str, "media_type": str, "data": str, "url": str}
_PART = {"type": str, "text": str, "source": _SOURCE}  # text, image and document blocks
_BLOCK = {**_PART, "id": str, "name": str, "input": dict, "thinking": str, "signature": str, "data": str,
          "tool_use_id": str, "is_error": bool, "content": native.OneOf(str, [_PART])}  # fmt: skip
REQUEST = {
    "model": str, "stream": bool, "max_tokens": native.INTEGER, "temperature": native.NUMBER, "top_p": native.NUMBER,
    "top_k": native.INTEGER, "stop_sequences": [str], "system": native.OneOf(str, [{"type": str, "text": str}]),
    "messages": [{"role": str, "content": native.OneOf(str, [_BLOCK])}],
    "tools": [{"type": str, "name": str, "description": str, "input_schema": dict}],
    "tool_choice": {"type": str, "name": str, "disable_parallel_tool_use": bool},
    "thinking": {"type": str, "budget_tokens": native.INTEGER}, "chat_template_kwargs": dict,
}  # fmt: skip


def start(
    body: dict[str, Any], path: str, headers: dict[str, str], options: native.Options
) -> MessagesTranslation | native.LocalAnswer:
    route = path.partition("?")[0].rstrip("/")
    if found := native.mismatch(body, REQUEST):
        where = ".".join(map(str, found.path)) or "body"
        raise native.BadRequest(f"{where}: expected {found.expected}, got {found.got}", param=where)
    if route.endswith("/messages/count_tokens"):
        return native.LocalAnswer(200, {"input_tokens": estimate_tokens(chat_request(body, options))})
    if not route.endswith("/messages"):
        raise native.BadRequest(f"polar translates /v1/messages and /v1/messages/count_tokens only, not {route}")
    return MessagesTranslation(body, chat_request(body, options))


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """Anthropic's error shape (it names no field: ``param`` is not used)."""
    kind = ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    if status < 500 and (overflow := context_overflow(message)):
        kind, message = "invalid_request_error", overflow
    return {"type": "error", "error": {"type": kind, "message": message}}


def context_overflow(message: str) -> str | None:
    """Anthropic's wording of an upstream context-length error, or None when ``message`` is not one."""
    limit, prompt, completion = (_number(p, message) for p in (_LIMIT, _PROMPT, _COMPLETION))
    if limit is None or prompt is None:
        return None
    if completion is not None and prompt < limit:  # the prompt fits; prompt plus max_tokens does not
        return (
            f"input length and `max_tokens` exceed context limit: {prompt} + {completion} > {limit}, "
            "decrease input length or `max_tokens` and try again"
        )
    return f"prompt is too long: {prompt} tokens > {limit} maximum"


def _number(pattern: re.Pattern[str], text: str) -> int | None:
    found = pattern.search(text)
    return int(next(g for g in found.groups() if g)) if found else None


# --- request --------------------------------------------------------------------------------------


def chat_request(body: dict[str, Any], options: native.Options) -> dict[str, Any]:
    """The Chat Completions body for an Anthropic Messages body (without the token fields)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise native.BadRequest("messages: must be a non-empty array of objects")
    # vLLM renders an assistant message's `reasoning`; SGLang its `reasoning_content`.
    reasoning = "reasoning_content" if options.upstream == "sglang" else "reasoning"
    chat = [m for i, message in enumerate(messages) for m in _message(message, i, reasoning)]
    out: dict[str, Any] = {"messages": native.merge_system(chat, _instructions(body.get("system")))}
    if model := options.model or body.get("model"):
        out["model"] = model
    if body.get("stream") is True:
        out["stream"] = True
    if tools := [_tool(t) for t in body.get("tools") or [] if isinstance(t, dict) and "input_schema" in t]:
        # Only with tools: Claude Code sends tools=[] when it compacts, and SGLang refuses a lone tool_choice.
        out |= {"tools": tools, **_tool_choice(body.get("tool_choice"))}
    out |= {chat_name: body[name] for name, chat_name in SAMPLING.items() if body.get(name) is not None}
    kwargs = body.get("chat_template_kwargs")  # vLLM's own extension of Messages
    kwargs, thinking = dict(kwargs if isinstance(kwargs, dict) else {}), body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive", "disabled"):
        kwargs.setdefault("enable_thinking", thinking["type"] != "disabled")
    if kwargs:
        out["chat_template_kwargs"] = kwargs
    if chat and chat[-1]["role"] == "assistant":  # a prefilled answer: the model continues it
        out |= {"continue_final_message": True, "add_generation_prompt": False}
    return out


def _instructions(system: Any) -> list[str]:
    """The system texts; Claude Code puts its billing line first, in the first block."""
    if isinstance(system, str):
        texts = [system]
    else:
        texts = [b.get("text") or "" for b in system or [] if isinstance(b, dict) and b.get("type") == "text"]
    if texts and texts[0].startswith(BILLING_PREFIX):
        texts[0] = texts[0].partition("\n")[2]
    return texts


def _message(message: dict[str, Any], i: int, reasoning: str) -> list[dict[str, Any]]:
    role, content = message.get("role"), message.get("content")
    if role == "system":  # Claude Code's mid-conversation system message; merge_system moves it up
        return [{"role": "system", "content": native.text_of(content)}]
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks):
        raise native.BadRequest(f"messages.{i}.content: must be a string or an array of content blocks")
    if role == "assistant":
        return [_assistant(blocks, i, reasoning)]
    if role == "user":
        return _user(blocks, i)
    raise native.BadRequest(f"messages.{i}.role: must be user, assistant or system, not {role!r}")


def _assistant(blocks: list[dict[str, Any]], i: int, reasoning_field: str) -> dict[str, Any]:
    text, reasoning, calls = [], [], []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            text.append(block.get("text") or "")
        elif kind in ("thinking", "redacted_thinking"):
            decoded = native.read_reasoning(block.get("signature" if kind == "thinking" else "data"))
            reasoning += [decoded] if decoded is not None else []
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            function = {"name": block.get("name"), "arguments": arguments}
            calls.append({"id": block.get("id"), "type": "function", "function": function})
        else:
            raise native.BadRequest(f"messages.{i}.content: polar cannot translate assistant {kind!r} blocks")
    # No separator: text blocks are one answer's text, split by the stream around other blocks.
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if reasoning:
        message[reasoning_field] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[dict[str, Any]], i: int) -> list[dict[str, Any]]:
    """Tool results as ``tool`` messages (Anthropic puts them first too), then the rest as one user message."""
    tools, parts, tool_images = [], [], []
    for block in blocks:
        if block.get("type") == "tool_result":
            text, images = _tool_result(block, i)
            tools.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
            tool_images += images
        else:
            parts.append(_part(block, i))
    parts = tool_images + parts
    if len(parts) == 1 and parts[0]["type"] == "text":
        return [*tools, {"role": "user", "content": parts[0]["text"]}]
    return tools + ([{"role": "user", "content": parts}] if parts else [])


def _tool_result(block: dict[str, Any], i: int) -> tuple[str, list[dict[str, Any]]]:
    content = block.get("content")
    parts = [_part(b, i) for b in content if isinstance(b, dict)] if isinstance(content, list) else []
    text = content if isinstance(content, str) else "\n".join(p["text"] for p in parts if p["type"] == "text")
    if block.get("is_error"):
        text = f"[Tool Error] {text}"
    return text, [p for p in parts if p["type"] == "image_url"]


def _part(block: dict[str, Any], i: int) -> dict[str, Any]:
    """A user content block as a Chat Completions content part."""
    kind, source = block.get("type"), block.get("source") or {}
    if kind == "text":
        return {"type": "text", "text": block.get("text") or ""}
    if kind == "image" and source.get("type") in ("base64", "url"):
        url = source.get("url") or f"data:{source.get('media_type')};base64,{source.get('data')}"
        return {"type": "image_url", "image_url": {"url": url}}
    if kind == "document" and source.get("type") == "text":
        return {"type": "text", "text": source.get("data") or ""}
    what = f"{kind} blocks with a {source.get('type')} source" if source else f"{kind!r} blocks"
    raise native.BadRequest(f"messages.{i}.content: polar cannot translate {what}")


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    # vLLM renders a tool's keys as name, description, parameters, whatever order they came in (issue 15): the
    # same order here, so the prompt retokenized from the record is the prompt vLLM rendered.
    function: dict[str, Any] = {"name": tool.get("name")}
    if tool.get("description"):
        function["description"] = tool["description"]
    function["parameters"] = tool["input_schema"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> dict[str, Any]:
    if not isinstance(choice, dict):
        return {}
    out: dict[str, Any] = {}
    if choice.get("type") in TOOL_CHOICE:
        out["tool_choice"] = TOOL_CHOICE[choice["type"]]
    elif choice.get("type") == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def estimate_tokens(chat_body: dict[str, Any]) -> int:
    """Roughly how many tokens the prompt takes: its text and tool schemas over CHARS_PER_TOKEN."""
    chars = _text_length(chat_body["messages"]) + len(json.dumps(chat_body.get("tools") or "", ensure_ascii=False))
    return max(1, -(-chars // CHARS_PER_TOKEN))


def _text_length(value: Any) -> int:
    """Characters of message text: the string values, but not roles, ids or images."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        skip = ("role", "type", "id", "tool_call_id", "image_url")
        return sum(_text_length(v) for k, v in value.items() if k not in skip)
    return sum(map(_text_length, value)) if isinstance(value, list) else 0


# --- answer ---------------------------------------------------------------------------------------


class MessagesTranslation:
    """One Messages call: the upstream request, and its answer turned into Anthropic's format."""

    def __init__(self, body: dict[str, Any], chat_body: dict[str, Any]) -> None:
        self.chat_body = chat_body
        self.stream = chat_body.get("stream") is True
        self.model = body.get("model") or chat_body.get("model") or ""  # the harness sees what it asked for
        self.stops = chat_body.get("stop") or []
        self._message = _Message(self.model, self.stops)

    def events(self, chunk: dict[str, Any]) -> bytes:
        return b"".join(self._message.feed(chunk))

    def finish(self, complete: bool, message: str | None = None) -> bytes:
        return b"".join(self._message.finish(complete, message))

    def answer(self, response: dict[str, Any]) -> dict[str, Any]:
        message = _Message(self.model, self.stops)
        message.feed(native.answer_chunk(response))
        message.end()
        return message.body()

    def error(self, status: int, message: str) -> dict[str, Any]:
        return error_body(status, message)


class _Message:
    """The Message as the upstream's chat chunks arrive: its events, and the Message they add up to.

    One content block is open at a time (thinking, text, or one tool call); a chunk for another closes it.
    """

    def __init__(self, model: str, stops: list[str]) -> None:
        self.model = model
        self.stops = stops
        self.started = self.done = False
        self.id: Any = None  # the upstream's answer id
        self.content: list[dict[str, Any]] = []  # the blocks so far; the last one is the open one, if any
        self.open: Any = None  # the open block: "thinking", "text", or a tool call's upstream index
        self.texts: list[str] = []  # the open thinking or text block's text so far, set on it when it closes
        self.calls = native.ToolCalls()
        self.inputs: dict[int, int] = {}  # upstream tool-call index -> its tool_use block's index in content
        self.finish_reason: str | None = None
        self.matched: Any = None  # vLLM's stop_reason: the stop string that ended the answer, if one did
        self.prompt_tokens = self.output_tokens = 0
        self.usage: dict[str, Any] | None = None

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        if self.done:
            return []
        if chunk.get("error") or chunk.get("object") == "error":  # how vLLM reports a failure mid-stream
            error = chunk["error"] if isinstance(chunk.get("error"), dict) else chunk
            code = error.get("code")
            return self._fail(code if isinstance(code, int) and 400 <= code < 600 else 500, str(error.get("message")))
        out = [] if self.started else self._message_start(chunk)
        if (delta := native.chat_delta(chunk)) is not None:
            self.output_tokens += delta.token_count
            if delta.reasoning:
                out += self._text("thinking", delta.reasoning)
            if delta.content:
                out += self._text("text", delta.content)
            for piece in delta.tool_calls:
                out += self._tool_call(piece)
            if delta.finish_reason:
                self.finish_reason, self.matched = delta.finish_reason, delta.stop_reason
        if chunk.get("usage"):
            self.usage = chunk["usage"]
            if self.finish_reason and not chunk.get("choices"):  # the usage chunk closes the stream
                out += self.end()
        return out

    def finish(self, complete: bool, message: str | None = None) -> list[bytes]:
        if self.done:
            return []
        if complete and self.finish_reason:  # no usage chunk came
            return self.end()
        if complete:
            return self._fail(502, "the upstream stream ended before the answer was complete")
        return self._fail(502, message) if message else self._fail(500, "polar could not translate the upstream stream")

    def end(self) -> list[bytes]:
        """The closing events: the open block's end, the stop reason and usage, message_stop."""
        self.done = True
        reason, sequence = self._stop()
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        usage = _usage(self.usage, self.prompt_tokens, self.output_tokens)
        return [
            *self._close_block(),
            native.sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}),
            native.sse("message_stop", {"type": "message_stop"}),
        ]

    def body(self) -> dict[str, Any]:
        """The Message the events added up to, once they ended, as a non-streamed answer carries it (tool inputs
        parsed)."""
        content = [dict(block) for block in self.content]
        for index, at in self.inputs.items():
            content[at]["input"] = _arguments(self.calls.calls[index].arguments)
        usage = _usage(self.usage, self.prompt_tokens, self.output_tokens)
        return {**self._message(content, *self._stop()), "usage": usage}

    def _stop(self) -> tuple[str | None, str | None]:
        return _stop_reason(self.finish_reason, self.matched, self.stops, bool(self.calls))

    def _message(self, content: list[Any], reason: Any, sequence: Any) -> dict[str, Any]:
        return {
            "id": _native_id("msg_", self.id),
            "type": "message",
            "role": "assistant",
            "content": content,
            "model": self.model,
            "stop_reason": reason,
            "stop_sequence": sequence,
        }

    def _message_start(self, chunk: dict[str, Any]) -> list[bytes]:
        self.started, self.id = True, chunk.get("id")
        self.prompt_tokens = len(chunk.get("prompt_token_ids") or [])  # on vLLM's first chunk
        message = {**self._message([], None, None), "usage": _usage(None, self.prompt_tokens, 0)}
        start = native.sse("message_start", {"type": "message_start", "message": message})
        return [start, native.sse("ping", {"type": "ping"})]

    def _fail(self, status: int, message: str) -> list[bytes]:
        self.done = True
        return [native.sse("error", error_body(status, message))]

    def _open_block(self, key: Any, block: dict[str, Any]) -> list[bytes]:
        out = self._close_block()
        self.open = key
        event = {"type": "content_block_start", "index": len(self.content), "content_block": block}
        start = native.sse("content_block_start", event)
        self.content.append(block)  # filled in as it closes: the event above went out with the empty block
        return [*out, start]

    def _close_block(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open in ("thinking", "text"):
            block = self.content[-1]
            block[self.open] = "".join(self.texts)
            if self.open == "thinking":  # the signature carries the whole thinking text back next turn
                block["signature"] = native.mint_reasoning(block["thinking"])
                out.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        self.open, self.texts = None, []
        return [*out, native.sse("content_block_stop", {"type": "content_block_stop", "index": len(self.content) - 1})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        event = {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}
        return native.sse("content_block_delta", event)

    def _text(self, kind: str, text: str) -> list[bytes]:
        out = []
        if self.open != kind:
            out = self._open_block(kind, {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {}))
        self.texts.append(text)
        return [*out, self._delta({"type": f"{kind}_delta", kind: text})]

    def _tool_call(self, piece: dict[str, Any]) -> list[bytes]:
        """A piece of a streamed tool call. Its block starts once the name is known (the start event names the
        tool; vLLM and SGLang send it first anyway); argument text goes out as it comes."""
        index, call = self.calls.add(piece)
        out = []
        if index not in self.inputs:
            if not call.name:
                return []
            block = {"type": "tool_use", "id": _native_id("toolu_", call.id), "name": call.name, "input": {}}
            out = self._open_block(index, block)
            self.inputs[index] = len(self.content) - 1
        elif self.open != index:
            raise ValueError(f"the upstream went back to tool call {index} after its block was closed")
        if pending := call.unsent():
            out.append(self._delta({"type": "input_json_delta", "partial_json": pending}))
        return out


def _stop_reason(finish: Any, matched: Any, stops: list[str], called: bool) -> tuple[str | None, str | None]:
    if finish is None:
        return None, None
    if finish == "stop" and isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    if called and finish in ("stop", "tool_calls"):
        return "tool_use", None
    return STOP_REASONS.get(finish, "end_turn"), None


def _usage(usage: dict[str, Any] | None, prompt: int, output: int) -> dict[str, int]:
    """Anthropic's usage from the upstream's; without one, from the token ids counted."""
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    # Anthropic counts cache reads apart from input_tokens.
    return {
        "input_tokens": usage.get("prompt_tokens", prompt) - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": usage.get("completion_tokens", output),
    }


def _arguments(text: Any) -> dict[str, Any]:
    """A tool call's input: Anthropic's is an object, the upstream's is JSON text."""
    value = json.loads(text) if isinstance(text, str) and text.strip() else text or {}
    if not isinstance(value, dict):
        raise ValueError(f"tool call arguments are not a JSON object: {str(text)[:200]}")
    return value


def _native_id(prefix: str, upstream_id: Any) -> str:
    """An Anthropic-style id made from the upstream's, so a harness transcript can be matched to its record."""
    given = upstream_id if isinstance(upstream_id, str) else ""
    tail = re.sub(r"^(chatcmpl-tool-|chatcmpl-|call_|toolu_|msg_)", "", given)
    return prefix + (re.sub(r"[^A-Za-z0-9]", "", tail) or uuid.uuid4().hex[:24])


# --- an answer recorded untranslated, back to Chat Completions (reconstruction) ------------------------------


_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "tool_use": "tool_calls", "max_tokens": "length"}


def to_chat_completion(text: str, streamed: bool) -> dict[str, Any] | None:
    """A Messages answer, streamed or not, as a ``chat.completion`` (contract: native.py)."""
    message = _streamed_message(native.sse_payloads(text)) if streamed else native.json_object(text)
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
            calls.append(native.chat_tool_call(block.get("id"), block.get("name"), block.get("input")))
    usage = u if isinstance(u := message.get("usage"), dict) else {}
    counts = {"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens")}
    finish = _FINISH.get(str(message.get("stop_reason")))
    return native.chat_completion(content, reasoning, calls, finish, counts, message.get("model"))


def _streamed_message(events: list[Any]) -> dict[str, Any] | None:
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
                block["input"] = json.loads(block["partial_json"])
            except ValueError:
                block["input"] = block["partial_json"]  # kept as sent: the call was cut off
        message["content"].append(block)
    return message
