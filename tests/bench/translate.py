"""Translation overhead for ``python -m tests.bench.proxy``: each API through the one mitmdump + addon.

The addon passes Chat Completions through and translates Anthropic Messages, OpenAI Responses and
Google ``streamGenerateContent`` into one upstream Chat Completions call, turning the upstream's
chunks back into the client's events as they arrive. This phase sends the same small agent turn
(~2 KB: a system prompt, a user message, a tool call and its result, three tools) in each API's own
wire format, streamed and not, the four APIs interleaved call by call in a rotating order, and reports
per API: the time to the first complete SSE event the client sees, the time to the end of the
stream, the per-chunk overhead ``(total_api - total_chat) / chunks``, the non-streamed latency and
the proxy's CPU per call. The target is issue 3's: first event, API - chat <= 5 ms.

Every answer is checked (status, event names and counts, the reassembled text, the final event),
so an error the addon returns quickly can never pass for a fast translation. The upstream's chunk
count travels in the ``x-bench-chunks`` header: translation rebuilds the body, so a body field
would not reach the upstream.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from tests.bench.payload import _code, _system_prompt, _tool
from tests.bench.procs import cpu_seconds
from tests.bench.report import percentile
from tests.bench.upstream import CHUNKS_HEADER, completion_text

__all__ = ["APIS", "ApiPath", "evaluate", "make_paths", "markdown_lines", "measure", "summarize", "table"]

APIS = ("chat", "anthropic", "responses", "google")
SESSION = "bench-session"  # the API key doubles as the session id (addon/session.py)
MODEL = "bench-model"
FIRST_EVENT_LIMIT_MS = 5.0  # issue 3: first byte through the translating proxy within 5 ms of chat
MAX_ERRORS = 10  # an API that fails this often is dropped for the rest of the run


# ---------------------------------------------------------------- the agent turn, in each API


def _turn() -> dict[str, Any]:
    """One small coding-agent turn, API-neutral: the four bodies below all say this."""
    return {
        "system": _system_prompt(300),
        "user": "<environment>\ncwd: /repo\nos: linux\n</environment>\n"
        "Fix the bug in reconstruct/_sse.py: events split across chunks are lost.",
        "call": {"id": "call_1", "name": "read_file", "args": {"path": "reconstruct/_sse.py"}},
        "result": _code(250, 2),
        "tools": [
            _tool("read_file", "Read a file from the repository.", {"path": "Path relative to the repository root."}),
            _tool("edit", "Replace a file's content.", {"path": "Path to edit.", "new": "The new content."}),
            _tool("run_shell_command", "Run a shell command in the repository.", {"cmd": "The command line."}),
        ],
    }


def _chat(turn: dict[str, Any], stream: bool) -> dict[str, Any]:
    call = turn["call"]
    tool_call = {
        "id": call["id"],
        "type": "function",
        "function": {"name": call["name"], "arguments": json.dumps(call["args"])},
    }
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": turn["system"]},
            {"role": "user", "content": turn["user"]},
            {"role": "assistant", "content": "", "tool_calls": [tool_call]},
            {"role": "tool", "tool_call_id": call["id"], "content": turn["result"]},
        ],
        "tools": turn["tools"],
        "max_tokens": 4096,
        "stream": stream,
    }


def _anthropic(turn: dict[str, Any], stream: bool) -> dict[str, Any]:
    call = turn["call"]
    tools = [
        {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
        for f in (t["function"] for t in turn["tools"])
    ]
    return {
        "model": MODEL,
        "max_tokens": 4096,
        "system": [{"type": "text", "text": turn["system"]}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": turn["user"]}]},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": call["name"], "input": call["args"]}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": turn["result"]}]},
        ],
        "tools": tools,
        "stream": stream,
    }


def _responses(turn: dict[str, Any], stream: bool) -> dict[str, Any]:
    call = turn["call"]
    return {
        "model": MODEL,
        "instructions": turn["system"],
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": turn["user"]}]},
            {
                "type": "function_call",
                "call_id": call["id"],
                "name": call["name"],
                "arguments": json.dumps(call["args"]),
            },
            {"type": "function_call_output", "call_id": call["id"], "output": turn["result"]},
        ],
        "tools": [{"type": "function", **t["function"]} for t in turn["tools"]],
        "max_output_tokens": 4096,
        "store": False,
        "stream": stream,
    }


def _google(turn: dict[str, Any]) -> dict[str, Any]:
    call = turn["call"]
    return {
        "systemInstruction": {"parts": [{"text": turn["system"]}]},
        "contents": [
            {"role": "user", "parts": [{"text": turn["user"]}]},
            {"role": "model", "parts": [{"functionCall": {"name": call["name"], "args": call["args"]}}]},
            {
                "role": "user",
                "parts": [{"functionResponse": {"name": call["name"], "response": {"output": turn["result"]}}}],
            },
        ],
        "tools": [{"functionDeclarations": [t["function"] for t in turn["tools"]]}],
        "generationConfig": {"maxOutputTokens": 4096},
    }


# ---------------------------------------------------------------- checking what came back


def _sse(data: bytes) -> list[tuple[str | None, str]]:
    """(event name, data) per SSE event."""
    out = []
    for block in data.replace(b"\r\n", b"\n").split(b"\n\n"):
        name, lines = None, []
        for line in block.decode("utf-8").split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                lines.append(line[5:].lstrip(" "))
        if lines:
            out.append((name, "\n".join(lines)))
    return out


def _expected_stream(chunks: int) -> str:
    return "".join(f"tok{i} " for i in range(chunks))  # what tests/bench/upstream.py streams


def _check_chat_stream(events: list[tuple[str | None, str]], chunks: int) -> str | None:
    if len(events) != chunks + 1 or events[-1][1] != "[DONE]":
        return (
            f"{len(events)} events, last {events[-1][1][:40] if events else None!r} (want {chunks} chunks and [DONE])"
        )
    parsed = [json.loads(d) for _, d in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in parsed if c.get("choices"))
    if text != _expected_stream(chunks):
        return f"reassembled text differs: {text[:60]!r}"
    if parsed[-1]["choices"][0].get("finish_reason") != "stop" or not all(
        c["choices"][0].get("token_ids") for c in parsed
    ):
        return "no finish_reason on the last chunk, or a chunk without token_ids"
    return None


def _check_anthropic_stream(events: list[tuple[str | None, str]], chunks: int) -> str | None:
    names = [n for n, _ in events]
    if not names or names[0] != "message_start" or names[-1] != "message_stop" or "error" in names:
        return f"events {names[:3]} ... {names[-3:]} (want message_start ... message_stop, no error)"
    parsed = [json.loads(d) for _, d in events]
    if any(p.get("type") != n for n, p in zip(names, parsed, strict=True)):
        return "an event whose data type differs from its name"
    deltas = [p["delta"] for p in parsed if p["type"] == "content_block_delta"]
    text = "".join(d.get("text", "") for d in deltas if d.get("type") == "text_delta")
    if len(deltas) != chunks or text != _expected_stream(chunks):
        return f"{len(deltas)} content_block_delta events (want {chunks}), text {text[:60]!r}"
    end = next(p for p in parsed if p["type"] == "message_delta")
    if end["delta"].get("stop_reason") != "end_turn" or parsed[0]["message"].get("model") != MODEL:
        return f"stop_reason {end['delta'].get('stop_reason')!r}, model {parsed[0]['message'].get('model')!r}"
    return None


def _check_responses_stream(events: list[tuple[str | None, str]], chunks: int) -> str | None:
    names = [n for n, _ in events]
    if not names or names[0] != "response.created" or names[-1] != "response.completed":
        return f"events {names[:3]} ... {names[-3:]} (want response.created ... response.completed)"
    parsed = [json.loads(d) for _, d in events]
    if [p.get("sequence_number") for p in parsed] != list(range(len(parsed))):
        return "sequence_number does not count up from 0"
    deltas = [p["delta"] for p in parsed if p["type"] == "response.output_text.delta"]
    if len(deltas) != chunks or "".join(deltas) != _expected_stream(chunks):
        return f"{len(deltas)} response.output_text.delta events (want {chunks}), text {''.join(deltas)[:60]!r}"
    final = parsed[-1]["response"]
    text = "".join(c.get("text", "") for o in final.get("output") or [] for c in o.get("content") or [])
    if final.get("status") != "completed" or text != _expected_stream(chunks) or final.get("model") != MODEL:
        return f"final response: status {final.get('status')!r}, model {final.get('model')!r}, text {text[:60]!r}"
    return None


def _check_google_stream(events: list[tuple[str | None, str]], chunks: int) -> str | None:
    if not events or any(n is not None for n, _ in events):
        return f"{len(events)} events, names {sorted({str(n) for n, _ in events})} (want data-only events)"
    parsed = [json.loads(d) for _, d in events]
    if any("error" in p or not p.get("candidates") for p in parsed):
        return f"an event without candidates: {next(p for p in parsed if 'error' in p or not p.get('candidates'))}"
    parts = [p for e in parsed for p in (e["candidates"][0].get("content") or {}).get("parts") or []]
    text = "".join(p.get("text", "") for p in parts if not p.get("thought"))
    if text != _expected_stream(chunks) or len(events) < chunks:
        return f"{len(events)} events (want >= {chunks}), text {text[:60]!r}"
    last = parsed[-1]["candidates"][0]
    if last.get("finishReason") != "STOP" or any(e["candidates"][0].get("finishReason") for e in parsed[:-1]):
        return f"finishReason {last.get('finishReason')!r} on the last event (want STOP there only)"
    return None


def _check_chat(body: Any, text: str) -> str | None:
    choice = (body.get("choices") or [{}])[0]
    if choice.get("message", {}).get("content") != text or not choice.get("token_ids"):
        return f"unexpected chat answer: {json.dumps(body)[:200]}"
    return None


def _check_anthropic(body: Any, text: str) -> str | None:
    content = body.get("content") or []
    ok = body.get("type") == "message" and body.get("stop_reason") == "end_turn" and body.get("model") == MODEL
    if not ok or [c.get("text") for c in content] != [text]:
        return f"unexpected Messages answer: {json.dumps(body)[:200]}"
    return None


def _check_responses(body: Any, text: str) -> str | None:
    got = "".join(c.get("text", "") for o in body.get("output") or [] for c in o.get("content") or [])
    if body.get("object") != "response" or body.get("status") != "completed" or got != text:
        return f"unexpected Responses answer: {json.dumps(body)[:200]}"
    return None


def _check_google(body: Any, text: str) -> str | None:
    candidate = (body.get("candidates") or [{}])[0]
    parts = (candidate.get("content") or {}).get("parts") or []
    if candidate.get("finishReason") != "STOP" or "".join(p.get("text", "") for p in parts) != text:
        return f"unexpected generateContent answer: {json.dumps(body)[:200]}"
    return None


# ---------------------------------------------------------------- one API's path and samples


@dataclasses.dataclass
class ApiPath:
    name: str
    stream_url: str
    plain_url: str
    stream_body: bytes
    plain_body: bytes
    headers: dict[str, str]
    check_stream: Callable[[list[tuple[str | None, str]], int], str | None]
    check_plain: Callable[[Any, str], str | None]
    requests: int = 0
    errors: int = 0
    error_samples: list[str] = dataclasses.field(default_factory=list)
    events: list[int] = dataclasses.field(default_factory=list)  # SSE events per stream
    first_byte_ms: list[float] = dataclasses.field(default_factory=list)
    first_event_ms: list[float] = dataclasses.field(default_factory=list)
    stream_ms: list[float] = dataclasses.field(default_factory=list)
    lat_ms: list[float] = dataclasses.field(default_factory=list)
    cpu_s: dict[str, float] = dataclasses.field(default_factory=dict)  # proxy CPU seconds per workload
    cpu_n: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def alive(self) -> bool:
        return self.errors < MAX_ERRORS

    def fail(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(what[:300])


def make_paths(chunks: int) -> list[ApiPath]:
    turn = _turn()
    base = {"content-type": "application/json", CHUNKS_HEADER: str(chunks)}
    bearer = base | {"authorization": f"Bearer {SESSION}"}
    google = f"/v1beta/models/{MODEL}"

    def enc(body: dict[str, Any]) -> bytes:
        return json.dumps(body).encode()

    return [
        ApiPath("chat", "/v1/chat/completions", "/v1/chat/completions", enc(_chat(turn, True)),
                enc(_chat(turn, False)), bearer, _check_chat_stream, _check_chat),
        ApiPath("anthropic", "/v1/messages", "/v1/messages", enc(_anthropic(turn, True)), enc(_anthropic(turn, False)),
                base | {"x-api-key": SESSION, "anthropic-version": "2023-06-01"}, _check_anthropic_stream, _check_anthropic),
        ApiPath("responses", "/v1/responses", "/v1/responses", enc(_responses(turn, True)), enc(_responses(turn, False)),
                bearer, _check_responses_stream, _check_responses),
        ApiPath("google", f"{google}:streamGenerateContent?alt=sse", f"{google}:generateContent", enc(_google(turn)),
                enc(_google(turn)), base | {"x-goog-api-key": SESSION}, _check_google_stream, _check_google),
    ]  # fmt: skip


def run_streams(p: ApiPath, client: httpx.Client, n: int, chunks: int, sent: Callable[[], None], record: bool) -> None:
    """n streamed calls: first body bytes, first complete SSE event, end of stream; every answer checked."""
    for _ in range(n):
        if not p.alive:
            return
        sent()
        p.requests += 1
        parts: list[bytes] = []
        head, first_byte, first_event = b"", 0.0, 0.0
        t0 = time.perf_counter()
        try:
            with client.stream("POST", p.stream_url, content=p.stream_body, headers=p.headers) as r:
                for raw in r.iter_raw():
                    if not raw:
                        continue
                    if not first_event:
                        now = time.perf_counter()
                        first_byte = first_byte or now
                        head += raw
                        if b"\n\n" in head:  # the client can act on a whole event from here on
                            first_event = now
                    parts.append(raw)
        except httpx.HTTPError as e:
            p.fail(f"stream {type(e).__name__}: {e}")
            continue
        end = time.perf_counter()
        data = b"".join(parts)
        if r.status_code != 200 or not r.headers.get("content-type", "").startswith("text/event-stream"):
            p.fail(f"stream HTTP {r.status_code} {r.headers.get('content-type')}: {data[:200]!r}")
            continue
        try:
            events = _sse(data)
            problem = p.check_stream(events, chunks)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError, StopIteration) as e:
            problem = f"unparsable stream ({type(e).__name__}: {e}): {data[:200]!r}"
        if problem:
            p.fail(f"stream: {problem}")
        elif record:
            p.events.append(len(events))
            p.first_byte_ms.append((first_byte - t0) * 1e3)
            p.first_event_ms.append((first_event - t0) * 1e3)
            p.stream_ms.append((end - t0) * 1e3)


def run_plain(p: ApiPath, client: httpx.Client, n: int, text: str, sent: Callable[[], None], record: bool) -> None:
    """n non-streamed calls on the same connection: latency; every answer checked."""
    for _ in range(n):
        if not p.alive:
            return
        sent()
        p.requests += 1
        t0 = time.perf_counter()
        try:
            r = client.post(p.plain_url, content=p.plain_body, headers=p.headers)
        except httpx.HTTPError as e:
            p.fail(f"{type(e).__name__}: {e}")
            continue
        lat = (time.perf_counter() - t0) * 1e3
        try:
            problem = f"HTTP {r.status_code}: {r.text[:200]}" if r.status_code != 200 else p.check_plain(r.json(), text)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            problem = f"unparsable answer ({type(e).__name__}: {e}): {r.text[:200]}"
        if problem:
            p.fail(problem)
        elif record:
            p.lat_ms.append(lat)


def measure(
    base_url: str,
    cpu_pid: int | None,
    sent: Callable[[], None],
    *,
    chunks: int,
    rounds: int,
    streams: int,
    seq: int,
    console: Console,
) -> list[ApiPath]:
    """All four APIs through one proxy on one keep-alive connection, interleaved call by call.

    Each round sends ``streams`` streams then ``seq`` non-streamed calls per API, one API after the
    other in an order that rotates with every call, so that load from other processes hits the four
    alike. ``sent`` is called once per request (the caller counts what the addon should record)."""
    paths = make_paths(chunks)
    text = completion_text()
    console.print(
        f"translation: {rounds} rounds x ({streams} streams of {chunks} chunks, {seq} non-streamed calls) per API, "
        "interleaved, through mitmdump + addon; request bodies "
        + ", ".join(f"{p.name} {len(p.stream_body) / 1000:.1f} KB" for p in paths)
    )
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)

    def timed(p: ApiPath, workload: str, run: Callable[[], None]) -> None:
        cpu0, n0 = cpu_seconds(cpu_pid), p.requests
        run()
        if cpu0 is not None and (cpu1 := cpu_seconds(cpu_pid)) is not None:
            p.cpu_s[workload] = p.cpu_s.get(workload, 0.0) + cpu1 - cpu0
            p.cpu_n[workload] = p.cpu_n.get(workload, 0) + p.requests - n0

    with httpx.Client(base_url=base_url, timeout=30.0, limits=limits) as client, Progress(console=console) as prog:
        task = prog.add_task("translation warm-up", total=1 + 2 * rounds)
        for p in paths:
            run_streams(p, client, 3, chunks, sent, record=False)
            run_plain(p, client, 10, text, sent, record=False)
        prog.advance(task)
        for r in range(rounds):
            gc.collect()
            for workload, n in (("stream", streams), ("plain", seq)):
                prog.update(task, description=f"translation round {r + 1}/{rounds} {workload}")
                for k in range(r * n, (r + 1) * n):  # n a multiple of 4: each API goes first equally often
                    order = paths[k % len(paths) :] + paths[: k % len(paths)]
                    for p in order:
                        if workload == "stream":
                            timed(p, workload, lambda p=p: run_streams(p, client, 1, chunks, sent, True))
                        else:
                            timed(p, workload, lambda p=p: run_plain(p, client, 1, text, sent, True))
                prog.advance(task)
    return paths


# ---------------------------------------------------------------- statistics and tables


def summarize(paths: Sequence[ApiPath], chunks: int) -> dict[str, dict[str, float | None]]:
    """Medians per API, and each one's difference from chat (per-chunk values in microseconds)."""
    stats: dict[str, dict[str, float | None]] = {}
    for p in paths:
        cpu = {k: 1e3 * p.cpu_s[k] / p.cpu_n[k] for k in p.cpu_s if p.cpu_n.get(k)}
        stats[p.name] = {
            "request_kb": len(p.stream_body) / 1000,
            "streams": len(p.stream_ms),
            "events_per_stream": statistics.median(p.events) if p.events else None,
            "first_byte_median_ms": percentile(p.first_byte_ms, 50),
            "first_event_median_ms": percentile(p.first_event_ms, 50),
            "first_event_p90_ms": percentile(p.first_event_ms, 90),
            "stream_total_median_ms": percentile(p.stream_ms, 50),
            "latency_median_ms": percentile(p.lat_ms, 50),
            "latency_p99_ms": percentile(p.lat_ms, 99),
            "cpu_ms_stream": cpu.get("stream"),
            "cpu_ms_plain": cpu.get("plain"),
        }
    chat = stats.get("chat", {})
    for s in stats.values():
        s["first_event_vs_chat_ms"] = _diff(s["first_event_median_ms"], chat.get("first_event_median_ms"))
        s["stream_total_vs_chat_ms"] = _diff(s["stream_total_median_ms"], chat.get("stream_total_median_ms"))
        total = s["stream_total_vs_chat_ms"]
        s["per_chunk_overhead_us"] = None if total is None else 1e3 * total / chunks
        cpu = _diff(s["cpu_ms_stream"], chat.get("cpu_ms_stream"))
        s["cpu_per_chunk_overhead_us"] = None if cpu is None else 1e3 * cpu / chunks
        s["latency_vs_chat_ms"] = _diff(s["latency_median_ms"], chat.get("latency_median_ms"))
    return stats


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def evaluate(stats: dict[str, dict[str, float | None]]) -> list[dict[str, object]]:
    """Rows for the Targets table: first event of each translated API vs chat (PASS / MISS / n/a)."""
    rows: list[dict[str, object]] = []
    for api in APIS[1:]:
        value = stats.get(api, {}).get("first_event_vs_chat_ms")
        result = "n/a" if value is None else "PASS" if value <= FIRST_EVENT_LIMIT_MS else "MISS"
        rows.append(
            {
                "name": f"first byte, {api} - chat (translated stream)",
                "value": value,
                "unit": "ms",
                "target": f"<= {FIRST_EVENT_LIMIT_MS:g} ms",
                "result": result,
            }
        )
    return rows


