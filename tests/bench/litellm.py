"""Side by side with what users would pick instead: LiteLLM's proxy, logging every call, against our addon.

Run:  .venv/bin/python -m tests.bench.litellm [--quick] [--out tests/bench/results/litellm.md]

The first run creates ``.venv-litellm`` (``litellm[proxy]`` pinned in ``tests/bench/litellm_proxy.py``,
a few minutes, not counted); later runs reuse it. Then it starts the fake vLLM upstream
(``tests/bench/upstream.py``) and four paths to it on loopback:
  direct            the upstream itself
  mitmdump          mitmdump --mode reverse:http://127.0.0.1:UP (bare, as ``tests.bench.proxy`` starts it)
  addon             the same with -s addon/polar.py --set polar_dir=<tmp> --set polar_upstream=vllm (recording)
  litellm           litellm --config <tmp>/litellm-config.yaml: the upstream as the OpenAI-compatible model
                    ``openai/bench-model``, one uvicorn worker, master key, no database, and
                    ``tests/bench/litellm_logger.py`` appending LiteLLM's standard logging payload as JSONL
and, over rounds that rotate the order of the paths, measures the proxy bench's workloads: latency of
non-streamed ~100 KB agent requests on one keep-alive connection (and so requests/s at concurrency
1), first byte and total of 200-chunk SSE streams, requests/s at concurrency 16 (one keep-alive
connection per thread), and each proxy's CPU (user + system of its process tree) per request. Every
answer is checked (the text the upstream sent, and the stream's end); a wrong one counts as a
failure. Afterwards it checks that both recorders logged every call and what their logs keep of the
token ids and sampled-token log-probs the upstream sent. Prints the tables and writes them as
Markdown, with the raw numbers as JSON next to it. No target: every row is "info".

Exit status 0 when every path ran cleanly and both recorders logged every call; 1 otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import tyro
from rich.console import Console
from rich.progress import Progress

from tests.bench import litellm_report as report
from tests.bench import proxy
from tests.bench.litellm_proxy import MODEL, ensure_venv, start_litellm
from tests.bench.payload import chat_body
from tests.bench.procs import ROOT, cpu_seconds, start_mitmdump, start_upstream, stop
from tests.bench.upstream import DEFAULT_CHUNKS, completion_text

URL_PATH = "/v1/chat/completions"
# Through LiteLLM the request body is rebuilt, so the stream length cannot ride in it: every path gets the default.
CHUNKS = DEFAULT_CHUNKS
STREAM_TEXT = "".join(f"tok{i} " for i in range(CHUNKS))  # what the upstream's chunks say, joined


@dataclasses.dataclass
class Config:
    """LiteLLM side-by-side benchmark."""

    quick: bool = False
    """Short run (under a minute on a quiet box once the venv exists): fewer rounds and requests, noisier numbers."""
    out: Path = Path("tests/bench/results/litellm.md")
    """Markdown results file (relative to the repository root); the JSON goes next to it as .json."""
    body_kb: int = 100
    """Size of each request body (non-streamed and streamed), in KB."""
    concurrency: int = 16
    """Client threads (one keep-alive connection each) for the concurrent throughput run."""

    def __post_init__(self) -> None:
        if self.body_kb < 1 or self.concurrency < 2:
            raise ValueError("--body-kb must be >= 1 and --concurrency >= 2")


@dataclasses.dataclass(frozen=True)
class Plan:
    rounds: int  # a multiple of 4, so that each path goes first, second, third and fourth equally often
    seq: int  # non-streamed requests per path per round
    streams: int  # streamed requests per path per round
    conc: int  # requests per path per round in the concurrent run
    limit_s: int  # hard bound on every child process's life


def make_plan(cfg: Config) -> Plan:
    # LiteLLM sets the pace: ~50 ms of CPU per 100 KB request and ~0.5 s per 200-chunk stream.
    if cfg.quick:  # about 45 s on a quiet 2-core box, LiteLLM's startup included
        return Plan(rounds=4, seq=10, streams=2, conc=2 * cfg.concurrency, limit_s=600)
    # about 2.5 min on a quiet 2-core box (5 min on one loaded four times over)
    return Plan(rounds=8, seq=30, streams=5, conc=5 * cfg.concurrency, limit_s=1200)


@dataclasses.dataclass
class Target(proxy.Target):
    """A path of the proxy bench that sends its own headers (LiteLLM wants its master key) and keeps the first good
    answer of each kind (to compare what the logs kept with what was answered)."""

    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    answers: dict[str, bytes] = dataclasses.field(default_factory=dict)  # the first good one of each kind

    def open_clients(self, concurrency: int) -> None:
        def client() -> httpx.Client:
            limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
            return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=60.0, limits=limits)

        self.client = client()
        self.pool = [client() for _ in range(concurrency)]

    def cpu(self) -> float | None:
        """User + system CPU seconds of the proxy's process tree so far; None for the direct path."""
        return None if self.name == "direct" or self.proc is None else tree_cpu_seconds(self.proc.pid)


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and all its descendants (Linux /proc; an exited child counts no more)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu_seconds(p) or 0.0
        for task in Path(f"/proc/{p}/task").glob("*"):  # each thread lists the children it forked
            with contextlib.suppress(OSError):  # it exited meanwhile
                todo += [int(c) for c in (task / "children").read_text().split()]
    return total


