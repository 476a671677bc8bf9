"""Benchmark the capture proxy's overhead: direct vs bare mitmdump vs mitmdump + addon/polar.py.

Run:  make bench
  or  .venv/bin/python -m tests.bench.proxy [--quick] [--out tests/bench/results/proxy.md]

Starts the fake vLLM upstream (``tests/bench/upstream.py``) and reverse proxies on loopback:
  mitmdump --mode reverse:http://127.0.0.1:UP --listen-host 127.0.0.1 -p P1 -q
  mitmdump ... -p P2 -q -s <tmp>/stream_sse.py      (streaming on: event streams pass chunk by chunk)
  mitmdump ... -p P3 -q -s addon/polar.py --set polar_dir=<tmp> --set polar_upstream=vllm
then, over rounds that rotate the order of the paths (so load from other processes hits them
alike), measures (a) latency of non-streamed ~100 KB agent requests, (b) first byte and total
time of 200-chunk SSE streams, (c) requests/s at concurrency 1 (the sequential run of (a)) and 16
(one keep-alive httpx.Client per thread), plus the proxy's own CPU time per request. The requests
are the calls of one agent session (``payload.session_bodies``): the same ~100 KB history, each
with its own last turn. Bare mitmdump buffers a stream and sends it whole; the addon streams it,
which costs more per stream, so the streams' CPU target compares the addon with mitmdump with
streaming on (a six-line script that sets ``flow.response.stream`` for event streams, as the addon
does; ``stream_large_bodies`` would stream the requests too), which runs the stream workload only.
Two more paths split the addon's CPU per request: mitmdump with a script that has the addon's per-call hooks,
each empty (what mitmproxy itself costs to host them), and the addon with its records dropped where the hooks hand
them to the writer thread (``unrecorded``: the addon's request handling; addon - unrecorded is recording).
Then, through
the same mitmdump + addon, the translation phase (``tests/bench/translate.py``): the same ~2 KB
agent turn as Chat Completions (the plain path), Anthropic Messages, OpenAI Responses and Google
streamGenerateContent, interleaved call by call in a rotating order, for each: first event and total
time of streams, per-chunk overhead against chat, non-streamed latency; every answer is checked.
Prints tables with the targets (addon median latency and CPU per request <= 1.10x bare, CPU per
stream <= 1.3x streaming on, first byte <= direct + 5 ms, throughput >= 90 % of bare, translated
first event <= chat + 5 ms per API) and writes them as Markdown, with the raw numbers as JSON next
to it.

Then the memory phase: fresh bare and addon mitmdumps, one after the other, each serving 16 long sessions at once
(50 streamed calls each, the history growing to ~120 KB, 300-chunk answers) while their RSS is sampled every
20 ms (idle, peak, end; in the notes and the JSON's ``memory``). ``--ab-addon PATH`` adds one more path,
``addon-base``, running another addon (an older checkout's ``addon/polar.py``) in the same rotating rounds: its CPU
per request and per stream against the addon's is an A/B of a change (notes and JSON).

Client, upstream and proxies share the machine's cores, so absolute numbers depend on it; compare
ratios, and the CPU rows when the machine is busy. Bare mitmdump buffers SSE (it streams only when
an addon sets ``flow.response.stream``), so its first byte is its total time. Exit status 0 when
every path ran cleanly (targets may still MISS: this is a benchmark, not a test); 1 when the addon
did not load, a path returned errors, or the addon wrote no capture records.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path

import httpx
import tyro
from rich.console import Console
from rich.progress import Progress

from tests.bench import translate
from tests.bench.payload import session_bodies
from tests.bench.procs import ROOT, cpu_seconds, start_mitmdump, start_upstream, stop
from tests.bench.report import console_tables, evaluate, markdown, summarize

URL_PATH = "/v1/chat/completions"
# The API key doubles as the session id for the addon (addon/session.py).
HEADERS = {"content-type": "application/json", "authorization": "Bearer bench-session"}
MAX_ERRORS = 20  # a path that fails this often is dropped for the rest of the run
WORKLOADS = ("latency", "stream", "concurrent")
# What would close a target that misses, as measured on a 2-core box (issue 17).
_CPU_GAP = (
    "mitmproxy's own cost of hosting the addon's per-call hooks is at the noise (the hooks - bare row: the same hooks, "
    "empty); what is left is the addon's own Python, split by the rows below it: its request hook (session and header "
    "handling, the top-level JSON check of what differs from the session's last body in addon/resent.py, splicing "
    "the token fields in, the output cap check) and recording (the writer thread builds the record, finds what it "
    "shares with the session's previous one, compresses it and writes it). Closing it takes less Python per call "
    "than the standard library's JSON and zlib leave room for: a compiled JSON checker and record encoder (the addon "
    "imports the standard library only)."
)
CLOSE_IT = {
    "addon / bare, proxy CPU per request": _CPU_GAP,
    "addon / bare, median latency": "on a busy box the proxies' CPU is the latency; the CPU-per-request gap (above).",
    "addon / bare, req/s at concurrency 1": "the CPU per request: client, upstream and proxy share the cores.",
    "addon / bare, req/s at concurrency 16": (
        "the CPU per request at concurrency 16 (its row in the table): with the cores saturated by client, upstream "
        "and proxies, requests/s follows 1 / CPU per request."
    ),
    "addon / streaming on, proxy CPU per stream": "the same per-call costs as the CPU per request, over 200 chunks.",
    "addon - direct, stream first byte": (
        "mitmdump itself, streaming on and recording nothing, takes about as long to its first byte (the next row): "
        "passing a ~100 KB request through mitmproxy costs more than 5 ms here, whatever the addon does."
    ),
}
LIFECYCLE_HOOKS = frozenset(("load", "configure", "running", "done", "update"))  # once a run, not once a call


def hooks_script() -> str:
    """A script with the addon's per-call hooks (``addon/polar.py``'s addons, as loaded), each doing nothing: what
    mitmproxy itself costs per call to host them, the addon's own work left out."""
    import mitmproxy.proxy.layers  # noqa: F401 - registers the hooks of every layer in hooks.all_hooks
    from mitmproxy import hooks

    from addon import polar

    classes, names = [], []
    for i, addon in enumerate(polar.addons):
        defined = sorted(n for n in hooks.all_hooks if n not in LIFECYCLE_HOOKS and callable(getattr(addon, n, None)))
        body = "".join(f"    def {name}(self, data):\n        pass\n\n" for name in defined) or "    pass\n"
        classes.append(f"class Hooks{i}:  # {type(addon).__name__}: {', '.join(defined)}\n{body}")
        names.append(f"Hooks{i}()")
    return "\n".join(classes) + f"\naddons = [{', '.join(names)}]\n"


