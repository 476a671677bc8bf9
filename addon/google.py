"""Google Gemini ``generateContent`` / ``streamGenerateContent`` ⇄ Chat Completions (what Gemini CLI speaks).

``POST /v1beta/models/<model>:generateContent`` answers one ``GenerateContentResponse``;
``:streamGenerateContent?alt=sse`` answers ``data: {GenerateContentResponse}`` events, which is what
the google-genai SDKs (Python, JS) and Gemini CLI use. Without ``alt=sse`` Google streams one JSON
array instead; no SDK asks for that, and the addon answers every stream as ``text/event-stream``,
so such a request gets a 400 that says to add ``alt=sse``. Field names may come in camelCase or
snake_case: Google takes both, and the Python SDK sends thinkingConfig's in snake_case.

Gemini has no tool-call ids. Calls get ids from their place in ``contents`` (the same every turn),
and each ``functionResponse`` answers the call with its ``id`` if it names one, else the first
unanswered call of its name. Reasoning travels in ``thoughtSignature``: the addon signs the full
reasoning text (:func:`mint_signature`) onto the first non-thought part, because Gemini CLI keeps
that part in its history and drops thought parts; the signature sent back becomes the assistant
message's ``reasoning``, so the next prompt re-renders the tokens the model sampled. Thought
parts themselves go out only when ``thinkingConfig.includeThoughts`` asks for them, as Gemini does.
A non-streamed answer is the stream machine fed one chunk (``native.answer_chunk``): its parts are the events'.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import uuid
from typing import Any
from urllib.parse import unquote

from addon import native

# HTTP status -> google.rpc status name, as Google's own error bodies pair them.
STATUS_NAMES = {
    400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND", 409: "ABORTED",
    429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 500: "INTERNAL", 501: "UNIMPLEMENTED", 502: "UNAVAILABLE",
    503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
}  # fmt: skip
FINISH_REASONS = {
    "stop": "STOP",
    "tool_calls": "STOP",
    "function_call": "STOP",
    "length": "MAX_TOKENS",
    "content_filter": "SAFETY",
}
TOOL_CHOICE = {"AUTO": "auto", "ANY": "required", "NONE": "none", "VALIDATED": "auto"}
# Part fields that carry no content of their own.
PART_METADATA = {"thought", "thoughtSignature", "partMetadata", "videoMetadata", "mediaResolution"}
# Schema keywords whose values are data, not schemas: left as they are when types are lower-cased.
SCHEMA_DATA = {"enum", "default", "example", "examples", "const", "required", "propertyOrdering", "format", "pattern"}
SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions"}
GENERATION = {  # generationConfig field -> Chat Completions field
    "maxOutputTokens": "max_tokens", "temperature": "temperature", "topP": "top_p", "topK": "top_k",
    "stopSequences": "stop", "seed": "seed",
    "presencePenalty": "presence_penalty", "frequencyPenalty": "frequency_penalty",
}  # fmt: skip
_URLSAFE = str.maketrans("-_", "+/")
_SNAKE = re.compile(r"_([a-z])")

# The fields the translation reads, by kind (native.mismatch, on camelCase names): anything else of the wrong kind
# is a 400 naming it.
_PART = {"text": str, "thought": bool, "thoughtSignature": str, "functionCall": {"name": str, "id": str, "args": dict},
         "functionResponse": {"name": str, "id": str, "response": dict},
         "inlineData": {"mimeType": str, "data": str}}  # fmt: skip
_CONTENT = {"role": str, "parts": [_PART]}
REQUEST = {
    "contents": [_CONTENT], "systemInstruction": native.OneOf(str, _CONTENT), "cachedContent": str,
    "tools": [{"functionDeclarations": [
        {"name": str, "description": str, "parameters": dict, "parametersJsonSchema": dict},
    ]}],
    "toolConfig": {"functionCallingConfig": {"mode": str, "allowedFunctionNames": [str]}},
    "generationConfig": {
        "maxOutputTokens": native.INTEGER, "temperature": native.NUMBER, "topP": native.NUMBER, "topK": native.NUMBER,
        "stopSequences": [str], "seed": native.INTEGER, "presencePenalty": native.NUMBER,
        "frequencyPenalty": native.NUMBER, "candidateCount": native.INTEGER, "responseMimeType": str,
        "responseSchema": dict, "thinkingConfig": {"includeThoughts": bool, "thinkingBudget": native.INTEGER},
    },
}  # fmt: skip


def start(body: dict[str, Any], path: str, headers: dict[str, str], options: native.Options) -> Translation:
    model, stream = _parse_path(path)
    if found := native.mismatch(body, REQUEST, _fields):
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in found.path).lstrip(".") or "body"
        raise native.BadRequest(f"Invalid value at '{where}': expected {found.expected}, got {found.got}", param=where)
    body = _fields(body)
    if body.get("cachedContent"):
        raise native.BadRequest("cachedContent is not supported: send the contents themselves")
    chat: dict[str, Any] = {"model": options.model or model, "messages": _messages(body)}
    if stream:
        chat["stream"] = True
    if tools := _tools(body.get("tools")):
        chat["tools"] = tools  # and a tool_choice only with them: SGLang refuses one without tools
        if choice := _tool_choice(_fields(_fields(body.get("toolConfig")).get("functionCallingConfig"))):
            chat["tool_choice"] = choice
    config = _fields(body.get("generationConfig"))
    thinking = _fields(config.get("thinkingConfig"))
    _generation(config, thinking, chat)
    return Translation(chat, stream, model, include_thoughts=thinking.get("includeThoughts") is True)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """google.rpc's error shape (``param`` is not used: the message names the field)."""
    name = STATUS_NAMES.get(status) or ("INTERNAL" if status >= 500 else "INVALID_ARGUMENT")
    return {"error": {"code": status, "message": message, "status": name}}


