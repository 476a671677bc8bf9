"""Benchmark the capture proxy under faults: kill -9 mid-load, a full disk under load, very large request bodies.

Run:  make bench
  or  .venv/bin/python -m tests.bench.reliability [--quick] [--out tests/bench/results/reliability.md]

Starts the fake vLLM upstream (``tests/bench/upstream.py``) and mitmdump with ``addon/polar.py`` on loopback
(``tests/bench/procs.py``), then measures three things:

1. **kill -9 under 16 streams**: 16 clients stream one call after another (50 chunks, 10 ms apart); mitmdump is
   killed with SIGKILL 2-4 s in. Counts streams the client saw finish whose record is missing (split at 10 ms
   before the kill: the writer needs a moment) and torn lines, over ``--kill-rounds`` rounds.
2. **a full disk under 8 clients**: 8 clients send 20 KB calls; mitmdump's file-size limit (``RLIMIT_FSIZE``,
   set with prlimit to the capture file's size) makes record writes fail with EFBIG, as on a full disk; after
   ``--full-s`` seconds the limit goes. Measures the time until the addon writes again and until a client gets
   its first 200, calls answered per second before and after, and answered calls without a record. Then the
   disk fills again and mitmdump gets SIGTERM: time to exit, records it names as not written, and answered
   calls neither on disk nor named (silent losses).
3. **memory per MB of request body**: ``--bodies`` non-streamed calls of ``--body-mb`` MB each (one long
   user message), one after another, through bare mitmdump and through mitmdump + addon: peak resident memory
   (VmHWM) above the level after a small warm-up call, per MB of body, and the resident memory left after.

Prints the table and writes it as Markdown, with the raw numbers as JSON next to it. Exit status 1 when a
scenario could not run (the addon did not load, a process died), else 0: figures are reported, not judged.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import random
import re
import resource
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import tyro
from rich.console import Console
from rich.table import Table

from addon import record_v2
from tests.bench.procs import ROOT, start_mitmdump, start_upstream, stop, tail

console = Console()
CHAT = "/v1/chat/completions"
LIMIT_S = 900  # every child process dies after this, whatever happens to us


@dataclasses.dataclass
class Config:
    """Reliability benchmark: kill -9, full disk, large bodies."""

    quick: bool = False
    """Short run: 1 kill round, a 3 s full disk, 2 bodies of 20 MB."""
    out: Path = Path("tests/bench/results/reliability.md")
    """Markdown results file (relative to the repository root); the JSON goes next to it as .json."""
    kill_rounds: int = 3
    """Rounds of kill -9 under load."""
    streams: int = 16
    """Concurrent streaming clients during the kill."""
    disk_clients: int = 8
    """Concurrent clients while the disk is full."""
    full_s: float = 5.0
    """Seconds the disk stays full."""
    body_mb: int = 50
    """Size of each large request body, MB."""
    bodies: int = 5
    """Large bodies sent per proxy."""

    def __post_init__(self) -> None:
        if self.quick:
            self.kill_rounds, self.full_s, self.body_mb, self.bodies = 1, 3.0, 20, 2


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return result


@dataclasses.dataclass
class OnDisk:
    """What a capture folder holds, each v2 record read back as the v1 record it stands for."""

    records: list[dict[str, Any]]
    torn: int  # lines that do not parse
    unresolved: int  # v2 records whose base record is not on disk: present, but unreadable (a silent loss)
    deltas: int = 0  # v2 records read on their base (the case a lost base would hurt)

    def calls(self) -> set[str]:
        return {call for r in self.records if (call := call_of(r)) is not None}


def read_records(directory: Path) -> OnDisk:
    found = OnDisk([], 0, 0)
    for path in sorted(directory.glob("*.jsonl")):
        expander = record_v2.Expander()
        for line in path.read_bytes().split(b"\n"):
            if not line:
                continue
            try:
                record = json.loads(line)
                if record.get("v") == record_v2.FORMAT_VERSION:
                    found.deltas += record.get("base") is not None
                    record = json.loads(expander.expand(record))
            except record_v2.Unresolved:
                found.unresolved += 1
                continue
            except ValueError:
                found.torn += 1
                continue
            found.records.append(record)
    return found


def call_of(record: dict[str, Any]) -> str | None:
    """The call a record is of: the marker in its request's last message (:func:`agent_body`)."""
    request = record.get("request")
    messages = request.get("messages") if isinstance(request, dict) else None
    last = messages[-1].get("content") if isinstance(messages, list) and messages else None
    return last.removeprefix("call ") if isinstance(last, str) and last.startswith("call ") else None


