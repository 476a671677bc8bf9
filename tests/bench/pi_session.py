"""Benchmark where a Pi session's wall time goes, as the demo's measured stages run it (issue 45, part 3).

Run:  .venv/bin/python -m tests.bench.pi_session [--sessions 16] [--concurrency 1 16] [--runtime local]

Pi 0.73.1 as shipped (eval/harness/), on ``--sessions`` held-out family tasks, against the reference server serving
SmolLM2-135M (``--dtype auto``, as the demo) through mitmdump and the addon, with the demo's per-call cap of 96 output
tokens. One rollout per ``--concurrency`` value, one after another, each with its own proxy. Every session's time
is split by its row in sessions.parquet (``setup_s``, ``duration_s``, ``patch_s``) and its calls' capture records
(``t_start``, ``t_first_byte``, ``t_end``):

- **setup**: the checkout (local) or the container's start (docker), until Pi is launched;
- **start-up**: Pi's launch until its first request reaches the proxy (Node's start, Pi's own, its first prompt);
- **to first token**: each call's request until its first token arrives (the second chunk of the stream, after
  the role chunk the server sends at once): waiting for the server's batch, and the prefill;
- **decoding**: the first token to the end of each call, one token at a time, in the server's batch;
- **between calls**: Pi running its tools and building the next request;
- **exit**: the last call's end until Pi has exited;
- **patch**: ``git diff`` of the workspace.

"Calls" is the sum of each session's calls, end to end; the rest of the session is not model compute. The figures
at concurrency 1 are the calls' time without a batch to wait for, so concurrency 16 against 1 shows the wait. Node's
own start is timed apart: ``pi --version`` run ``--node-starts`` times, one after another, alone on the machine.
Figures are reported, not judged: exit status 1 only when a rollout could not run.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import tyro
from rich.console import Console

from eval.harness.install import install
from eval.harness.presets import base_env
from eval.runs import read_sessions
from eval.sessions.procs import Mitmdump, ReferenceServer, new_secret_file
from eval.tasks.load import load_tasks
from tests.bench.procs import cpu_seconds
from tests.bench.report import percentile, write_results
from tests.captures import read_records, sse_events
from train.precision import cpu_name

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("setup", "start-up", "to first token", "decoding", "between calls", "exit", "patch")


@dataclasses.dataclass
class Config:
    """Where a Pi session's time goes."""

    model: Path = Path("models/smollm2")
    """SmolLM2-135M-Instruct as ``python -m eval models smollm2 models/smollm2`` writes it."""
    sessions: int = 16
    """Held-out family tasks, one session each, per concurrency."""
    concurrency: tuple[int, ...] = (1, 16)
    """Sessions at a time, one rollout each (16: the demo's)."""
    runtime: str = "local"
    """Where sessions run (eval/sessions/runtime.py): docker needs DOCKER_HOST and the family's images."""
    max_tokens: int = 96
    """Output tokens per call, the demo's cap for its measured stages."""
    timeout: float = 300.0
    node_starts: int = 5
    """Times ``pi --version`` is run alone to time Node's and Pi's own start."""
    out: Path = Path("tests/bench/results/pi_session.md")
    """Markdown results (relative to the repository root); the JSON goes next to it."""


def node_start_seconds(runs: int) -> list[float]:
    """Wall seconds of ``pi --version``, one run after another."""
    home = Path(tempfile.mkdtemp(prefix="polar-pi-home-"))
    (home / "tmp").mkdir()
    env = base_env(home, install())
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(["pi", "--version"], env=env, check=True, capture_output=True, timeout=120)
        times.append(time.perf_counter() - t0)
    return times


def first_token(call: dict[str, Any]) -> float:
    """When a call's first token arrived: its stream's second chunk (the first is the role chunk, sent before the
    prefill); the end of a call with fewer chunks."""
    chunks = call["chunks"] or []
    return call["t_start"] + chunks[1][0] / 1000 if len(chunks) > 1 else call["t_end"]