# (key in a summary, label, decimals, a difference from chat)
_METRICS = [
    ("request_kb", "request body (KB)", 1, False),
    ("events_per_stream", "SSE events per stream", 0, False),
    ("first_event_median_ms", "first event, median (ms)", 2, False),
    ("first_event_vs_chat_ms", "first event, API - chat (ms)", 2, True),
    ("stream_total_median_ms", "stream total, median (ms)", 2, False),
    ("stream_total_vs_chat_ms", "stream total, API - chat (ms)", 2, True),
    ("per_chunk_overhead_us", "per-chunk overhead, (API - chat) / chunks (µs)", 1, True),
    ("latency_median_ms", "non-streamed latency, median (ms)", 2, False),
    ("latency_vs_chat_ms", "non-streamed latency, API - chat (ms)", 2, True),
    ("cpu_ms_stream", "proxy CPU per stream (ms)", 2, False),
    ("cpu_per_chunk_overhead_us", "proxy CPU per chunk, API - chat (µs)", 1, True),
    ("cpu_ms_plain", "proxy CPU per non-streamed call (ms)", 2, False),
]
_HEAD = ["metric", "chat (plain path)", *APIS[1:]]


def _rows(stats: dict[str, dict[str, float | None]]) -> list[list[str]]:
    rows = []
    for key, label, dec, signed in _METRICS:
        cells = [label]
        for api in APIS:
            v = stats.get(api, {}).get(key)
            if v is None or (signed and api == "chat"):
                cells.append("-")
            else:
                cells.append(f"{v:+,.{dec}f}" if signed else f"{v:,.{dec}f}")
        rows.append(cells)
    return rows