def health(port: int) -> dict[str, Any]:
    return httpx.get(f"http://127.0.0.1:{port}/polar/health", timeout=30).json()


class Proxy:
    """The fake upstream and one mitmdump (with the addon unless ``bare``), in a temporary folder."""

    def __init__(self, tmp: Path, *, bare: bool = False) -> None:
        self.captures = tmp / "captures"
        self.log = tmp / "mitmdump.log"
        self.upstream, up_port = start_upstream(LIMIT_S)
        extra = [] if bare else ["-s", str(ROOT / "addon" / "polar.py"), "--set", f"polar_dir={self.captures}"]
        extra += [] if bare else ["--set", "polar_max_body_mb=1024"]  # the memory part's bodies (--body-mb) pass 32 MiB
        try:
            self.proc, self.port, pid = start_mitmdump(up_port, self.log, tmp / "conf", LIMIT_S, extra)
        except Exception:
            stop(self.upstream)
            raise
        assert pid is not None, "no mitmdump pid"
        self.pid = pid
        self.url = f"http://127.0.0.1:{self.port}"
        if not bare:
            wait_for(lambda: health(self.port).get("loaded"), "the addon's health answer")

    def close(self) -> None:
        stop(self.proc)
        stop(self.upstream)


def _body(session_bytes: int = 200, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "x" * session_bytes}], **extra}


CALLS_PER_SESSION = 8  # the clients are agents: a session's calls resend its history (v2 records refer back)


def agent_body(session: str, k: int, history_bytes: int, **extra: Any) -> dict[str, Any]:
    """Call ``k`` of ``session``: its history (what the calls before it sent and got) and a last message naming
    the call (``call <session>#<k>``), as an agent resends its history with each call."""
    messages: list[dict[str, str]] = [{"role": "user", "content": "x" * history_bytes}]
    for j in range(k):
        messages += [{"role": "user", "content": f"call {session}#{j}"}, {"role": "assistant", "content": "ok"}]
    messages.append({"role": "user", "content": f"call {session}#{k}"})
    return {"model": "m", "messages": messages, **extra}


def session_call(prefix: str, k: int, calls: int) -> tuple[str, str, int]:
    """(session, call, index in its session) of a client's ``k``-th call."""
    session = f"{prefix}-{k // calls}"
    return session, f"{session}#{k % calls}", k % calls


# ---- 1. kill -9 under load ---------------------------------------------------------------------------------


def kill_round(cfg: Config, tmp: Path, n: int) -> dict[str, Any]:
    proxy = Proxy(tmp)
    finished: list[tuple[str, float]] = []
    stop_event = threading.Event()

    def client(i: int) -> None:
        with httpx.Client(timeout=30) as c:
            k = 0
            while not stop_event.is_set():
                session, call, j = session_call(f"kill{n}-{i}", k, CALLS_PER_SESSION)
                k += 1
                try:
                    body = agent_body(session, j, 2000, stream=True, bench_chunks=50, bench_delay_s=0.01)
                    with c.stream(
                        "POST", proxy.url + CHAT, json=body, headers={"authorization": f"Bearer {session}"}
                    ) as r:
                        data = b"".join(r.iter_raw())
                    if r.status_code == 200 and data.rstrip().endswith(b"data: [DONE]"):
                        finished.append((call, time.monotonic()))
                except httpx.HTTPError:
                    return  # the proxy is gone

    pool = ThreadPoolExecutor(cfg.streams)
    futures = [pool.submit(client, i) for i in range(cfg.streams)]
    time.sleep(random.uniform(2.0, 4.0))
    t_kill = time.monotonic()
    os.kill(proxy.pid, signal.SIGKILL)
    stop_event.set()
    for f in futures:
        f.result()
    pool.shutdown()
    proxy.close()
    found = read_records(proxy.captures)
    on_disk = found.calls()
    done = [(s, t) for s, t in finished if t <= t_kill]
    early = [s for s, t in done if t < t_kill - 0.010]
    late = [s for s, t in done if t >= t_kill - 0.010]
    return {
        "finished": len(done),
        "lost_finished_over_10ms_before": sum(s not in on_disk for s in early),
        "lost_finished_within_10ms": sum(s not in on_disk for s in late),
        "finished_within_10ms": len(late),
        "records": len(found.records),
        "deltas": found.deltas,
        "torn_lines": found.torn,
        "unresolved": found.unresolved,
    }