def completion_tokens(call: dict[str, Any]) -> int:
    """The tokens a streamed call generated: its usage chunk's count (the proxy asks for usage)."""
    usage = [e["usage"] for e in sse_events(call["response_body"] or "") if e.get("usage")]
    if not usage:
        raise RuntimeError(f"call {call['id']} has no usage in its stream")
    return int(usage[-1]["completion_tokens"])


def session_parts(row: dict[str, Any], calls: list[dict[str, Any]]) -> dict[str, float] | None:
    """One session's seconds per part (PARTS), plus its wall time and its calls' sum; None if it made no call or
    its harness never ran."""
    if not calls or row["duration_s"] is None or row["setup_s"] is None or row["patch_s"] is None:
        return None
    launched = datetime.datetime.fromisoformat(row["started_at"]).timestamp() + row["setup_s"]
    ended = launched + row["duration_s"]
    firsts = [first_token(c) for c in calls]
    return {
        "setup": row["setup_s"],
        "start-up": calls[0]["t_start"] - launched,
        "to first token": sum(f - c["t_start"] for c, f in zip(calls, firsts, strict=True)),
        "decoding": sum(c["t_end"] - f for c, f in zip(calls, firsts, strict=True)),
        "between calls": sum(b["t_start"] - a["t_end"] for a, b in itertools.pairwise(calls)),
        "exit": ended - calls[-1]["t_end"],
        "patch": row["patch_s"],
        "calls": sum(c["t_end"] - c["t_start"] for c in calls),
        "wall": row["setup_s"] + row["duration_s"] + row["patch_s"],
        "n_calls": float(len(calls)),
        "tokens": float(sum(completion_tokens(c) for c in calls)),
    }


def roll_out(cfg: Config, server: ReferenceServer, ids: list[str], concurrency: int, work: Path) -> dict[str, Any]:
    """One rollout of the sessions at ``concurrency`` through a fresh proxy; each session's parts."""
    server_model = str(cfg.model if cfg.model.is_absolute() else ROOT / cfg.model)  # the name it serves
    secret = new_secret_file(work / "secret")
    with Mitmdump(server.url, work / "captures", log=work / "mitmdump.log", secret_file=secret) as proxy:
        command = [sys.executable, "-m", "eval", "rollout", "--tasks", "family:heldout", "--instance-ids", *ids]
        command += ["--harness", "pi", "--model", server_model, "--out", str(work / "run"), "--runtime", cfg.runtime]
        command += [
            "--concurrency",
            str(concurrency),
            "--max-tokens",
            str(cfg.max_tokens),
            "--timeout",
            str(cfg.timeout),
        ]
        command += ["--proxy", proxy.url, "--session-secret", str(secret)]
        t0, server_cpu = time.monotonic(), cpu_seconds(server.proc.pid) or 0.0
        log = work / "rollout.log"
        with log.open("w") as sink:
            proc = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)  # its CPU time and its harnesses' (its waited-for children)
        rollout_s = time.monotonic() - t0
        cpu = {
            "server": (cpu_seconds(server.proc.pid) or 0.0) - server_cpu,
            "mitmdump": cpu_seconds(proxy.proc.pid) or 0.0,
            "rollout and harnesses": usage.ru_utime + usage.ru_stime,
        }
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"rollout at concurrency {concurrency} failed:\n{log.read_text()[-3000:]}")
        sessions = read_sessions(work / "run")
        # The addon writes a record once its exchange ends: every session has ended, so wait only briefly.
        records = read_records(work / "captures", timeout=5.0)
    parts = []
    for row in sessions.iter_rows(named=True):
        calls = sorted(
            (r for r in records if r["session_id"].startswith(row["session_id"])), key=lambda r: r["t_start"]
        )
        found = session_parts(row, calls)
        if found is not None:
            parts.append(found)
    statuses = sessions["status"].value_counts().sort("status").rows()
    return {"concurrency": concurrency, "rollout_s": rollout_s, "statuses": statuses, "sessions": parts, "cpu_s": cpu}


