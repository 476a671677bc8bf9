"""Fast fake vLLM Chat Completions upstream for the proxy benchmark (stdlib only).

Run alone:  python -m tests.bench.upstream --port 8000
The benchmark starts it as a subprocess and reads the ``listening on`` line for the port.

``POST /v1/chat/completions`` answers at once with a small vLLM-shaped body (``prompt_token_ids``,
``choices[0].token_ids``, ``logprobs``). With ``"stream": true`` it sends ``bench_chunks`` SSE
chunks (default 200, each flushed as its own HTTP chunk) and then ``data: [DONE]``, sleeping
``bench_delay_s`` seconds between chunks (default 0). A translating proxy rebuilds the body, so
both can also come as request headers ``x-bench-chunks`` and ``x-bench-delay-s`` (the body fields
win). Every other request field is ignored, so whatever a proxy injects (``logprobs``,
``return_token_ids``, ``stream_options``) is harmless.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["CHUNKS_HEADER", "DEFAULT_CHUNKS", "DELAY_HEADER", "completion_text", "make_server"]

DEFAULT_CHUNKS = 200
CHUNKS_HEADER = "x-bench-chunks"
DELAY_HEADER = "x-bench-delay-s"
_MAX_CHUNKS = 100_000
_MODEL = "bench-model"


def _logprobs(token_ids: list[int]) -> dict[str, object]:
    return {
        "content": [
            {
                "token": f"token_id:{t}",
                "logprob": -0.01 * (t % 7),
                "bytes": [116, 111, 107],
                "top_logprobs": [{"token": f"token_id:{t}", "logprob": -0.01 * (t % 7), "bytes": [116, 111, 107]}],
            }
            for t in token_ids
        ]
    }


@functools.cache
def _completion_body() -> bytes:
    token_ids = [1000 + i for i in range(32)]
    body = {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": _MODEL,
        "prompt_token_ids": [151644 + (i % 97) for i in range(256)],
        "prompt_logprobs": None,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "def answer():\n    return 42\n" * 4, "tool_calls": []},
                "logprobs": _logprobs(token_ids),
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": token_ids,
            }
        ],
        "usage": {"prompt_tokens": 256, "completion_tokens": len(token_ids), "total_tokens": 256 + len(token_ids)},
    }
    return json.dumps(body, separators=(",", ":")).encode()


def completion_text() -> str:
    """The assistant text of every non-streamed answer (streamed ones say ``tok0 tok1 ...``)."""
    return str(json.loads(_completion_body())["choices"][0]["message"]["content"])


@functools.lru_cache(maxsize=8)
def _stream_frames(n_chunks: int) -> tuple[bytes, ...]:
    """HTTP/1.1 chunk frames (size line + SSE event), one per SSE event, [DONE] and terminator last."""
    events: list[bytes] = []
    for i in range(n_chunks):
        delta: dict[str, object] = {"content": f"tok{i} "}
        chunk: dict[str, object] = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 1_700_000_000,
            "model": _MODEL,
            "choices": [
                {
                    "index": 0,
                    "delta": delta,
                    "logprobs": _logprobs([2000 + i]),
                    "finish_reason": "stop" if i == n_chunks - 1 else None,
                    "token_ids": [2000 + i],
                }
            ],
        }
        if i == 0:  # vLLM puts the prompt ids on the first (role) chunk.
            delta["role"] = "assistant"
            chunk["prompt_token_ids"] = [151644 + (j % 97) for j in range(256)]
        events.append(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    frames = [b"%x\r\n%s\r\n" % (len(e), e) for e in events]
    frames.append(b"0\r\n\r\n")
    return tuple(frames)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    # Without this every response pays a ~40 ms Nagle / delayed-ACK stall (stack.md section 1).
    disable_nagle_algorithm = True
    server_version = "bench-upstream/1"

    def log_message(self, format: str, *args: object) -> None:
        pass  # one line per request would dominate the timings

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path in ("/health", "/v1/models"):
            self._send(200, b'{"object":"list","data":[{"id":"%s","object":"model"}]}' % _MODEL.encode())
        else:
            self._send(404, b'{"error":"not found"}')

    def do_POST(self) -> None:
        raw = self._read_body()
        if not self.path.split("?")[0].endswith("/chat/completions"):
            self._send(404, b'{"error":"not found"}')
            return
        try:
            req = json.loads(raw)
            # The body fields win; the headers are for calls a proxy translates (their bodies are rebuilt).
            n_chunks = int(req.get("bench_chunks", self.headers.get(CHUNKS_HEADER, DEFAULT_CHUNKS)))
            delay_s = float(req.get("bench_delay_s", self.headers.get(DELAY_HEADER, 0.0)))
            if not 1 <= n_chunks <= _MAX_CHUNKS or not 0.0 <= delay_s <= 10.0:
                raise ValueError("bench_chunks or bench_delay_s out of range")
        except (ValueError, TypeError, AttributeError) as e:
            self._send(400, json.dumps({"error": f"bad request: {e}"}).encode())
            return
        if not req.get("stream"):
            self._send(200, _completion_body())
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        # wfile is unbuffered (wbufsize=0) and Nagle is off: each write leaves as its own segment.
        for i, frame in enumerate(_stream_frames(n_chunks)):
            if delay_s and 0 < i < n_chunks:
                time.sleep(delay_s)
            self.wfile.write(frame)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # 16 clients connecting at once overflow the default backlog of 5


def make_server(host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """Bind the fake upstream (port 0 picks a free one); call ``serve_forever`` to run it."""
    return _Server((host, port), _Handler)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = pick a free port")
    p.add_argument("--max-seconds", type=float, default=1800.0, help="exit after this long, whatever happens")
    p.add_argument("--exit-on-stdin-eof", action="store_true", help="exit when the parent closes our stdin")
    args = p.parse_args()
    server = make_server(args.host, args.port)
    if args.exit_on_stdin_eof:  # the parent dies -> the pipe closes -> we stop

        def watch_stdin() -> None:
            sys.stdin.buffer.read()
            server.shutdown()

        threading.Thread(target=watch_stdin, daemon=True).start()
    deadline = threading.Timer(args.max_seconds, server.shutdown)
    deadline.daemon = True
    deadline.start()
    print(f"listening on http://{args.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