def settled_cpu(t: Target, max_s: float = 1.0) -> float | None:
    """The tree's CPU once it stops growing (at most ``max_s``): work a proxy does after answering
    (LiteLLM logs in background tasks) is charged to the workload that caused it."""
    last = t.cpu()
    deadline = time.monotonic() + max_s
    while last is not None and time.monotonic() < deadline:
        time.sleep(0.1)
        now = t.cpu()
        if now == last:
            break
        last = now
    return last


# ---------------------------------------------------------------- measurements


def _check_answer(body: bytes) -> str | None:
    """What is wrong with a non-streamed answer, or None when it carries the upstream's text."""
    try:
        text = json.loads(body)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        return f"unreadable answer ({type(e).__name__}): {body[:200]!r}"
    return None if text == completion_text() else f"wrong text: {str(text)[:100]!r}"


def _check_stream(raw: bytes) -> str | None:
    """What is wrong with an SSE answer, or None when its deltas join to the upstream's text and it ends with [DONE]."""
    events = [e.strip() for e in raw.decode(errors="replace").split("\n\n") if e.strip()]
    if not events or events[-1] != "data: [DONE]":
        return f"{len(events)} events, the last {events[-1][:80] if events else None!r} (want data: [DONE])"
    parts: list[str] = []
    try:
        for e in events[:-1]:
            for choice in json.loads(e.removeprefix("data: "))["choices"]:
                parts.append(choice.get("delta", {}).get("content") or "")
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable event ({type(e).__name__})"
    text = "".join(parts)
    return None if text == STREAM_TEXT else f"wrong text ({len(text)} chars, want {len(STREAM_TEXT)}): {text[:60]!r}"


def _post(t: Target, c: httpx.Client, body: bytes) -> float | None:
    """One checked non-streamed call: its latency in ms, or None when it failed or the answer was wrong."""
    t.sent()
    t0 = time.perf_counter()
    try:
        r = c.post(URL_PATH, content=body)
    except httpx.HTTPError as e:
        t.fail(f"{type(e).__name__}: {e}")
        return None
    ms = (time.perf_counter() - t0) * 1e3
    problem = f"HTTP {r.status_code}: {r.text[:200]}" if r.status_code != 200 else _check_answer(r.content)
    if problem:
        t.fail(problem)
        return None
    t.answers.setdefault("non-streamed", r.content)
    return ms


def run_sequential(t: Target, body: bytes, n: int, record: bool = True) -> None:
    """n non-streamed requests on one connection: latency samples and requests/s at concurrency 1."""
    assert t.client is not None
    lat: list[float] = []
    start = time.perf_counter()
    for _ in range(n):
        if not t.alive:
            return
        if (ms := _post(t, t.client, body)) is not None:
            lat.append(ms)
    if record:
        t.lat_ms += lat
        t.rps1.append(len(lat) / (time.perf_counter() - start))


def run_streams(t: Target, body: bytes, n: int, record: bool = True) -> None:
    """n streamed requests: time to the first body bytes and to the end of the stream."""
    assert t.client is not None
    for _ in range(n):
        if not t.alive:
            return
        t.sent()
        parts: list[bytes] = []
        first = 0.0
        t0 = time.perf_counter()
        try:
            with t.client.stream("POST", URL_PATH, content=body) as r:
                for raw in r.iter_raw():
                    if raw and not first:
                        first = time.perf_counter()
                    parts.append(raw)
        except httpx.HTTPError as e:
            t.fail(f"stream {type(e).__name__}: {e}")
            continue
        end = time.perf_counter()
        raw = b"".join(parts)
        problem = f"stream HTTP {r.status_code}" if r.status_code != 200 else _check_stream(raw)
        if problem:
            t.fail(problem)
            continue
        t.answers.setdefault("streamed", raw)
        if record:
            t.ttfb_ms.append((first - t0) * 1e3)
            t.stream_ms.append((end - t0) * 1e3)