def summary_rows(runs: list[dict[str, Any]]) -> list[list[str]]:
    """Per concurrency: each part's mean seconds a session and its share of the wall time."""
    rows = []
    for run in runs:
        parts = run["sessions"]
        wall = statistics.fmean(p["wall"] for p in parts)
        for name in (*PARTS, "calls", "wall"):
            xs = [p[name] for p in parts]
            mean = statistics.fmean(xs)
            p90 = percentile(xs, 90) or 0.0
            rows.append([str(run["concurrency"]), name, f"{mean:.2f}", f"{p90:.2f}", f"{100 * mean / wall:.0f} %"])
        tokens = statistics.fmean(p["tokens"] for p in parts)
        per_token = 1000 * sum(p["decoding"] for p in parts) / max(1.0, sum(p["tokens"] - p["n_calls"] for p in parts))
        rows.append([str(run["concurrency"]), "tokens generated", f"{tokens:.1f}", "", f"{per_token:.0f} ms a token"])
    return rows


def main(cfg: Config) -> int:
    console = Console() if sys.stdout.isatty() else Console(width=130)
    model = cfg.model if cfg.model.is_absolute() else ROOT / cfg.model
    if not (model / "config.json").is_file():
        raise SystemExit(f"{cfg.model}: no model; run `python -m eval models smollm2 {cfg.model}` first")
    t0 = time.monotonic()
    console.print(f"[bold]Node's start[/]: pi --version x {cfg.node_starts} ...")
    starts = node_start_seconds(cfg.node_starts)
    ids = [t["instance_id"] for t in load_tasks("family:heldout")[: cfg.sessions]]
    runs = []
    with (
        tempfile.TemporaryDirectory(prefix="polar-bench-pi-") as tmp,
        ReferenceServer(model, log=Path(tmp) / "server.log", dtype="auto") as server,
    ):
        for concurrency in cfg.concurrency:
            console.print(f"[bold]{len(ids)} Pi sessions at concurrency {concurrency}[/] ...")
            work = Path(tmp) / f"c{concurrency}"
            work.mkdir()
            run = roll_out(cfg, server, ids, concurrency, work)
            runs.append(run)
            console.print(f"  {run['rollout_s']:.0f} s, statuses {run['statuses']}, {len(run['sessions'])} timed")
        served = next(
            (line for line in (Path(tmp) / "server.log").read_text().splitlines() if " weights (" in line), "?"
        )
    head = ["concurrency", "part", "mean s a session", "p90 s", "share of wall"]
    cpus = len(os.sched_getaffinity(0))
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    notes = [
        (
            f"{when} ({time.monotonic() - t0:.0f} s), {cpu_name()} ({platform.machine()}) with {cpus} CPUs; Python "
            f"{platform.python_version()}, torch {torch.__version__}; server: {served.strip()}."
        ),
        (
            f"{cfg.sessions} sessions of family:heldout per concurrency, --runtime {cfg.runtime}, --max-tokens "
            f"{cfg.max_tokens}; calls per session: "
            + ", ".join(
                f"{statistics.fmean(p['n_calls'] for p in r['sessions']):.1f} at {r['concurrency']}" for r in runs
            )
            + "; rollout wall: "
            + ", ".join(f"{r['rollout_s']:.0f} s at {r['concurrency']}" for r in runs)
            + "."
        ),
        f"`pi --version` alone: {', '.join(f'{s:.2f}' for s in starts)} s (first to last).",
        "CPU seconds a rollout (server: its process during the rollout; mitmdump: its process, which served only "
        "that rollout; rollout and harnesses: the rollout process and every process it waited for): "
        + "; ".join(f"at {r['concurrency']}: " + ", ".join(f"{k} {v:.0f}" for k, v in r["cpu_s"].items()) for r in runs)
        + ".",
    ]
    out = cfg.out if cfg.out.is_absolute() else ROOT / cfg.out
    write_results(console, out, cfg, [(head, summary_rows(runs))], notes, {"node_start_s": starts, "runs": runs})
    console.print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Config)))