def mint_signature(reasoning: str) -> str:
    """A thoughtSignature carrying ``reasoning``: native's token, base64-encoded once more.

    The field is proto ``bytes``, so clients hold it as base64: the google-genai SDK decodes it
    on receipt (a ":" fails its validation) and re-encodes it URL-safe when sending it back.
    """
    return base64.b64encode(native.mint_reasoning(reasoning).encode("ascii")).decode("ascii")


def read_signature(signature: Any) -> str | None:
    """The reasoning in a signature from :func:`mint_signature`, in either base64 alphabet; None for others'."""
    if not isinstance(signature, str):
        return None
    try:
        token = base64.b64decode(signature.translate(_URLSAFE) + "=" * (-len(signature) % 4), validate=True)
        return native.read_reasoning(token.decode("ascii"))
    except (binascii.Error, ValueError):
        return None


def _fields(value: Any) -> dict[str, Any]:
    """An object's fields by their camelCase names. Google accepts snake_case too, and the Python SDK
    sends some nested configs (thinkingConfig) that way. Only field names: never args or schemas."""
    if not isinstance(value, dict):
        return {}
    return {_SNAKE.sub(lambda m: m.group(1).upper(), k) if "_" in k else k: v for k, v in value.items()}


def _parse_path(path: str) -> tuple[str, bool]:
    """The model named in ``.../models/<model>:<method>`` and whether the method streams."""
    base, _, query = path.partition("?")
    name, _, method = unquote(base.rstrip("/").rsplit("/", 1)[-1]).rpartition(":")
    if method not in ("generateContent", "streamGenerateContent") or not name:
        raise native.BadRequest(f"expected .../models/<model>:generateContent or :streamGenerateContent, not {base}")
    stream = method == "streamGenerateContent"
    if stream and "alt=sse" not in query.split("&"):
        raise native.BadRequest("streamGenerateContent is answered as server-sent events only: add ?alt=sse")
    return name, stream


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    contents = body.get("contents")
    if not isinstance(contents, list) or not contents:
        raise native.BadRequest("contents must be a non-empty array")
    system = body.get("systemInstruction")
    instructions = (
        [system if isinstance(system, str) else _texts(_parts(system, "systemInstruction"))] if system else []
    )
    messages: list[dict[str, Any]] = []
    pending: list[tuple[str, str]] = []  # (id, name) of the last model turn's calls no response answered yet
    for i, content in enumerate(contents):
        role = (content.get("role") or "user") if isinstance(content, dict) else None
        if role == "model":
            message, pending = _model_message(_parts(content, f"contents[{i}]"), i)
            messages.append(message)
        elif role in ("user", "function"):  # "function": the v1beta role of old for functionResponse turns
            messages += _user_messages(_parts(content, f"contents[{i}]"), pending, i)
        elif role == "system":
            messages.append({"role": "system", "content": _texts(_parts(content, f"contents[{i}]"))})
        else:
            raise native.BadRequest(f"contents[{i}] must be an object with role user or model, not {role!r}")
    return native.merge_system(messages, instructions)


def _parts(content: Any, where: str) -> list[dict[str, Any]]:
    parts = _fields(content).get("parts")
    if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
        raise native.BadRequest(f"{where}.parts: each content needs parts, an array of objects", param=f"{where}.parts")
    return [_fields(p) for p in parts]