# ---- 2. a full disk under load -----------------------------------------------------------------------------


class Clients:
    def __init__(self, url: str, n: int, prefix: str, calls: int = CALLS_PER_SESSION) -> None:
        self.url, self.prefix, self.calls = url, prefix, calls
        self.answers: list[tuple[str, int | None, float]] = []
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(n)
        self.futures = [self.pool.submit(self._run, i) for i in range(n)]

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=60) as c:
            k = 0
            while not self.stop.is_set():
                session, call, j = session_call(f"{self.prefix}{i}", k, self.calls)
                k += 1
                try:
                    body = agent_body(session, j, 20_000)
                    r = c.post(self.url + CHAT, json=body, headers={"authorization": f"Bearer {session}"})
                    status: int | None = r.status_code
                except httpx.HTTPError:
                    status = None
                self.answers.append((call, status, time.monotonic()))
                if status is None:
                    time.sleep(0.05)

    def close(self) -> None:
        self.stop.set()
        for f in self.futures:
            f.result()
        self.pool.shutdown()

    def rate(self, status: int, start: float, end: float) -> float:
        return sum(s == status and start <= t < end for _, s, t in self.answers) / max(end - start, 1e-9)


def set_file_limit(pid: int, size: int | None) -> None:
    """``size`` bytes per file for the process (a full disk for the capture file at that size), or no limit."""
    resource.prlimit(
        pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY if size is None else size, resource.RLIM_INFINITY)
    )


def disk_full(cfg: Config, tmp: Path) -> dict[str, Any]:
    proxy = Proxy(tmp)
    try:
        with httpx.Client(timeout=60) as c:
            for i in range(20):  # the capture file outgrows mitmdump's log: the limit stops only records
                c.post(proxy.url + CHAT, json=_body(50_000), headers={"authorization": f"Bearer warm-{i}"})
        capture = Path(
            wait_for(
                lambda: health(proxy.port)["records_written"] == 20 and health(proxy.port)["capture_file"], "warm-up"
            )
        )
        clients = Clients(proxy.url, cfg.disk_clients, "full")
        try:
            time.sleep(2.0)
            t_full = time.monotonic()
            set_file_limit(proxy.pid, capture.stat().st_size)
            wait_for(lambda: not health(proxy.port)["writable"], "the addon to notice the full disk")
            t_noticed = time.monotonic()
            time.sleep(cfg.full_s)
            t_free = time.monotonic()
            set_file_limit(proxy.pid, None)
            wait_for(lambda: health(proxy.port)["writable"], "writes to work again")
            t_writable = time.monotonic()
            first_200 = wait_for(
                lambda: min((t for _, s, t in list(clients.answers) if s == 200 and t > t_free), default=None), "a 200"
            )
            time.sleep(10.0)
            t_end = time.monotonic()
        finally:
            clients.close()
        wait_for(lambda: health(proxy.port)["backlog_bytes"] == 0, "the backlog to drain")
        found = read_records(proxy.captures)
        on_disk = found.calls()
        answered = {s for s, st, _ in clients.answers if st == 200}
        refused = {s for s, st, _ in clients.answers if st == 503}
        result: dict[str, Any] = {
            "clients": cfg.disk_clients,
            "full_s": round(t_free - t_full, 1),
            "noticed_s": round(t_noticed - t_full, 2),
            "writable_after_free_s": round(t_writable - t_free, 2),
            "first_200_after_free_s": round(first_200 - t_free, 2),
            "answered_per_s_before": round(clients.rate(200, t_full - 2.0, t_full), 1),
            "answered_per_s_after": round(clients.rate(200, t_free, t_end), 1),
            "refused": len(refused),
            "answered": len(answered),
            "answered_without_record": len(answered - on_disk),
            "refused_with_record": len(refused & on_disk),
            "torn_lines": found.torn,
            "unresolved": found.unresolved,
        }

        # Full again, then SIGTERM before space returns. One call a session: the log names a lost record's session.
        clients = Clients(proxy.url, cfg.disk_clients, "stop", calls=1)
        try:
            time.sleep(1.0)
            set_file_limit(proxy.pid, capture.stat().st_size)
            wait_for(lambda: not health(proxy.port)["writable"], "the addon to notice the full disk again")
            time.sleep(1.0)
            t_term = time.monotonic()
            os.kill(proxy.pid, signal.SIGTERM)
            proxy.proc.wait(120)
            t_exit = time.monotonic()
        finally:
            clients.close()
        named = set(re.findall(r"NOT WRITTEN: record \w+ \(session ([\w.-]+),", proxy.log.read_text(errors="replace")))
        found = read_records(proxy.captures)
        on_disk = {r["session_id"] for r in found.records}
        answered = {s.partition("#")[0] for s, st, _ in clients.answers if st == 200}
        result |= {
            "shutdown_s": round(t_exit - t_term, 2),
            "shutdown_named_not_written": len(named),
            "shutdown_silently_lost": len(answered - on_disk - named),
            "shutdown_torn_lines": found.torn,
            "shutdown_unresolved": found.unresolved,
        }
        return result
    finally:
        if proxy.proc.poll() is None:
            set_file_limit(proxy.pid, None)
        proxy.close()