# The addon with its records dropped where the hooks hand them to the writer thread: addon - unrecorded is what
# recording costs (building, encoding and writing the line), unrecorded - hooks the addon's request handling.
UNRECORDED_SCRIPT = """\
import sys
sys.path.insert(0, {root!r})
from addon import polar
from addon.writer import CaptureWriter

CaptureWriter.submit = lambda self, exchange: None
addons = polar.addons
"""


# The fair baseline for streams: mitmdump streaming event streams as the addon does, recording nothing.
STREAM_SSE_SCRIPT = """\
class StreamEventStreams:
    def responseheaders(self, flow):
        if flow.response.headers.get("content-type", "").startswith("text/event-stream"):
            flow.response.stream = True


addons = [StreamEventStreams()]
"""


@dataclasses.dataclass
class Config:
    """Proxy overhead benchmark."""

    quick: bool = False
    """Short run (about 20 s): fewer rounds and requests, noisier numbers."""
    out: Path = Path("tests/bench/results/proxy.md")
    """Markdown results file (relative to the repository root); the JSON goes next to it as .json."""
    addon: Path = Path("addon/polar.py")
    """Capture addon loaded by the third path (relative to the repository root)."""
    polar_format: int = 2
    """Capture format the addon writes (its polar_format option): 2, the default, or 1 (for an A/B)."""
    # ---- workload
    body_kb: int = 100
    """Size of each non-streamed JSON request body, in KB."""
    stream_body_kb: int = 100
    """Size of each streamed request body, in KB (agents resend the whole history every turn)."""
    chunks: int = 200
    """SSE chunks per streamed response."""
    concurrency: int = 16
    """Client threads (one keep-alive connection each) for the concurrent throughput run."""
    apis: bool = True
    """Also measure each API through the translating addon: chat, anthropic, responses, google."""
    ab_addon: Path | None = None
    """A second addon (e.g. an older checkout's addon/polar.py, exported with ``git archive``) run as one more path,
    ``addon-base``, in the same rounds: its CPU per request and per stream against the addon's is an A/B of a change
    (notes and JSON; the targets still compare the addon with bare mitmdump)."""
    memory: bool = True
    """Also measure memory: fresh bare and addon mitmdumps, each serving --memory-sessions long sessions at once
    (streamed, their history growing call by call); their RSS is sampled throughout."""
    memory_sessions: int = 16
    """Concurrent sessions of the memory phase."""
    memory_calls: int = 50
    """Calls per session in the memory phase (the history grows ~2.3 KB a call, to ~120 KB: ~30K tokens)."""
    memory_chunks: int = 300
    """SSE chunks (sampled tokens) per answer in the memory phase."""

    def __post_init__(self) -> None:
        if min(self.body_kb, self.stream_body_kb, self.chunks) < 1 or self.concurrency < 2:
            raise ValueError("--body-kb, --stream-body-kb and --chunks must be >= 1, --concurrency >= 2")