def _texts(parts: list[dict[str, Any]]) -> str:
    return "".join(p["text"] for p in parts if isinstance(p.get("text"), str) and not p.get("thought"))


def _model_message(parts: list[dict[str, Any]], index: int) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The assistant message for one model turn, and its calls awaiting a response."""
    signed: list[str] = []
    thoughts, calls = "", list[dict[str, Any]]()
    for part in parts:
        decoded = read_signature(part.get("thoughtSignature"))  # anyone else's signature: dropped
        if decoded is not None and decoded not in signed:
            signed.append(decoded)
        if part.get("thought"):
            thoughts += part.get("text") or ""
        elif "functionCall" in part:
            call = _fields(part["functionCall"])
            if not isinstance(call.get("name"), str):
                raise native.BadRequest(f"contents[{index}]: a functionCall needs a name")
            arguments = json.dumps(call.get("args") or {}, ensure_ascii=False)
            function = {"name": call["name"], "arguments": arguments}
            calls.append(
                {"id": call.get("id") or f"call_{index}_{len(calls)}", "type": "function", "function": function}
            )
        elif "text" not in part and set(part) - PART_METADATA:
            raise native.BadRequest(f"contents[{index}]: a model part with {sorted(part)} cannot be sent upstream")
    message: dict[str, Any] = {"role": "assistant", "content": _texts(parts) or None}
    # Our signature carries the full reasoning; thought text stands in when a client kept thoughts but
    # dropped signatures (our thought parts hold the whole text too, never a summary).
    if reasoning := "".join(signed) or thoughts:
        message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message, [(c["id"], c["function"]["name"]) for c in calls]


def _user_messages(parts: list[dict[str, Any]], pending: list[tuple[str, str]], index: int) -> list[dict[str, Any]]:
    """Tool messages for the turn's functionResponse parts, then one user message for the rest.

    Chat templates want tool results right after the calls, so they come first.
    """
    tools: list[dict[str, Any]] = []
    rest: list[dict[str, Any]] = []
    for part in parts:
        if "functionResponse" in part:
            response = _fields(part["functionResponse"])
            match = next((c for c in pending if c[0] == response.get("id")), None)
            match = match or next((c for c in pending if c[1] == response.get("name")), None)
            if match:
                pending.remove(match)
            call_id = match[0] if match else response.get("id") or f"call_{index}_r{len(tools)}"
            content = json.dumps(response.get("response") or {}, ensure_ascii=False)
            tools.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif isinstance(part.get("text"), str):
            rest += [] if part.get("thought") else [{"type": "text", "text": part["text"]}]
        elif str((data := _fields(part.get("inlineData"))).get("mimeType")).startswith("image/"):
            rest.append(
                {"type": "image_url", "image_url": {"url": f"data:{data['mimeType']};base64,{data.get('data', '')}"}}
            )
        elif set(part) - PART_METADATA:
            raise native.BadRequest(f"contents[{index}]: a part with {sorted(part)} cannot be sent upstream")
    if not rest:
        return tools
    if all(p["type"] == "text" for p in rest):
        return [*tools, {"role": "user", "content": "".join(p["text"] for p in rest)}]
    return [*tools, {"role": "user", "content": rest}]


def _tools(tools: Any) -> list[dict[str, Any]]:
    """Function declarations as Chat function tools; search, code execution & co. have no schema and are dropped."""
    out = []
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        for j, decl in enumerate(map(_fields, _fields(tool).get("functionDeclarations") or [])):
            if not isinstance(decl.get("name"), str):
                where = f"tools[{i}].functionDeclarations[{j}].name"
                raise native.BadRequest(f"{where}: each functionDeclaration needs a name", param=where)
            function = {k: decl[k] for k in ("name", "description") if decl.get(k) is not None}
            if decl.get("parametersJsonSchema") is not None:
                function["parameters"] = decl["parametersJsonSchema"]
            elif decl.get("parameters") is not None:
                function["parameters"] = _schema(decl["parameters"])
            out.append({"type": "function", "function": function})
    return out


def _tool_choice(config: dict[str, Any]) -> Any:
    choice = TOOL_CHOICE.get(str(config.get("mode", "")).upper())
    allowed = config.get("allowedFunctionNames") or []
    if choice == "required" and len(allowed) == 1:
        return {"type": "function", "function": {"name": allowed[0]}}
    return choice


def _schema(schema: Any) -> Any:
    """Gemini's OpenAPI schema as JSON schema: upper-case types ("OBJECT") lower-cased, data left alone."""
    if isinstance(schema, list):
        return [_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type":
            # Anything but a type name or a list of them is passed on as it is, for the upstream to judge.
            out[key] = (
                value.lower()
                if isinstance(value, str)
                else [_lower(v) for v in value]
                if isinstance(value, list)
                else value
            )
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _schema(s) for name, s in value.items()}
        else:
            out[key] = value if key in SCHEMA_DATA else _schema(value)
    return out


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _generation(config: dict[str, Any], thinking: dict[str, Any], chat: dict[str, Any]) -> None:
    if (config.get("candidateCount") or 1) > 1:
        raise native.BadRequest("candidateCount above 1 is not supported")
    for theirs, ours in GENERATION.items():
        if config.get(theirs) is not None:
            chat[ours] = config[theirs]
    if schema := config.get("responseJsonSchema") or _schema(config.get("responseSchema")):
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}
    elif config.get("responseMimeType") == "application/json":
        chat["response_format"] = {"type": "json_object"}
    if thinking.get("thinkingBudget") == 0:  # Gemini's way to switch thinking off
        chat["chat_template_kwargs"] = {"enable_thinking": False}
    elif thinking.get("includeThoughts") is True:
        chat["chat_template_kwargs"] = {"enable_thinking": True}