# ---- 3. memory per MB of request body ----------------------------------------------------------------------


def rss_kb(pid: int) -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) for k in ("VmRSS", "VmHWM")}


def memory(cfg: Config, tmp: Path, *, bare: bool) -> dict[str, Any]:
    proxy = Proxy(tmp, bare=bare)
    try:
        content = "x" * (cfg.body_mb << 20)
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()
        del content
        with httpx.Client(timeout=300) as c:
            headers = {"authorization": "Bearer mem", "content-type": "application/json"}
            c.post(proxy.url + CHAT, json=_body(), headers=headers)
            base = rss_kb(proxy.pid)
            for n in range(cfg.bodies):
                r = c.post(proxy.url + CHAT, content=body, headers=headers)
                if r.status_code != 200:
                    raise RuntimeError(f"a {cfg.body_mb} MB body got {r.status_code}: {r.text[:200]}")
                if not bare:  # one body at a time: its record written before the next arrives
                    wait_for(lambda n=n: health(proxy.port)["records_written"] == n + 2, "the record")
        time.sleep(1.0)
        after = rss_kb(proxy.pid)
        mb = len(body) / (1 << 20)
        return {
            "baseline_rss_mb": round(base["VmRSS"] / 1024, 1),
            "peak_rss_mb": round(after["VmHWM"] / 1024, 1),
            "rss_after_mb": round(after["VmRSS"] / 1024, 1),
            "peak_per_body_mb": round((after["VmHWM"] - base["VmRSS"]) / 1024 / mb, 2),
            "left_per_body_mb": round((after["VmRSS"] - base["VmRSS"]) / 1024 / mb, 2),
        }
    finally:
        proxy.close()


# ---- report ------------------------------------------------------------------------------------------------


def rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    k, d, m = result["kill"], result["disk"], result["memory"]
    total = {key: sum(r[key] for r in k) for key in k[0]}
    bare, addon = m["bare"], m["addon"]
    return [
        (f"kill -9 under {result['config']['streams']} streams: streams finished before the kill", str(total["finished"])),
        ("  of them lost (finished > 10 ms before the kill)", str(total["lost_finished_over_10ms_before"])),
        ("  of them lost (finished within 10 ms of the kill)", f"{total['lost_finished_within_10ms']} of {total['finished_within_10ms']}"),
        ("  torn lines / records on disk whose base record is not (v2)", f"{total['torn_lines']} / {total['unresolved']}"),
        ("  records on disk / read on their base record (v2)", f"{total['records']} / {total['deltas']}"),
        (f"full disk, {d['clients']} clients: addon refuses after (s)", f"{d['noticed_s']:.2f}"),
        ("  writes again after space returns (s)", f"{d['writable_after_free_s']:.2f}"),
        ("  first 200 after space returns (s)", f"{d['first_200_after_free_s']:.2f}"),
        ("  calls answered per s, before / after", f"{d['answered_per_s_before']:.1f} / {d['answered_per_s_after']:.1f}"),
        ("  calls refused (503) / refusals recorded", f"{d['refused']} / {d['refused_with_record']}"),
        ("  calls answered 200 without a record", f"{d['answered_without_record']} of {d['answered']}"),
        ("  torn lines / records on disk whose base record is not (v2)", f"{d['torn_lines']} / {d['unresolved']}"),
        ("SIGTERM while full: time to exit (s)", f"{d['shutdown_s']:.2f}"),
        ("  records named as not written / lost silently", f"{d['shutdown_named_not_written']} / {d['shutdown_silently_lost']}"),
        ("  torn lines / records on disk whose base record is not (v2)", f"{d['shutdown_torn_lines']} / {d['shutdown_unresolved']}"),
        (f"{result['config']['body_mb']} MB bodies: peak RSS per MB of body, bare / addon", f"{bare['peak_per_body_mb']:.2f} / {addon['peak_per_body_mb']:.2f}"),
        ("  addon's own cost: peak RSS per MB of body, addon - bare", f"{addon['peak_per_body_mb'] - bare['peak_per_body_mb']:.2f}"),
        ("  RSS left per MB of body after, bare / addon", f"{bare['left_per_body_mb']:.2f} / {addon['left_per_body_mb']:.2f}"),
        ("  peak RSS (MB), bare / addon", f"{bare['peak_rss_mb']:.0f} / {addon['peak_rss_mb']:.0f}"),
    ]  # fmt: skip