@dataclasses.dataclass(frozen=True)
class Plan:
    rounds: int
    seq: int  # non-streamed requests per path per round
    streams: int  # streamed requests per path per round
    conc: int  # requests per path per round in the concurrent run
    limit_s: int  # hard bound on every child process's life
    api_rounds: int  # translation phase: rounds of api_streams then api_seq calls per API
    api_streams: int  # streamed calls per API per round, the APIs' order rotating with every call
    api_seq: int  # non-streamed calls per API per round, likewise


def make_plan(cfg: Config) -> Plan:
    """Many short rounds; 12 in a full run, so that each path goes first, second, ... equally often (three paths
    run every workload, four the streams)."""
    if cfg.quick:  # about 20 s on 2 cores, and 15 s more for the translation phase
        return Plan(
            rounds=3, seq=50, streams=6, conc=6 * cfg.concurrency, limit_s=300, api_rounds=2, api_streams=12, api_seq=16
        )
    # about 100 s, and 40 s more for the translation phase
    return Plan(
        rounds=12, seq=75, streams=10, conc=10 * cfg.concurrency, limit_s=900, api_rounds=6, api_streams=16, api_seq=40
    )


@dataclasses.dataclass
class Target:
    """One path to the upstream, with its clients and everything measured on it."""

    name: str  # direct | mitmdump | streaming | addon
    base_url: str
    workloads: tuple[str, ...] = WORKLOADS  # the streaming baseline runs the streams only
    proc: subprocess.Popen[bytes] | None = None
    cpu_pid: int | None = None  # the mitmdump process itself (proc may be its `timeout` wrapper)
    log: Path | None = None
    client: httpx.Client | None = None
    pool: list[httpx.Client] = dataclasses.field(default_factory=list)
    requests: int = 0  # everything sent, warm-up included (the addon should record each one)
    errors: int = 0
    error_samples: list[str] = dataclasses.field(default_factory=list)
    lat_ms: list[float] = dataclasses.field(default_factory=list)
    ttfb_ms: list[float] = dataclasses.field(default_factory=list)
    stream_ms: list[float] = dataclasses.field(default_factory=list)
    rps1: list[float] = dataclasses.field(default_factory=list)  # one value per round
    rpsn: list[float] = dataclasses.field(default_factory=list)
    cpu_s: dict[str, float] = dataclasses.field(default_factory=dict)  # proxy CPU seconds per workload
    cpu_n: dict[str, int] = dataclasses.field(default_factory=dict)  # requests per workload
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def alive(self) -> bool:
        return self.errors < MAX_ERRORS and (self.proc is None or self.proc.poll() is None)

    def sent(self) -> None:
        with self.lock:  # the concurrent run's threads count here too
            self.requests += 1

    def fail(self, what: str) -> None:
        with self.lock:
            self.errors += 1
            if len(self.error_samples) < 5:
                self.error_samples.append(what[:300])

    def open_clients(self, concurrency: int) -> None:
        def client() -> httpx.Client:
            limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
            return httpx.Client(base_url=self.base_url, timeout=30.0, limits=limits)

        self.client = client()
        self.pool = [client() for _ in range(concurrency)]

    def close_clients(self) -> None:
        for c in [self.client, *self.pool]:
            if c is not None:
                c.close()

    def raw(self) -> dict[str, object]:
        """What the results JSON keeps of this path beside its summary: counts and per-round values."""
        return {
            "requests": self.requests,
            "errors": self.errors,
            "error_samples": self.error_samples,
            "samples": {"latency": len(self.lat_ms), "streams": len(self.ttfb_ms)},
            "rps_c1_per_round": self.rps1,
            "rps_cn_per_round": self.rpsn,
            "proxy_cpu_s": self.cpu_s,
            "proxy_cpu_requests": self.cpu_n,
        }


# ---------------------------------------------------------------- measurements


def _post(t: Target, c: httpx.Client, body: bytes) -> bool:
    t.sent()
    try:
        r = c.post(URL_PATH, content=body, headers=HEADERS)
    except httpx.HTTPError as e:
        t.fail(f"{type(e).__name__}: {e}")
        return False
    if r.status_code != 200:
        t.fail(f"HTTP {r.status_code}: {r.text[:200]}")
        return False
    return True


Bodies = Callable[[], bytes]  # the next request body of the session


def run_sequential(t: Target, bodies: Bodies, n: int, record: bool = True) -> None:
    """n non-streamed requests on one connection: latency samples and requests/s at concurrency 1."""
    assert t.client is not None
    lat: list[float] = []
    start = time.perf_counter()
    for _ in range(n):
        if not t.alive:
            return
        body = bodies()
        t0 = time.perf_counter()
        if _post(t, t.client, body):
            lat.append((time.perf_counter() - t0) * 1e3)
    if record:
        t.lat_ms += lat
        t.rps1.append(len(lat) / (time.perf_counter() - start))