class Translation:
    """One Gemini call answered by the upstream's Chat Completions, streamed or not."""

    def __init__(self, chat_body: dict[str, Any], stream: bool, model: str, *, include_thoughts: bool) -> None:
        self.chat_body = chat_body
        self.stream = stream
        self.model = model  # the harness sees the model it asked for
        self.include_thoughts = include_thoughts  # Gemini returns thought parts only when asked; the signature always
        self.response_id = uuid.uuid4().hex[:22]
        self._answer = self._new_answer()

    def events(self, chunk: dict[str, Any]) -> bytes:
        return self._answer.feed(chunk)

    def finish(self, complete: bool, message: str | None = None) -> bytes:
        return self._answer.finish(complete, message)

    def answer(self, response: dict[str, Any]) -> dict[str, Any]:
        answer = self._new_answer()
        answer.feed(native.answer_chunk(response))
        return answer.response()

    def error(self, status: int, message: str) -> dict[str, Any]:
        return _error(status, message)

    def _new_answer(self) -> _Answer:
        return _Answer(self.model, self.response_id, include_thoughts=self.include_thoughts)


def _error(status: int, message: str) -> dict[str, Any]:
    if status == 400 and "context length" in message.lower():
        # Gemini's wording for an over-long prompt, so a harness knows to compress its history.
        message = f"The input token count exceeds the maximum number of tokens allowed. ({message})"
    return error_body(status, message)


