"""Benchmark `python -m reconstruct` on a synthetic capture set, against merely parsing the same files.

Run:  .venv/bin/python -m tests.bench.reconstruct [--quick | --scale 0.2] [--out tests/bench/results/reconstruct.md]

Writes capture files in the real record format (``addon.record.encode`` on ``Exchange`` objects, as the addon
does), shaped like vLLM answers: ``--sessions`` sessions of ``--calls`` calls whose prompts grow from
``--min-prompt`` to ``--max-prompt`` tokens (each call resends the history: 4 characters of message text per
token, and the prompt ids in the answer), every other session streamed (one SSE chunk per token, with its
log-prob), a compaction every 10th session and a retried call every 7th. Sessions are interleaved in time over
two "proxy processes" that rotate their files at 256 MB, as the addon does.

Then, each in its own child process (so peak memory is its own), alternated, fastest of ``--repeats`` counted:
(1) the baseline, reading every file and parsing each line with orjson if installed (else json); (2) the
reconstruction, ``reconstruct()`` plus writing the Parquet, in one process; (3) the same with ``--jobs`` worker
processes (one per CPU by default). Prints the targets (``| target | measured | limit | result |``: the
one-process time against the baseline's, <= 1.0x, PASS or MISS with what would close a miss; --jobs and memory
as info) and the details (tokens/s, peak memory against the largest session and the whole capture set), and
writes both as Markdown with the raw numbers as JSON next to it. Exit 1 when the reconstruction is wrong
(trainable tokens != sampled tokens, traces != sessions + breaks).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np
import tyro
from rich.console import Console
from rich.table import Table

from addon import anthropic, chat, native, record_v2
from addon.record import Body, Exchange, Record, merge_fields, to_record, v1_parts

ROOT = Path(__file__).resolve().parents[2]
EOT = 2
ROTATE = 256 << 20  # the addon's default polar_rotate_mb
TARGET = 1.0  # reconstruction / baseline, one process, wall (issue 17)
SIZE_TARGET = 0.1  # capture bytes per session, v2 / v1 (issue 27)
CLOSE_THE_GAP = (
    "a v2 record is read from its parts (no v1 line rebuilt), a streamed answer's ids and log-probs from its columns "
    "(addon/record_v2.py Stream, no stream scanned), and a full record as a delta of the session's record before it "
    "(its zf, the whole history again, never inflated). What is left, measured by phase at --scale 0.2 against a "
    "0.33 s baseline: inflating what is new in each call (zlib and base64, 0.15 s), reading the answers (the tail's "
    "JSON, a stream's columns, a JSON answer's log-prob list: 0.17 s), merging (0.09 s), building and writing the "
    "Parquet (0.10 s), the JSON of each v2 line and the index pass (0.07 s). Each is a C call or close to one per "
    "record already; closing the gap needs the per-token work out of Python: a compiled reader handing ids and "
    "log-probs to Arrow as buffers, not lists of ints and floats."
)
CLOSE_THE_SIZE = (
    "what is left is mostly the full records (one in 16 per session, addon/record_v2.py FULL_EVERY) and each call's "
    "new sampled tokens as SSE; a rarer full record, or a streamed answer's ids and log-probs stored as arrays "
    "instead of SSE text, would cut it"
)
console = Console()


@dataclasses.dataclass
class Config:
    """Reconstruction benchmark."""

    quick: bool = False
    """Small set (about 20 s): 24 sessions x 20 calls, prompts of 8-12k tokens."""
    scale: float = 1.0
    """Share of the full set's sessions, with its prompt lengths and calls (0.2: 40 sessions, about 440 MB): for
    iterating; the full set (2.2 GB) is the run of record."""
    out: Path = Path("tests/bench/results/reconstruct.md")
    """Markdown results (relative to the repository root); the JSON goes next to it as .json."""
    sessions: int | None = None
    """Sessions to generate (default 200, quick 24)."""
    calls: int | None = None
    """Calls per session (default 50, quick 20)."""
    min_prompt: int = 8_000
    """First prompt of a session, in tokens."""
    max_prompt: int | None = None
    """Last prompt of a session, in tokens (default 30,000, quick 12,000)."""
    repeats: int | None = None
    """Runs of each measured phase, alternated (default 3, full 2); the fastest counts (the machine is shared)."""
    keep: Path | None = None
    """Keep the generated captures and trajectories in this folder (default: a temporary one, removed)."""
    seed: int = 0
    native: bool = True
    """Also count capture bytes per session for the same calls made through a native API (Anthropic Messages,
    translated by the addon: the record holds both request bodies); not written, not reconstructed."""
    jobs: int = os.cpu_count() or 1
    """Worker processes for the parallel run (``python -m reconstruct --jobs``); the single-process run is always
    measured too."""
    # Internal: the measured phases run as child processes of this same module.
    phase: Literal["all", "parse", "reconstruct", "parallel"] = "all"
    """all: generate and measure; parse / reconstruct: one measured phase (child process)."""
    captures: Path | None = None
    """(phase) the capture folder."""

    def sizes(self) -> tuple[int, int, int]:
        return (
            self.sessions or (24 if self.quick else max(2, round(200 * self.scale))),
            self.calls or (20 if self.quick else 50),
            self.max_prompt or (12_000 if self.quick else 30_000),
        )


# ---------------------------------------------------------------- synthetic captures


class Writer:
    """One "proxy process": capture-<start>-<pid>[.<n>].jsonl files rotated past ROTATE bytes, in format ``version``
    (a v2 file's first record of each session is full, as the addon writes it)."""

    def __init__(self, folder: Path, pid: int, version: int) -> None:
        self.folder, self.pid, self.n, self.size, self.version = folder, pid, 0, 0, version
        self.encoder = record_v2.Encoder()
        self.f = open(self._path(), "wb")  # noqa: SIM115 - rotated by write(), closed by close()

    def _path(self) -> Path:
        return self.folder / f"capture-20261129T000000Z-{self.pid}{f'.{self.n}' if self.n else ''}.jsonl"

    def write(self, record: Record) -> int:
        """Write ``record``; its line's length."""
        if self.size >= ROTATE:  # as the addon: a file ends once it passes its size
            self.f.close()
            self.n, self.size, self.encoder = self.n + 1, 0, record_v2.Encoder()
            self.f = open(self._path(), "wb")  # noqa: SIM115 - closed at the next rotation or by close()
        line = b"".join(v1_parts(record) if self.version == 1 else self.encoder.encode(record))
        self.f.write(line)
        self.size += len(line)
        return len(line)

    def close(self) -> None:
        self.f.close()


class Session:
    """A linear agent session; ``call()`` returns the next record line and keeps the history growing."""

    def __init__(
        self, k: int, calls: int, min_prompt: int, max_prompt: int, text: str, seed: int, native: bool = False
    ) -> None:
        self.k, self.calls, self.text = k, calls, text
        self.native = native  # also make each record's twin through a native API (see _native)
        self.native_records: list[Record] = []  # those twins, taken by the caller
        self.rng = np.random.default_rng(seed * 100_003 + k)
        self.streamed = k % 2 == 0
        self.min_prompt, self.max_prompt = min_prompt, max_prompt
        self.step = max(1, (max_prompt - min_prompt) // max(1, calls - 1))  # prompt growth per call, in tokens
        self.m = 0
        self.sampled = 0  # tokens sampled over all calls (what the traces must hold as trainable)
        self.prompt_total = 0
        self.retry_at = calls // 3 if k % 7 == 3 else None
        self.compact_at = calls // 2 if k % 10 == 5 else None
        self._start(min_prompt)

    def _words(self, tokens: int) -> str:
        at = int(self.rng.integers(0, len(self.text) - 4 * tokens - 1))
        return self.text[at : at + 4 * tokens]

    def _ids(self, n: int) -> list[int]:
        return self.rng.integers(3, 150_000, size=n).tolist()

    def _start(self, tokens: int) -> None:
        """A fresh history; after a compaction the same system prompt (and its ids) starts it again."""
        if not hasattr(self, "system"):
            self.system = {"role": "system", "content": self._words(tokens - 200)}
            self.system_ids = self._ids(tokens - 200)
        self.messages: list[dict[str, Any]] = [self.system, {"role": "user", "content": self._words(180)}]
        ids = self.system_ids + self._ids(tokens - len(self.system_ids))
        self.prompt = ",".join(map(str, ids))  # canonical JSON text of the prompt ids, no brackets
        self.prompt_n = tokens

    def done(self) -> bool:
        return self.m >= self.calls

    def call(self, t: float) -> list[Record]:
        """This call's record (two when the harness retries it: the first answer is dropped)."""
        if self.compact_at is not None and self.m == self.compact_at:
            self._start(self.min_prompt + 500)  # the history rewritten into a summary: a new chain
        lines = []
        if self.retry_at is not None and self.m == self.retry_at:
            a, _ = self._answer()
            lines.append(self._record(t, a, retried=True))
            t += 0.001
        a, text = self._answer()
        lines.append(self._record(t, a, retried=False))
        u = self._ids(max(20, self.step - len(a)))
        self.prompt += "," + ",".join(map(str, a + u))
        self.prompt_n += len(a) + len(u)
        self.messages += [
            {"role": "assistant", "content": text},
            {"role": "tool", "tool_call_id": f"call_{self.m}", "content": self._words(len(u))},
        ]
        self.m += 1
        return lines

    def _answer(self) -> tuple[list[int], str]:
        n = int(self.rng.integers(60, 260))
        return [*self._ids(n - 1), EOT], self._words(n)

    def _record(self, t: float, a: list[int], *, retried: bool) -> Record:
        self.sampled += len(a)
        self.prompt_total += self.prompt_n
        request = {
            "model": "bench",
            "messages": self.messages,
            "tools": TOOLS,
            "temperature": 1.0,
            "stream": self.streamed,
        }
        logprobs = (-self.rng.exponential(0.7, size=len(a))).round(6).tolist()
        ex = Exchange(
            session_id=f"bench-{self.k:04d}",
            session_source="api_key",
            api="chat",
            upstream="vllm",
            method="POST",
            path="/v1/chat/completions",
            t_start=t,
            request_headers={"content-type": "application/json"},
            request=Body(value=None, json_bytes=_dumps(request)),
            injected={"logprobs": True, "top_logprobs": 0, "return_token_ids": True}
            | ({"stream_options.include_usage": True} if self.streamed else {}),
            status=200,
            streamed=self.streamed,
            response_headers={"content-type": "text/event-stream" if self.streamed else "application/json"},
            t_first_byte=t + 0.05,
            complete=True,
        )
        ex.chunks = self._stream(a, logprobs) if self.streamed else [self._json(a, logprobs)]
        ex.chunk_times = [t + 0.05 + 0.001 * i for i in range(len(ex.chunks))]
        ex.t_end = ex.chunk_times[-1]
        if self.native:
            self.native_records.append(self._native(ex, request))
        return to_record(ex, lambda data, encoding: data)

    def _native(self, ex: Exchange, request: dict[str, Any]) -> Record:
        """The same call made through Anthropic's Messages API and translated by the addon (addon/translating.py):
        the record holds the harness's Messages body, the Chat Completions body the addon's translator made of it
        (with the token fields it adds) and the same upstream answer."""
        system, *rest = request["messages"]
        messages = [
            {"role": "assistant" if m["role"] == "assistant" else "user", "content": [{"type": "text", "text": m["content"]}]}
            for m in rest
        ]  # fmt: skip
        tools = [
            {"name": f["function"]["name"], "description": f["function"]["description"],
             "input_schema": f["function"]["parameters"]}
            for f in request["tools"]
        ]  # fmt: skip
        body = {"model": "bench", "max_tokens": 4096, "system": system["content"], "messages": messages,
                "tools": tools, "stream": request["stream"]}  # fmt: skip
        started = anthropic.start(body, "/v1/messages", {}, native.Options(model="", upstream="vllm"))
        assert isinstance(started, anthropic.MessagesTranslation)
        added = chat.token_fields(started.chat_body, "vllm")
        twin = dataclasses.replace(
            ex, api="anthropic", path="/v1/messages", request=Body(value=None, json_bytes=_dumps(body)),
            upstream_request=Body(value=merge_fields(started.chat_body, added)), injected=added, translated=True,
        )  # fmt: skip
        return to_record(twin, lambda data, encoding: data)

    def _json(self, a: list[int], logprobs: list[float]) -> bytes:
        content = [
            {"token": f"t{i}", "logprob": lp, "bytes": [116], "top_logprobs": []}
            for i, lp in zip(a, logprobs, strict=True)
        ]
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": "x", "reasoning": None, "tool_calls": []},
            "logprobs": {"content": content},
            "finish_reason": "stop",
            "token_ids": a,
        }
        head = f'{{"id":"chatcmpl-{self.k}-{self.m}","object":"chat.completion","created":0,"model":"bench",'
        usage = {"prompt_tokens": self.prompt_n, "completion_tokens": len(a), "total_tokens": self.prompt_n + len(a)}
        return (
            head.encode()
            + b'"choices":['
            + _dumps(choice)
            + b'],"usage":'
            + _dumps(usage)
            + b',"prompt_token_ids":['
            + self.prompt.encode()
            + b"]}"
        )

    def _stream(self, a: list[int], logprobs: list[float]) -> list[bytes]:
        head = (
            f'data: {{"id":"chatcmpl-{self.k}-{self.m}","object":"chat.completion.chunk","created":0,"model":"bench",'
        )
        first = (
            head
            + '"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
        )
        chunks = [(first + f'"prompt_token_ids":[{self.prompt}]}}\n\n').encode()]
        for n, (i, lp) in enumerate(zip(a, logprobs, strict=True)):
            finish = '"stop"' if n == len(a) - 1 else "null"
            chunks.append(
                (
                    head
                    + f'"choices":[{{"index":0,"delta":{{"content":"t{i} "}},"logprobs":{{"content":[{{"token":"t{i}",'
                    f'"logprob":{lp},"bytes":[116],"top_logprobs":[]}}]}},"finish_reason":{finish},"token_ids":[{i}]}}]}}\n\n'
                ).encode()
            )
        usage = f'"prompt_tokens":{self.prompt_n},"completion_tokens":{len(a)},"total_tokens":{self.prompt_n + len(a)}'
        chunks.append((head + f'"choices":[],"usage":{{{usage}}}}}\n\ndata: [DONE]\n\n').encode())
        return chunks


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


def _dumps(value: Any) -> bytes:
    try:
        import orjson

        return orjson.dumps(value)
    except ImportError:  # pragma: no cover - depends on the environment
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def generate(folder: Path, cfg: Config) -> dict[str, Any]:
    n_sessions, calls, max_prompt = cfg.sizes()
    words = "the file test run error fix code line value name path build diff patch tool call json repo".split()
    text = " ".join(random.Random(cfg.seed).choices(words, k=1_500_000))  # ~7 MB of filler
    sessions = [
        Session(k, calls, cfg.min_prompt, max_prompt, text, cfg.seed, native=cfg.native) for k in range(n_sessions)
    ]
    # Bytes only (not written): each call's twin made through Anthropic's Messages API, encoded by one writer each.
    native_bytes = {1: [0] * n_sessions, 2: [0] * n_sessions}
    native_encoders = [record_v2.Encoder(), record_v2.Encoder()]
    # The same calls in both formats: v1 for the baseline, v2 (the addon's default) for the reconstruction.
    for v in (1, 2):
        (folder / f"v{v}").mkdir()
    writers = {v: [Writer(folder / f"v{v}", 1000 + i, v) for i in range(2)] for v in (1, 2)}
    largest, t = 0, 1_795_000_000.0
    per_session = {v: [0] * n_sessions for v in (1, 2)}
    while not all(s.done() for s in sessions):
        for s in sessions:  # round robin: every session's call m, then every session's call m + 1
            if not s.done():
                for record in s.call(t):
                    for v in (1, 2):
                        per_session[v][s.k] += writers[v][s.k % 2].write(record)
                for twin in s.native_records:
                    native_bytes[1][s.k] += sum(map(len, v1_parts(twin)))
                    native_bytes[2][s.k] += sum(map(len, native_encoders[s.k % 2].encode(twin)))
                s.native_records.clear()
                t += 0.01
    for w in (*writers[1], *writers[2]):
        w.close()
    largest = max(per_session[2])
    return {
        "sessions": n_sessions,
        "calls_per_session": calls,
        "records": sum(s.calls for s in sessions) + sum(s.retry_at is not None for s in sessions),
        "files": len(list((folder / "v2").glob("*.jsonl"))),
        "bytes": sum(p.stat().st_size for p in (folder / "v2").glob("*.jsonl")),
        "v1_bytes": sum(p.stat().st_size for p in (folder / "v1").glob("*.jsonl")),
        "session_bytes_v1": sum(per_session[1]) / n_sessions,
        "session_bytes_v2": sum(per_session[2]) / n_sessions,
        "native_session_bytes_v1": sum(native_bytes[1]) / n_sessions if cfg.native else None,
        "native_session_bytes_v2": sum(native_bytes[2]) / n_sessions if cfg.native else None,
        "largest_session_bytes": largest,
        "prompt_tokens": sum(s.prompt_total for s in sessions),
        "sampled_tokens": sum(s.sampled for s in sessions),
        "expected_traces": n_sessions
        + sum(s.compact_at is not None for s in sessions)
        + sum(s.retry_at is not None for s in sessions),
    }


# ---------------------------------------------------------------- measured phases (child processes)


def phase_parse(folder: Path) -> dict[str, Any]:
    """The baseline: every line of every file parsed, nothing more (read in blocks, cut at each newline)."""
    from reconstruct._json import BACKEND, loads

    rss0 = _maxrss()
    start, cpu = time.perf_counter(), time.process_time()
    lines = 0
    for path in sorted(folder.glob("*.jsonl")):
        with open(path, "rb") as f:
            rest = b""  # the start of a line that runs into the next block
            while block := f.read(8 << 20):
                i = 0
                while (j := block.find(b"\n", i)) >= 0:
                    loads(rest + block[i:j] if rest else block[i:j])
                    lines += 1
                    rest, i = b"", j + 1
                rest += block[i:]
    return {
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu,
        "lines": lines,
        "json": BACKEND,
        "rss_start": rss0,
        "rss_peak": _maxrss(),
    }


def phase_reconstruct(folder: Path, out: Path, jobs: int) -> dict[str, Any]:
    from reconstruct import reconstruct, write_trajectories

    rss0 = _maxrss()
    start, cpu = time.perf_counter(), _cpu()
    df, stats = reconstruct([folder], jobs=jobs)
    write_trajectories(df, stats, out)
    return {
        "seconds": time.perf_counter() - start,
        "cpu_seconds": _cpu() - cpu,  # workers included
        "worker_rss_peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
        "rss_start": rss0,
        "rss_peak": _maxrss(),
        "traces": stats.traces,
        "calls": stats.calls,
        "merged_calls": stats.merged_calls,
        "trainable": stats.tokens_trainable,
        "masked": stats.tokens_masked,
        "prompt": stats.tokens_prompt,
        "breaks": stats.breaks,
        "parquet_bytes": out.stat().st_size,
    }


def fastest(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest run, with every run's time and the largest peak memory."""
    best = min(runs, key=lambda r: r["seconds"])
    return {
        **best,
        "all_seconds": [round(r["seconds"], 3) for r in runs],
        "cpu_seconds": min(r["cpu_seconds"] for r in runs),
        "rss_peak": max(r["rss_peak"] for r in runs),
    }


def _cpu() -> float:
    own, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + workers.ru_utime + workers.ru_stime


def _maxrss() -> int:
    """This process's peak RSS: VmHWM, which a new program starts afresh (ru_maxrss keeps the parent's peak across
    fork and exec: a parent that generated the captures would show in every child)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def child(cfg: Config, phase: str, folder: Path) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "tests.bench.reconstruct",
        "--phase",
        phase,
        "--captures",
        str(folder),
        "--jobs",
        str(cfg.jobs),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{phase} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- report


def report(
    cfg: Config, gen: dict[str, Any], parse: dict[str, Any], rec: dict[str, Any], par: dict[str, Any], gen_s: float
) -> tuple[list[Table], str, dict[str, Any]]:
    mb = 1 << 20
    ratio = rec["seconds"] / parse["seconds"]
    size_ratio = gen["session_bytes_v2"] / gen["session_bytes_v1"]
    native_v1, native_v2 = gen.get("native_session_bytes_v1"), gen.get("native_session_bytes_v2")
    native_ratio = native_v2 / native_v1 if native_v1 and native_v2 else None
    cpu_ratio = rec["cpu_seconds"] / parse["cpu_seconds"]
    par_ratio = par["seconds"] / parse["seconds"]
    calls_tokens = gen["prompt_tokens"] + gen["sampled_tokens"]
    trace_tokens = rec["prompt"] + rec["trainable"] + rec["masked"]
    rows = [
        ("capture set (v2)", (f"{gen['sessions']} sessions x {gen['calls_per_session']} calls, {gen['records']:,} records, "
                         f"{gen['files']} files, {gen['bytes'] / mb:,.0f} MB; v1: {gen['v1_bytes'] / mb:,.0f} MB")),
        ("bytes per session: v2 / v1", f"{gen['session_bytes_v2'] / mb:,.2f} / {gen['session_bytes_v1'] / mb:,.2f} MB"),
        *([("bytes per session, Anthropic Messages translated: v2 / v1",
            f"{native_v2 / mb:,.2f} / {native_v1 / mb:,.2f} MB")] if native_ratio is not None else []),
        ("tokens in the calls (prompts + sampled)", f"{calls_tokens:,}"),
        ("tokens in the traces (prompt + response)", f"{trace_tokens:,} in {rec['traces']:,} traces"),
        (f"baseline: read + parse every v1 line ({parse['json']}), wall / CPU", f"{parse['seconds']:.2f} / {parse['cpu_seconds']:.2f} s"),
        ("reconstruct v2, 1 process (index, expand, parse, merge, write Parquet), wall / CPU", f"{rec['seconds']:.2f} / {rec['cpu_seconds']:.2f} s"),
        (f"reconstruct --jobs {cfg.jobs}, wall / CPU (all processes)", f"{par['seconds']:.2f} / {par['cpu_seconds']:.2f} s"),
        ("throughput: call tokens / s", f"{calls_tokens / rec['seconds'] / 1e6:,.1f} M"),
        ("throughput: capture MB / s", f"{gen['bytes'] / mb / rec['seconds']:,.0f}"),
        ("peak RSS: reconstruct / baseline parse", f"{rec['rss_peak'] / mb:,.0f} / {parse['rss_peak'] / mb:,.0f} MB"),
        ("peak RSS above imports: reconstruct", f"{(rec['rss_peak'] - rec['rss_start']) / mb:,.0f} MB"),
        (f"peak RSS, --jobs {cfg.jobs}: parent / largest worker", f"{par['rss_peak'] / mb:,.0f} / {par['worker_rss_peak'] / mb:,.0f} MB"),
        ("largest session / whole capture set", f"{gen['largest_session_bytes'] / mb:,.1f} / {gen['bytes'] / mb:,.0f} MB"),
        ("output Parquet", f"{rec['parquet_bytes'] / mb:,.1f} MB"),
    ]  # fmt: skip
    targets = [
        ("capture bytes per session, v2 / v1", f"{size_ratio:.3f}", f"<= {SIZE_TARGET}",
         "PASS" if size_ratio <= SIZE_TARGET else "MISS"),
        *([("capture bytes per session, v2 / v1, Anthropic Messages (translated)", f"{native_ratio:.3f}",
            f"<= {SIZE_TARGET}", "PASS" if native_ratio <= SIZE_TARGET else "MISS")] if native_ratio is not None else []),
        ("reconstruct (v2) / baseline (v1 parse), 1 process, wall", f"{ratio:.2f}x", "<= 1.0x",
         "PASS" if ratio <= TARGET else "MISS"),
        ("reconstruct / baseline, 1 process, CPU", f"{cpu_ratio:.2f}x", "", "info"),
        (f"reconstruct --jobs {cfg.jobs} / baseline, wall", f"{par_ratio:.2f}x", "", "info"),
        ("peak RSS above imports, 1 process / largest session",
         f"{(rec['rss_peak'] - rec['rss_start']) / mb:,.0f} / {gen['largest_session_bytes'] / mb:,.1f} MB", "", "info"),
    ]  # fmt: skip
    table = Table(title="Reconstruction benchmark: targets")
    for column in ("target", "measured", "limit", "result"):
        table.add_column(column, justify="left" if column == "target" else "right")
    for target in targets:
        table.add_row(*target)
    details = Table(title="Reconstruction benchmark: details")
    details.add_column("metric")
    details.add_column("value", justify="right")
    for name, value in rows:
        details.add_row(name, value)
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    notes = [
        (
            f"{when}, {_kind(cfg)} run, {platform.machine()} with {os.cpu_count()} CPUs shared with "
            f"other work (load average at the end {os.getloadavg()[0]:.1f}); Python {platform.python_version()}; generating the captures took {gen_s:.0f} s (not measured)."
        ),
        (
            f"Baseline and reconstruction each run in a fresh child process, alternated, fastest of {len(parse['all_seconds'])} "
            f"counted (baseline runs {parse['all_seconds']} s, reconstruction runs {rec['all_seconds']} s, with --jobs "
            f"{cfg.jobs} {par['all_seconds']} s); files in the page "
            "cache (the generator just wrote them); peak RSS is the child's VmHWM, imports included."
        ),
        (
            "Prompts grow linearly per session; every other session streamed (one SSE chunk per sampled token); a "
            "compaction every 10th session and a retried call every 7th; sessions interleaved over two writers."
        ),
        (
            f"Check: trainable tokens {rec['trainable']:,} = sampled tokens {gen['sampled_tokens']:,}; traces "
            f"{rec['traces']:,} = expected {gen['expected_traces']:,}; breaks {rec['breaks']}."
        ),
    ]
    if ratio > TARGET:
        notes.append(f"MISS: {CLOSE_THE_GAP}")
    md = [
        "| target | measured | limit | result |",
        "| --- | ---: | ---: | --- |",
        *[f"| {' | '.join(t)} |" for t in targets],
        "",
        "| metric | value |",
        "| --- | ---: |",
        *[f"| {n} | {v} |" for n, v in rows],
        "",
        *[f"- {n}" for n in notes],
    ]
    raw = {
        "config": dataclasses.asdict(cfg) | {"out": str(cfg.out), "keep": str(cfg.keep)},
        "generated": gen,
        "parse": parse,
        "reconstruct": rec,
        "parallel": par,
        "ratio": ratio,
        "cpu_ratio": cpu_ratio,
        "parallel_ratio": par_ratio,
        "targets": [
            dict(zip(("name", "measured", "limit", "result"), t, strict=True))
            | (
                {"close": CLOSE_THE_SIZE if t[0].startswith("capture bytes") else CLOSE_THE_GAP}
                if t[3] == "MISS"
                else {}
            )
            for t in targets
        ],
        "when": when,
    }
    return [table, details], "\n".join(md) + "\n", raw


def _kind(cfg: Config) -> str:
    return "quick" if cfg.quick else "full" if cfg.scale == 1 and cfg.sessions is None else f"scale {cfg.scale:g}"


def main(cfg: Config) -> int:
    if cfg.phase != "all":
        assert cfg.captures is not None
        if cfg.phase == "parse":
            result = phase_parse(cfg.captures)
        else:
            jobs = 1 if cfg.phase == "reconstruct" else cfg.jobs
            result = phase_reconstruct(cfg.captures, cfg.captures.parent / f"trajectories-{jobs}.parquet", jobs)
        print(json.dumps(result))
        return 0
    work = cfg.keep or Path(tempfile.mkdtemp(prefix="bench-reconstruct-"))
    folder = work / "captures"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        with console.status("generating captures"):
            started = time.perf_counter()
            gen = generate(folder, cfg)
            gen_s = time.perf_counter() - started
        console.print(f"generated {gen['records']:,} records, {gen['bytes'] >> 20:,} MB in {gen_s:.0f} s")
        runs: dict[str, list[dict[str, Any]]] = {"parse": [], "reconstruct": [], "parallel": []}
        repeats = cfg.repeats or (3 if cfg.quick else 2)
        for i in range(repeats):  # alternated, so load from other work hits both alike
            for phase in runs:
                with console.status(f"run {i + 1}/{repeats}: {phase}"):
                    runs[phase].append(child(cfg, phase, folder / ("v1" if phase == "parse" else "v2")))
        parse, rec, par = (fastest(runs[p]) for p in ("parse", "reconstruct", "parallel"))
    finally:
        if cfg.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    tables, md, raw = report(cfg, gen, parse, rec, par, gen_s)
    for table in tables:
        console.print(table)
    if raw["ratio"] > TARGET:
        console.print(f"MISS: {CLOSE_THE_GAP}", markup=False, soft_wrap=True)
    out = cfg.out if cfg.out.is_absolute() else ROOT / cfg.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    out.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")
    console.print(f"wrote {out} and {out.with_suffix('.json')}")
    ok = all(r["trainable"] == gen["sampled_tokens"] and r["traces"] == gen["expected_traces"] for r in (rec, par))
    if not ok:
        console.print("[red]reconstruction check failed[/]")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Config)))