def main(cfg: Config) -> int:
    started = time.monotonic()
    result: dict[str, Any] = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(cfg).items()}
    }
    try:
        with tempfile.TemporaryDirectory(prefix="polar-reliability-") as tmp_dir:
            tmp = Path(tmp_dir)
            result["kill"] = []
            for n in range(cfg.kill_rounds):
                console.print(f"kill -9 round {n + 1} of {cfg.kill_rounds} ...")
                (tmp / f"kill{n}").mkdir()
                result["kill"].append(kill_round(cfg, tmp / f"kill{n}", n))
            console.print(f"full disk under {cfg.disk_clients} clients ...")
            (tmp / "disk").mkdir()
            result["disk"] = disk_full(cfg, tmp / "disk")
            result["memory"] = {}
            for name in ("bare", "addon"):
                console.print(f"{cfg.bodies} bodies of {cfg.body_mb} MB through {name} mitmdump ...")
                (tmp / name).mkdir()
                result["memory"][name] = memory(cfg, tmp / name, bare=name == "bare")
    except RuntimeError as e:
        console.print(f"[bold red]INVALID[/] {e}")
        for log in Path(tempfile.gettempdir()).glob("polar-reliability-*/**/mitmdump.log"):
            console.print(tail(log))
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    notes = [
        (
            f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {'quick' if cfg.quick else 'full'} run ({time.monotonic() - started:.0f} s), "
            f"{platform.machine()} with {cpus} CPUs shared by clients, upstream and proxy; Python {platform.python_version()}, "
            f"mitmproxy {version('mitmproxy')}."
        ),
        (
            f"kill -9: {cfg.kill_rounds} rounds, {cfg.streams} clients streaming 50-chunk answers (10 ms apart) one after "
            f"another. The clients are agents: sessions of {CALLS_PER_SESSION} calls, each resending the session's "
            "history, so capture v2's records refer to the session's previous one; a call counts as recorded when a "
            "record of it reads back (v2 expanded; one whose base record is not on disk does not)."
        ),
        (
            f"Full disk: mitmdump's RLIMIT_FSIZE set to the capture file's size for {cfg.full_s:.0f} s under {cfg.disk_clients} "
            f"clients sending 20 KB calls (sessions of {CALLS_PER_SESSION}; the SIGTERM phase one call a session, as "
            "the log names a lost record's session); writes fail with EFBIG as they would with ENOSPC. 'Answered per s after' covers 10 s "
            "from the moment space returned."
        ),
        (
            f"Memory: {cfg.bodies} non-streamed {cfg.body_mb} MB bodies one after another; peak = VmHWM above VmRSS after a small "
            "warm-up call, left = VmRSS after the last call above the same level, both per MB of one body."
        ),
    ]
    table = Table(title="Reliability")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for name, value in rows(result):
        table.add_row(name, value)
    console.print(table)
    out = cfg.out if cfg.out.is_absolute() else ROOT / cfg.out
    out.parent.mkdir(parents=True, exist_ok=True)
    md = [
        "| measure | value |",
        "| --- | ---: |",
        *(f"| {'↳ ' + n.strip() if n.startswith(' ') else n} | {v} |" for n, v in rows(result)),
        "",
    ]
    out.write_text("\n".join(md + [f"- {n}" for n in notes]) + "\n")
    out.with_suffix(".json").write_text(json.dumps({**result, "notes": notes}, indent=2) + "\n")
    console.print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Config)))