class _Answer:
    """The answer as the upstream's chat chunks arrive: one ``GenerateContentResponse`` event per chunk that adds
    parts (a call once its arguments are complete JSON), a last one with the finish reason and usage, and the
    parts they add up to (the non-streamed answer)."""

    def __init__(self, model: str, response_id: str, *, include_thoughts: bool) -> None:
        self.model = model
        self.response_id = response_id
        self.include_thoughts = include_thoughts
        self.parts: list[dict[str, Any]] = []  # every part sent so far
        self.thoughts: list[str] = []
        self.signed = False
        self.calls = native.ToolCalls()
        self.sent_calls: set[int] = set()
        self.finish_reason: str | None = None
        self.malformed = False
        self.usage: dict[str, Any] | None = None
        self.done = False

    def feed(self, chunk: dict[str, Any]) -> bytes:
        if self.done:
            return b""
        if isinstance(chunk.get("error"), dict):  # an error the upstream sent mid-stream
            self.done = True
            error = chunk["error"]
            code = error.get("code") if isinstance(error.get("code"), int) else 500
            return native.sse(None, _error(code, str(error.get("message") or "upstream error")))
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        parts: list[dict[str, Any]] = []
        if (delta := native.chat_delta(chunk)) is not None:
            if delta.reasoning:
                self.thoughts.append(delta.reasoning)
                if self.include_thoughts:
                    parts.append({"text": delta.reasoning, "thought": True})
            if delta.content:
                parts.append(self._signed({"text": delta.content}))
            for piece in delta.tool_calls:
                self.calls.add(piece)
            self.finish_reason = delta.finish_reason or self.finish_reason
            parts += self._complete_calls(final=self.finish_reason is not None)
        self.parts += parts
        if self.finish_reason is not None and self.usage is not None and not chunk.get("choices"):
            return self._event(parts) + self._last_event()
        return self._event(parts)

    def finish(self, complete: bool, message: str | None = None) -> bytes:
        if self.done:
            return b""
        if not complete or self.finish_reason is None:
            self.done = True
            if message:
                return native.sse(None, _error(502, message))
            return native.sse(None, _error(500, "the upstream stream broke off before the answer was complete"))
        return self._last_event()

    def response(self) -> dict[str, Any]:
        """The whole answer in one ``GenerateContentResponse``: every part, the finish reason, the usage."""
        self.parts += self._complete_calls(final=True)
        return self._response(self.parts + self._closing_parts(), last=True)

    def _signed(self, part: dict[str, Any]) -> dict[str, Any]:
        """The first non-thought part after the thoughts carries their signature."""
        if self.thoughts and not self.signed:
            self.signed = True
            part["thoughtSignature"] = mint_signature("".join(self.thoughts))
        return part

    def _complete_calls(self, *, final: bool) -> list[dict[str, Any]]:
        """functionCall parts for calls whose arguments are complete JSON (all remaining ones when ``final``)."""
        parts = []
        for index, call in sorted(self.calls.calls.items()):
            if index in self.sent_calls:
                continue
            text = call.arguments.strip() or ("{}" if final else "")
            # A JSON object ends with "}": parsing only then keeps a long streamed argument linear.
            args = native.json_object(text) if text.endswith("}") else None
            if args is None and not final:
                continue
            self.sent_calls.add(index)
            if args is None:  # Gemini's verdict on a call it cannot parse, instead of a broken part
                self.malformed = True
                continue
            parts.append(self._signed({"functionCall": {"name": call.name, "args": args}}))
        return parts

    def _closing_parts(self) -> list[dict[str, Any]]:
        """An answer of thoughts alone still hands back their signature, on an empty text part."""
        return [] if self.signed or not self.thoughts else [self._signed({"text": ""})]

    def _last_event(self) -> bytes:
        self.done = True
        return native.sse(None, self._response(self._closing_parts(), last=True))

    def _event(self, parts: list[dict[str, Any]]) -> bytes:
        return native.sse(None, self._response(parts)) if parts else b""

    def _response(self, parts: list[dict[str, Any]], *, last: bool = False) -> dict[str, Any]:
        candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}} if parts else {}
        body: dict[str, Any] = {"candidates": [candidate]}
        if last:
            if self.malformed and self.finish_reason != "length":
                candidate["finishReason"] = "MALFORMED_FUNCTION_CALL"
            else:
                candidate["finishReason"] = FINISH_REASONS.get(self.finish_reason or "stop", "OTHER")
            body["usageMetadata"] = _usage(self.usage or {})
        candidate["index"] = 0
        return {**body, "modelVersion": self.model, "responseId": self.response_id}


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
    thoughts = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    out = {
        "promptTokenCount": prompt,
        "candidatesTokenCount": completion - thoughts,
        "totalTokenCount": usage.get("total_tokens") or prompt + completion,
    }
    if thoughts:
        out["thoughtsTokenCount"] = thoughts
    if cached := (usage.get("prompt_tokens_details") or {}).get("cached_tokens"):
        out["cachedContentTokenCount"] = cached
    return out


# --- an answer recorded untranslated, back to Chat Completions (reconstruction) ------------------------------


_FINISH = {"STOP": "stop", "MAX_TOKENS": "length"}


def to_chat_completion(text: str, streamed: bool) -> dict[str, Any] | None:
    """A generateContent answer, or the events of a streamed one, as a ``chat.completion`` (contract: native.py)."""
    if streamed:
        chunks = native.sse_payloads(text)
    else:
        try:
            chunks = [json.loads(text)]
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
                decoded = read_signature(part.get("thoughtSignature"))
                if decoded is not None and decoded not in signed:
                    signed.append(decoded)
                if isinstance(part.get("text"), str):
                    (reasoning if part.get("thought") else content).append(part["text"])
                call = part.get("functionCall")
                if isinstance(call, dict):
                    call_id = call.get("id") or f"call_{len(calls)}"
                    calls.append(native.chat_tool_call(call_id, call.get("name"), call.get("args")))
            finish = candidate.get("finishReason") or finish
    if not seen:
        return None
    reason = "tool_calls" if calls and finish == "STOP" else _FINISH.get(str(finish), "stop" if finish else None)
    counts = {"prompt_tokens": usage.get("promptTokenCount"), "completion_tokens": usage.get("candidatesTokenCount")}
    return native.chat_completion(content, signed or reasoning, calls, reason, counts, model)