def run_streams(t: Target, bodies: Bodies, n: int, chunks: int, record: bool = True) -> None:
    """n streamed requests: time to the first body bytes and to the end of the stream."""
    assert t.client is not None
    for _ in range(n):
        if not t.alive:
            return
        t.sent()
        parts: list[bytes] = []
        first = 0.0
        body = bodies()
        t0 = time.perf_counter()
        try:
            with t.client.stream("POST", URL_PATH, content=body, headers=HEADERS) as r:
                for raw in r.iter_raw():
                    if raw and not first:
                        first = time.perf_counter()
                    parts.append(raw)
        except httpx.HTTPError as e:
            t.fail(f"stream {type(e).__name__}: {e}")
            continue
        end = time.perf_counter()
        events = b"".join(parts).count(b"data: ")
        if r.status_code != 200 or events != chunks + 1:  # every chunk and [DONE] must come through
            t.fail(f"stream HTTP {r.status_code}, {events} events (want {chunks + 1})")
        elif record:
            t.ttfb_ms.append((first - t0) * 1e3)
            t.stream_ms.append((end - t0) * 1e3)


def run_concurrent(t: Target, bodies: Bodies, n: int, record: bool = True) -> None:
    """n non-streamed requests spread over the pool's threads, started together: requests/s."""
    k = len(t.pool)
    barrier = threading.Barrier(k + 1)
    batches = [[bodies() for _ in range(n // k)] for _ in range(k)]  # drawn here: the threads share no iterator

    def worker(c: httpx.Client, batch: list[bytes]) -> int:
        barrier.wait(timeout=30)
        return sum(_post(t, c, body) for body in batch if t.alive)

    with ThreadPoolExecutor(k) as ex:
        futures = [ex.submit(worker, c, batch) for c, batch in zip(t.pool, batches, strict=True)]
        barrier.wait(timeout=30)
        t0 = time.perf_counter()
        ok = sum(f.result() for f in futures)
        wall = time.perf_counter() - t0
    if record and t.alive:
        t.rpsn.append(ok / wall)


def wait_recorded(t: Target, timeout_s: float = 10.0) -> None:
    """Until the addon has written every record it was handed (its health answer's backlog is empty)."""
    assert t.client is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if t.client.get("/polar/health").json().get("backlog_bytes") == 0:
                return
        except (httpx.HTTPError, ValueError):
            return  # an addon without the health answer: nothing to wait for
        time.sleep(0.005)


def measure(targets: list[Target], cfg: Config, plan: Plan, console: Console) -> None:
    plain = session_bodies(64, target_bytes=cfg.body_kb * 1000)
    streamed = session_bodies(
        16, target_bytes=cfg.stream_body_kb * 1000, stream=True, extra={"bench_chunks": cfg.chunks}
    )
    body, sbody = itertools.cycle(plain).__next__, itertools.cycle(streamed).__next__
    workloads: list[tuple[str, Callable[[Target], None]]] = [
        ("latency", lambda t: run_sequential(t, body, plan.seq)),
        ("stream", lambda t: run_streams(t, sbody, plan.streams, cfg.chunks)),
        ("concurrent", lambda t: run_concurrent(t, body, plan.conc)),
    ]
    console.print(
        f"{plan.rounds} rounds x ({plan.seq} requests of {len(plain[0]) / 1000:.0f} KB, {plan.streams} streams of "
        f"{cfg.chunks} chunks for {len(streamed[0]) / 1000:.0f} KB requests, {plan.conc} requests at "
        f"concurrency {cfg.concurrency}) per path"
    )
    runs = sum(len(t.workloads) for t in targets)
    with Progress(console=console) as prog:
        task = prog.add_task("warm-up", total=len(targets) + plan.rounds * runs)
        for t in targets:
            prog.update(task, description=f"warm-up {t.name}")
            if "latency" in t.workloads:
                run_sequential(t, body, 20, record=False)
            run_streams(t, sbody, 2, cfg.chunks, record=False)
            if "concurrent" in t.workloads:
                run_concurrent(t, body, 2 * cfg.concurrency, record=False)  # opens the pool's connections
            prog.advance(task)
        for r in range(plan.rounds):
            for wname, run in workloads:
                paths = [t for t in targets if wname in t.workloads]
                order = paths[r % len(paths) :] + paths[: r % len(paths)]
                for t in order:
                    prog.update(task, description=f"round {r + 1}/{plan.rounds} {wname:<10} {t.name}")
                    gc.collect()
                    cpu0, n0 = cpu_seconds(t.cpu_pid), t.requests
                    run(t)
                    if t.name.startswith("addon"):
                        wait_recorded(t)  # the writer thread's work for these calls counts here, not in the next run
                    if cpu0 is not None and (cpu1 := cpu_seconds(t.cpu_pid)) is not None:
                        t.cpu_s[wname] = t.cpu_s.get(wname, 0.0) + cpu1 - cpu0
                        t.cpu_n[wname] = t.cpu_n.get(wname, 0) + t.requests - n0
                    prog.advance(task)


# ---------------------------------------------------------------- main


def start_paths(cfg: Config, plan: Plan, tmp: Path, polar_dir: Path, targets: list[Target]) -> str | None:
    """Append direct, bare mitmdump, mitmdump streaming on and (if it loads) the addon path to ``targets``; the
    addon's error."""
    up_proc, up_port = start_upstream(plan.limit_s)
    targets.append(Target("direct", f"http://127.0.0.1:{up_port}", proc=up_proc))
    addon = (ROOT / cfg.addon).resolve()
    addon_args = ["-s", str(addon), "--set", f"polar_dir={polar_dir}", "--set", "polar_upstream=vllm"]
    addon_args += ["--set", f"polar_format={cfg.polar_format}"]
    stream_script = tmp / "stream_sse.py"
    stream_script.write_text(STREAM_SSE_SCRIPT)
    hooks = tmp / "hooks_only.py"
    hooks.write_text(hooks_script())
    unrecorded = tmp / "unrecorded.py"
    unrecorded.write_text(UNRECORDED_SCRIPT.format(root=str(ROOT)))
    unrecorded_args = ["-s", str(unrecorded), "--set", f"polar_dir={tmp / 'captures-unrecorded'}"]
    unrecorded_args += ["--set", "polar_upstream=vllm", "--set", f"polar_format={cfg.polar_format}"]
    paths: list[tuple[str, list[str]]] = [("mitmdump", []), ("streaming", ["-s", str(stream_script)])]
    paths += [("hooks", ["-s", str(hooks)]), ("unrecorded", unrecorded_args), ("addon", addon_args)]
    for name, extra in paths:
        log = tmp / f"{name}.log"
        try:
            if name == "addon" and not addon.is_file():
                raise RuntimeError(f"{addon} does not exist")
            proc, port, pid = start_mitmdump(up_port, log, tmp / f"conf-{name}", plan.limit_s, extra)
        except RuntimeError as e:
            if name != "addon":
                raise
            return str(e)
        workloads = ("stream",) if name == "streaming" else WORKLOADS
        targets.append(Target(name, f"http://127.0.0.1:{port}", workloads, proc=proc, cpu_pid=pid, log=log))
    if cfg.ab_addon is not None:  # the A/B path: same options, its own capture folder
        base = (ROOT / cfg.ab_addon).resolve()
        base_dir = tmp / "captures-base"
        base_dir.mkdir()
        args = ["-s", str(base), "--set", f"polar_dir={base_dir}", "--set", "polar_upstream=vllm"]
        args += ["--set", f"polar_format={cfg.polar_format}"]
        log = tmp / "addon-base.log"
        proc, port, pid = start_mitmdump(up_port, log, tmp / "conf-addon-base", plan.limit_s, args)
        targets.append(Target("addon-base", f"http://127.0.0.1:{port}", WORKLOADS, proc=proc, cpu_pid=pid, log=log))
    return None


# ---------------------------------------------------------------- memory: long sessions at once


def rss_kb(pid: int | None) -> int | None:
    """The process's resident set (VmRSS) in KiB, from /proc."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def long_session_bodies(k: int, calls: int, chunks: int) -> list[bytes]:
    """Session ``k``'s streamed Chat Completions bodies: an ~8 KB start, then each call resends the history with the
    last answer (~1.2 KB) and a tool result (~1.1 KB) added, to ~120 KB at 50 calls."""
    start = session_bodies(1, target_bytes=8_000, stream=True)[0]
    body = json.loads(start)
    body["bench_chunks"] = chunks
    body["messages"][0]["content"] += f" (session {k})"  # each session its own history
    out = []
    for i in range(calls):
        out.append(json.dumps(body).encode())
        call = {"id": f"call_{i}", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
        body["messages"].append({"role": "assistant", "content": f"step {i}: " + "tok " * 300, "tool_calls": [call]})
        body["messages"].append({"role": "tool", "tool_call_id": f"call_{i}", "content": f"out {k}.{i} " * 110})
    return out


def _sample_rss(pid: int | None, peak: list[int], stop_sampling: threading.Event) -> None:
    while not stop_sampling.wait(0.02):
        peak[0] = max(peak[0], rss_kb(pid) or 0)


def _memory_session(url: str, k: int, bodies: list[bytes], chunks: int) -> int:
    """Session ``k``'s calls in turn on one keep-alive connection; how many failed."""
    failed = 0
    headers = {**HEADERS, "authorization": f"Bearer bench-memory-{k:02d}"}
    with httpx.Client(base_url=url, timeout=60.0) as c:
        for body in bodies:
            try:
                with c.stream("POST", URL_PATH, content=body, headers=headers) as r:
                    events = sum(raw.count(b"data: ") for raw in r.iter_raw())
                failed += r.status_code != 200 or events != chunks + 1
            except httpx.HTTPError:
                failed += 1
    return failed


def measure_memory(
    cfg: Config, plan: Plan, tmp: Path, up_port: int, addon_args: list[str], console: Console
) -> dict[str, dict[str, float | int | None]]:
    """Fresh bare and addon mitmdumps, one after the other, each serving ``memory_sessions`` sessions at once (one
    thread and keep-alive connection each, calls in turn): RSS before (idle, after one call) and its peak while the
    sessions ran, sampled every 20 ms; proxy CPU per call too."""
    bodies = [long_session_bodies(k, cfg.memory_calls, cfg.memory_chunks) for k in range(cfg.memory_sessions)]
    out: dict[str, dict[str, float | int | None]] = {}
    for name, extra in (("mitmdump", []), ("addon", addon_args)):
        log = tmp / f"memory-{name}.log"
        proc, port, pid = start_mitmdump(up_port, log, tmp / f"conf-memory-{name}", plan.limit_s, extra)
        errors = 0
        try:
            url = f"http://127.0.0.1:{port}"
            with httpx.Client(base_url=url, timeout=60.0) as c:  # one call: imports and pools warmed
                c.post(URL_PATH, content=bodies[0][0], headers={**HEADERS, "authorization": "Bearer warm"}).read()
            time.sleep(0.5)
            idle, peak, stop_sampling = rss_kb(pid), [0], threading.Event()
            sampler = threading.Thread(target=_sample_rss, args=(pid, peak, stop_sampling), daemon=True)
            sampler.start()
            cpu0, t0 = cpu_seconds(pid), time.perf_counter()
            with ThreadPoolExecutor(cfg.memory_sessions) as ex:
                n = len(bodies)
                errors = sum(ex.map(_memory_session, [url] * n, range(n), bodies, [cfg.memory_chunks] * n))
            wall, cpu1 = time.perf_counter() - t0, cpu_seconds(pid)
            stop_sampling.set()
            sampler.join()
            calls = cfg.memory_sessions * cfg.memory_calls
            out[name] = {
                "rss_idle_mb": idle / 1024 if idle else None,
                "rss_peak_mb": peak[0] / 1024,
                "rss_end_mb": (rss_kb(pid) or 0) / 1024,
                "cpu_ms_per_call": 1e3 * (cpu1 - cpu0) / calls if cpu0 is not None and cpu1 is not None else None,
                "wall_s": wall,
                "calls": calls,
                "errors": errors,
            }
            console.print(f"memory, {name}: {out[name]}")
        finally:
            stop(proc)
    return out


def count_records(polar_dir: Path) -> tuple[int, int, list[str], list[str]]:
    """(JSONL lines under polar_dir, their bytes, the first record's keys, every file there with its size)."""
    lines, size, keys = 0, 0, list[str]()
    for f in sorted(polar_dir.rglob("*.jsonl")):
        size += f.stat().st_size
        with f.open("rb") as fh:
            for line in fh:
                if not line.strip():
                    continue
                if not keys:
                    try:
                        keys = sorted(json.loads(line))
                    except (ValueError, TypeError):
                        keys = ["<not a JSON object>"]
                lines += 1
    files = [f"{p.relative_to(polar_dir)} ({p.stat().st_size} B)" for p in sorted(polar_dir.rglob("*")) if p.is_file()]
    return lines, size, keys, files


def log_problems(log: Path | None) -> list[str]:
    if log is None or not log.exists():
        return []
    words = ("error", "traceback", "exception", "warn")
    return [ln for ln in log.read_text(errors="replace").splitlines() if any(w in ln.lower() for w in words)][:10]


def _on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # so that the finally blocks stop every child


def main(cfg: Config) -> int:
    plan = make_plan(cfg)
    console = Console() if sys.stdout.isatty() else Console(width=130)  # no wrapped tables in logs
    signal.signal(signal.SIGTERM, _on_sigterm)
    t_start = time.monotonic()
    targets: list[Target] = []
    addon_error: str | None = None
    capture: dict[str, object] = {}  # what the addon wrote, for the JSON
    addon_log: list[str] = []
    api_paths: list[translate.ApiPath] = []
    memory: dict[str, dict[str, float | int | None]] = {}
    with tempfile.TemporaryDirectory(prefix="polar-bench-") as tmpname:
        tmp = Path(tmpname)
        polar_dir = tmp / "captures"
        polar_dir.mkdir()
        try:
            addon_error = start_paths(cfg, plan, tmp, polar_dir, targets)
            if addon_error:
                console.print(f"[bold red]addon did not load[/] ({cfg.addon}): {addon_error}")
                console.print("[yellow]continuing with direct vs bare mitmdump only[/]")
            for t in targets:
                t.open_clients(cfg.concurrency)
            measure(targets, cfg, plan, console)
            addon_t = next((t for t in targets if t.name == "addon"), None)
            if cfg.apis and addon_t is not None and addon_t.alive:
                api_paths = translate.measure(
                    addon_t.base_url,
                    addon_t.cpu_pid,
                    addon_t.sent,  # so the capture-record count below covers these calls too
                    chunks=cfg.chunks,
                    rounds=plan.api_rounds,
                    streams=plan.api_streams,
                    seq=plan.api_seq,
                    console=console,
                )
            if cfg.memory and addon_t is not None and addon_t.alive:
                up_port = int(targets[0].base_url.rsplit(":", 1)[1])
                memory_dir = tmp / "captures-memory"
                memory_dir.mkdir()
                args = ["-s", str((ROOT / cfg.addon).resolve()), "--set", f"polar_dir={memory_dir}"]
                args += ["--set", "polar_upstream=vllm", "--set", f"polar_format={cfg.polar_format}"]
                memory = measure_memory(cfg, plan, tmp, up_port, args, console)
        finally:
            died = [t for t in targets if t.proc is not None and t.proc.poll() is not None]
            for t in reversed(targets):  # proxies first, the upstream (direct's process) last
                t.close_clients()
                stop(t.proc)  # before counting records: the addon may flush in done()
        addon = next((t for t in targets if t.name == "addon"), None)
        if addon is not None:
            records, size, keys, files = count_records(polar_dir)
            capture = {"records": records, "bytes": size, "requests_sent": addon.requests, "record_keys": keys}
            capture["files"] = files[:20]
            addon_log = log_problems(addon.log)
            capture["log_problems"] = addon_log

    stats = {
        t.name: summarize(
            lat_ms=t.lat_ms,
            ttfb_ms=t.ttfb_ms,
            stream_ms=t.stream_ms,
            rps1=t.rps1,
            rpsn=t.rpsn,
            cpu_ms={k: 1e3 * t.cpu_s[k] / t.cpu_n[k] for k in t.cpu_s if t.cpu_n.get(k)},
        )
        for t in targets
    }
    verdicts = evaluate(stats, cfg.concurrency)
    api_stats = translate.summarize(api_paths, cfg.chunks) if api_paths else {}
    if api_paths:
        verdicts += translate.evaluate(api_stats)
    invalid = [f"{t.name}: {t.errors} failed requests, e.g. {t.error_samples[:2]}" for t in targets if t.errors]
    invalid += [
        f"translated {p.name}: {p.errors} failed or wrong answers of {p.requests}, e.g. {p.error_samples[:2]}"
        for p in api_paths
        if p.errors
    ]
    invalid += [
        f"{t.name}: its process exited during the run (status {t.proc.returncode if t.proc else '?'})" for t in died
    ]
    if addon_error:
        lines = addon_error.splitlines()
        invalid.append("addon did not load: " + " | ".join(dict.fromkeys([lines[0], *lines[-3:]])))
    elif capture.get("records") == 0:
        invalid.append(f"the addon wrote no capture records under polar_dir (files: {capture['files'] or 'none'})")

    overhead, target_table = console_tables(stats, verdicts, cfg.concurrency)
    console.print(overhead, *([translate.table(api_stats, cfg.chunks)] if api_paths else []), target_table)
    for v in verdicts:
        if v["result"] == "MISS" and v["name"] in CLOSE_IT:
            v["close"] = CLOSE_IT[str(v["name"])]
    notes = _notes(cfg, plan, time.monotonic() - t_start)
    notes += [
        f"MISS {v['name']}: {CLOSE_IT[str(v['name'])]}"
        for v in verdicts
        if v["result"] == "MISS" and v["name"] in CLOSE_IT
    ]
    if api_paths:
        notes.append(
            f"Translation phase: {plan.api_rounds} rounds, the APIs interleaved call by call in a rotating order; "
            f"per API and round {plan.api_streams} streams of {cfg.chunks} upstream chunks and {plan.api_seq} non-streamed "
            "calls of the same ~2 KB agent turn (system prompt, user message, a tool call and its result, three tools) in the "
            "API's own format, on one keep-alive connection to the same mitmdump + addon. First event: until the "
            "client holds one complete SSE event; every answer is checked (event names and counts, the text, the "
            "final event), and wrong ones count as failures. Per-chunk overhead = (stream total, API - chat) / chunks."
        )
    if addon is not None:
        n, sent, nbytes = capture["records"], capture["requests_sent"], capture["bytes"]
        per = f", {nbytes / n / 1000:.0f} KB per record" if isinstance(nbytes, int) and isinstance(n, int) and n else ""
        console.print(f"capture records: [{'green' if n else 'bold red'}]{n}[/] JSONL lines for {sent} requests{per}")
        notes.append(f"Capture records written by the addon: {n} JSONL lines for {sent} requests sent through it{per}.")
        if addon_log:
            console.print("[yellow]addon mitmdump log:[/]\n" + "\n".join(addon_log))
    invalid += [f"memory phase, {name}: {m['errors']} failed calls" for name, m in memory.items() if m["errors"]]
    if memory:
        notes.append(_memory_note(cfg, memory))
    if "addon-base" in stats:
        notes.append(_ab_note(cfg, stats))
        console.print(notes[-1])
    for line in invalid:
        console.print(f"[bold red]INVALID[/] {line}")
    notes += [f"INVALID: {line}" for line in invalid]

    out = cfg.out if cfg.out.is_absolute() else ROOT / cfg.out
    out.parent.mkdir(parents=True, exist_ok=True)
    api_md = translate.markdown_lines(api_stats, cfg.chunks) if api_paths else []
    out.write_text(markdown(stats, verdicts, cfg.concurrency, notes, api_md))
    doc = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(cfg).items()},
        "plan": dataclasses.asdict(plan),
        "stats": stats,
        "targets": verdicts,
        "paths": {t.name: t.raw() for t in targets},
        "apis": {"stats": api_stats, "paths": translate.raw(api_paths)},
        "addon": {"loaded": addon_error is None, "error": addon_error, **capture},
        "valid": not invalid,
        "memory": memory,
        "notes": notes,
    }
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    console.print(f"wrote {out} and {out.with_suffix('.json')} in {time.monotonic() - t_start:.0f} s")
    return 1 if invalid else 0


def _memory_note(cfg: Config, memory: dict[str, dict[str, float | int | None]]) -> str:
    def mb(name: str, key: str) -> str:
        value = memory.get(name, {}).get(key)
        return f"{value:.0f} MB" if isinstance(value, float) else "-"

    bare, addon = memory.get("mitmdump", {}), memory.get("addon", {})
    peak_b, peak_a = bare.get("rss_peak_mb"), addon.get("rss_peak_mb")
    ratio = f" ({peak_a / peak_b:.2f}x)" if isinstance(peak_a, float) and isinstance(peak_b, float) and peak_b else ""
    cpu = [m.get("cpu_ms_per_call") for m in (bare, addon)]
    cpu_text = f"; proxy CPU per call {cpu[0]:.1f} / {cpu[1]:.1f} ms" if all(isinstance(c, float) for c in cpu) else ""
    return (
        f"Memory: {cfg.memory_sessions} long sessions at once ({cfg.memory_calls} streamed calls each, the history "
        f"growing from ~8 KB to ~{8 + 2.3 * cfg.memory_calls:.0f} KB, {cfg.memory_chunks}-chunk answers), each path a "
        f"fresh mitmdump: RSS idle {mb('mitmdump', 'rss_idle_mb')} bare / {mb('addon', 'rss_idle_mb')} addon; peak "
        f"{mb('mitmdump', 'rss_peak_mb')} bare / {mb('addon', 'rss_peak_mb')} addon{ratio}; at the end "
        f"{mb('mitmdump', 'rss_end_mb')} / {mb('addon', 'rss_end_mb')} (VmRSS sampled every 20 ms){cpu_text}."
    )


def _ab_note(cfg: Config, stats: dict[str, dict[str, float | None]]) -> str:
    a, b = stats.get("addon", {}), stats.get("addon-base", {})
    rows = []
    for key, what in (("cpu_ms_latency", "per non-streamed request"), ("cpu_ms_stream", "per stream"),
                      ("cpu_ms_concurrent", "per request at concurrency 16")):  # fmt: skip
        x, y = a.get(key), b.get(key)
        if isinstance(x, float) and isinstance(y, float) and y:
            rows.append(f"{what} {x:.2f} / {y:.2f} ms ({x / y:.3f}x)")
    return f"A/B in the same rounds: proxy CPU, addon / addon-base ({cfg.ab_addon}): " + "; ".join(rows) + "."


def _notes(cfg: Config, plan: Plan, elapsed: float) -> list[str]:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return [
        (
            f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {'quick' if cfg.quick else 'full'} run ({elapsed:.0f} s), "
            f"{platform.machine()} with {cpus} CPUs shared by client, upstream and proxies (load average at the end "
            f"{os.getloadavg()[0]:.1f}); Python "
            f"{platform.python_version()}, mitmproxy {version('mitmproxy')}, httpx {version('httpx')}."
        ),
        (
            f"{plan.rounds} rounds rotating the order of the paths; per path and round: {plan.seq} non-streamed "
            f"{cfg.body_kb} KB requests on one keep-alive connection, {plan.streams} streams of {cfg.chunks} SSE chunks "
            f"({cfg.stream_body_kb} KB requests), {plan.conc} requests over {cfg.concurrency} keep-alive connections."
        ),
        (
            "Requests: the calls of one agent session, the same history with its own ~2 KB last turn each (agents "
            "resend their history with every call; the addon checks as JSON only what differs from the session's "
            "last body, addon/resent.py)."
        ),
        (
            "Latency percentiles pool all rounds; requests/s is the median over rounds; proxy CPU is the mitmdump "
            "process's user + system time per request. Bare mitmdump buffers SSE, so its first byte is its total time."
        ),
        (
            "Baselines: the non-streamed targets (latency, CPU per request, requests/s) compare with bare mitmdump, "
            "which handles a JSON answer as the addon does (buffered). The CPU-per-stream target compares with "
            "mitmdump streaming on (a script setting flow.response.stream for event streams, nothing recorded; it "
            "runs the stream workload only): bare mitmdump buffers a stream and sends it in one write, the addon "
            "must pass it on chunk by chunk, so bare / addon there measures streaming, not recording (kept as info)."
        ),
    ]


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Config)))