def run_concurrent(t: Target, body: bytes, n: int, record: bool = True) -> None:
    """n non-streamed requests spread over the pool's threads, started together: requests/s."""
    k = len(t.pool)
    barrier = threading.Barrier(k + 1)

    def worker(c: httpx.Client) -> int:
        barrier.wait(timeout=60)
        return sum(_post(t, c, body) is not None for _ in range(n // k) if t.alive)

    with ThreadPoolExecutor(k) as ex:
        futures = [ex.submit(worker, c) for c in t.pool]
        barrier.wait(timeout=60)
        t0 = time.perf_counter()
        ok = sum(f.result() for f in futures)
        wall = time.perf_counter() - t0
    if record and t.alive:
        t.rpsn.append(ok / wall)


def measure(targets: list[Target], cfg: Config, plan: Plan, console: Console) -> None:
    body = json.dumps(chat_body(target_bytes=cfg.body_kb * 1000, model=MODEL)).encode()
    sbody = json.dumps(chat_body(target_bytes=cfg.body_kb * 1000, model=MODEL, stream=True)).encode()
    workloads: list[tuple[str, Callable[[Target], None]]] = [
        ("latency", lambda t: run_sequential(t, body, plan.seq)),
        ("stream", lambda t: run_streams(t, sbody, plan.streams)),
        ("concurrent", lambda t: run_concurrent(t, body, plan.conc)),
    ]
    console.print(
        f"{plan.rounds} rounds x ({plan.seq} requests of {len(body) / 1000:.0f} KB, {plan.streams} streams of "
        f"{CHUNKS} chunks for {len(sbody) / 1000:.0f} KB requests, {plan.conc} requests at "
        f"concurrency {cfg.concurrency}) per path"
    )
    with Progress(console=console) as prog:
        task = prog.add_task("warm-up", total=len(targets) * (1 + plan.rounds * len(workloads)))
        for t in targets:
            prog.update(task, description=f"warm-up {t.name}")
            run_sequential(t, body, 10, record=False)
            run_streams(t, sbody, 2, record=False)
            run_concurrent(t, body, cfg.concurrency, record=False)  # opens the pool's connections
            settled_cpu(t)  # so that no warm-up work is left for the first measured workload
            prog.advance(task)
        for r in range(plan.rounds):
            order = targets[r % len(targets) :] + targets[: r % len(targets)]
            for wname, run in workloads:
                for t in order:
                    prog.update(task, description=f"round {r + 1}/{plan.rounds} {wname:<10} {t.name}")
                    gc.collect()
                    # Settled after the previous workload, idle since: no need to wait here.
                    cpu0, n0 = t.cpu(), t.requests
                    run(t)
                    if cpu0 is not None and (cpu1 := settled_cpu(t)) is not None:
                        t.cpu_s[wname] = t.cpu_s.get(wname, 0.0) + cpu1 - cpu0
                        t.cpu_n[wname] = t.cpu_n.get(wname, 0) + t.requests - n0
                    prog.advance(task)


# ---------------------------------------------------------------- main


def start_paths(
    plan: Plan, tmp: Path, polar_dir: Path, litellm_log: Path, targets: list[Target], console: Console
) -> None:
    """Append direct, bare mitmdump, mitmdump + addon and LiteLLM to ``targets``, each once it answers
    (appended one by one, so that the caller stops those that started when a later one fails)."""
    up_proc, up_port = start_upstream(plan.limit_s)
    # The addon takes the API key as the session id (addon/session.py).
    plain = {"content-type": "application/json", "authorization": "Bearer bench-session"}
    targets.append(Target("direct", f"http://127.0.0.1:{up_port}", headers=plain, proc=up_proc))
    addon_args = [
        "-s",
        str(ROOT / "addon" / "polar.py"),
        "--set",
        f"polar_dir={polar_dir}",
        "--set",
        "polar_upstream=vllm",
    ]
    for name, extra in (("mitmdump", []), ("addon", addon_args)):
        log = tmp / f"{name}.log"
        proc, port, _ = start_mitmdump(up_port, log, tmp / f"conf-{name}", plan.limit_s, extra)
        targets.append(Target(name, f"http://127.0.0.1:{port}", headers=plain, proc=proc, log=log))
    console.print("starting the LiteLLM proxy (10-30 s; the first run installs .venv-litellm first, a few minutes) ...")
    litellm = ensure_venv(tmp / "litellm-install.log")
    server = start_litellm(litellm, up_port, tmp, litellm_log, plan.limit_s)
    keyed = plain | {"authorization": f"Bearer {server.key}"}
    targets.append(
        Target("litellm", f"http://127.0.0.1:{server.port}", headers=keyed, proc=server.proc, log=server.log)
    )


def wait_for_records(path: Path, want: int, timeout_s: float = 15.0) -> None:
    """LiteLLM logs after answering: give its last background writes a moment before it is stopped."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and report.count_lines(path) < want:
        time.sleep(0.2)


def _on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # so that the finally blocks stop every child


def main(cfg: Config) -> int:
    plan = make_plan(cfg)
    console = Console() if sys.stdout.isatty() else Console(width=130)  # no wrapped tables in logs
    signal.signal(signal.SIGTERM, _on_sigterm)
    t_start = time.monotonic()
    targets: list[Target] = []
    invalid: list[str] = []
    with tempfile.TemporaryDirectory(prefix="polar-bench-litellm-") as tmpname:
        tmp = Path(tmpname)
        polar_dir, litellm_log = tmp / "captures", tmp / "litellm-records.jsonl"
        polar_dir.mkdir()
        try:
            start_paths(plan, tmp, polar_dir, litellm_log, targets, console)
            t_measure = time.monotonic()
            for t in targets:
                t.open_clients(cfg.concurrency)
            measure(targets, cfg, plan, console)
            elapsed = time.monotonic() - t_measure
            by_name = {t.name: t for t in targets}
            wait_for_records(litellm_log, by_name["litellm"].requests)
        except RuntimeError as e:  # a path did not start: nothing to compare
            console.print(f"[bold red]INVALID[/] {e}")
            return 1
        finally:
            died = [t for t in targets if t.proc is not None and t.proc.poll() is not None]
            for t in reversed(targets):  # proxies first, the upstream (direct's process) last
                t.close_clients()
                stop(t.proc)  # before reading the records: the addon may flush in done()
        sent = {name: by_name[name].requests for name in ("addon", "litellm")}
        answers = {
            key: {kind: report.token_counts(raw.decode()) for kind, raw in by_name[name].answers.items()}
            for key, name in (("upstream", "direct"), ("litellm_answer", "litellm"))
        }
        logs = report.Logs.read(polar_dir, litellm_log, sent=sent, answers=answers)
        problems = {t.name: report.log_problems(t.log) for t in targets}

    stats = {
        t.name: report.summarize(
            lat_ms=t.lat_ms,
            ttfb_ms=t.ttfb_ms,
            stream_ms=t.stream_ms,
            rps1=t.rps1,
            rpsn=t.rpsn,
            cpu_ms={k: 1e3 * t.cpu_s[k] / t.cpu_n[k] for k in t.cpu_s if t.cpu_n.get(k)},
        )
        for t in targets
    }
    invalid += [
        f"{t.name}: {t.errors} failed or wrong answers, e.g. {t.error_samples[:2]}" for t in targets if t.errors
    ]
    invalid += [
        f"{t.name}: its process exited during the run (status {t.proc.returncode if t.proc else '?'})" for t in died
    ]
    invalid += logs.invalid()
    rows = [*report.ratio_rows(stats, cfg.concurrency), logs.keeps_row()]
    console.print(report.metrics_table(stats, cfg.concurrency), logs.table(), report.targets_table(rows))
    for name, lines in problems.items():
        if lines:
            console.print(f"[yellow]{name} log:[/]\n" + "\n".join(lines))
    for line in invalid:
        console.print(f"[bold red]INVALID[/] {line}")
    notes = report.notes(
        quick=cfg.quick,
        rounds=plan.rounds,
        seq=plan.seq,
        streams=plan.streams,
        conc=plan.conc,
        body_kb=cfg.body_kb,
        concurrency=cfg.concurrency,
        chunks=CHUNKS,
        elapsed=elapsed,
    )
    notes += [f"INVALID: {line}" for line in invalid]

    out = cfg.out if cfg.out.is_absolute() else ROOT / cfg.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report.markdown(stats, cfg.concurrency, logs, rows, notes))
    doc = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(cfg).items()},
        "plan": dataclasses.asdict(plan),
        "versions": report.versions(),
        "stats": stats,
        "targets": rows,
        "paths": {t.name: t.raw() for t in targets},
        "logs": logs.as_dict(),
        "log_problems": problems,
        "valid": not invalid,
        "notes": notes,
    }
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    console.print(f"wrote {out} and {out.with_suffix('.json')} in {time.monotonic() - t_start:.0f} s")
    return 1 if invalid else 0


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Config)))