def _title(chunks: int) -> str:
    return f"Translation overhead per API (mitmdump + addon, {chunks}-chunk streams, ~2 KB requests)"


def table(stats: dict[str, dict[str, float | None]], chunks: int) -> Table:
    t = Table(title=_title(chunks))
    for i, head in enumerate(_HEAD):
        t.add_column(head, justify="left" if i == 0 else "right")
    for row in _rows(stats):
        t.add_row(*row)
    return t


def markdown_lines(stats: dict[str, dict[str, float | None]], chunks: int) -> list[str]:
    """The table in Markdown, with its title as a caption line."""
    rows = [_HEAD, ["---"] + ["---:"] * (len(_HEAD) - 1), *_rows(stats)]
    return [f"{_title(chunks)}:", "", *("| " + " | ".join(r) + " |" for r in rows)]


def raw(paths: Sequence[ApiPath]) -> dict[str, object]:
    return {
        p.name: {
            "stream_url": p.stream_url.split("?")[0],
            "plain_url": p.plain_url,
            "requests": p.requests,
            "errors": p.errors,
            "error_samples": p.error_samples,
            "samples": {"streams": len(p.stream_ms), "non_streamed": len(p.lat_ms)},
            "proxy_cpu_s": p.cpu_s,
            "proxy_cpu_requests": p.cpu_n,
        }
        for p in paths
    }
