"""Benchmark the reference server's batching on SmolLM2: 8 concurrent requests against one, over HTTP.

Run:  .venv/bin/python -m tests.bench.server [--quick] [--threads N] [--out tests/bench/results/server.md]

Starts the real reference server (``python -m eval serve --model models/smollm2``, as the demo and the tests start
it) and sends it streamed Chat Completions requests the way the capture proxy forwards them (greedy, ``logprobs``,
``return_token_ids``), each for exactly 64 tokens: the prompts ask for a long story, so none ends early (checked).
Each round, in an order that alternates:

- single: one request alone; tokens/s = its completion tokens / its wall time, first byte sent to last byte read;
- concurrent: 8 requests with 8 different prompts of one length class, sent at once; aggregate tokens/s = all their
  completion tokens / the wall time from the first send to the last answer's end;
- model.generate(): the single request's prompt, greedy, in this process with the same torch thread count, as
  context for what the server adds around the model.

Target: aggregate tokens/s at concurrency 8 >= 4 x single-request tokens/s (issue 17), the median of the per-round
ratios (single and concurrent run side by side in each round, so a load change on the machine hits both). The same
ratio from the server's CPU time (user + system, /proc) is reported as well: on a shared machine it is what other
processes disturb least. The bench also checks that batching changes nothing: the single request's greedy token ids
equal its row's in the concurrent batch and model.generate()'s, and reports the largest log-prob difference.

The server runs as users run it (prefix cache on, batches of up to 32): after the warm-up round every prompt is in
its prefix cache, so single and concurrent rounds alike measure decoding. Exit status 0 when everything ran (a MISS
is a result, not a failure).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import torch
import tyro
from rich.console import Console

from eval.sessions.procs import ReferenceServer
from tests.bench import report
from tests.bench.procs import cpu_seconds
from train.precision import cpu_name

ROOT = Path(__file__).resolve().parents[2]
TOPICS = ["a lighthouse", "a dragon", "a robot", "a garden", "a mountain", "a river", "a castle", "a train"]
TARGET = 4.0  # aggregate tokens/s at concurrency 8 / single-request tokens/s (issue 17)


@dataclasses.dataclass
class Config:
    """Reference-server batching benchmark."""

    quick: bool = False
    """Short run (about 80 s): 2 measured rounds instead of 5 (the full run takes about 3 minutes)."""
    out: Path = Path("tests/bench/results/server.md")
    """Markdown results file (relative to the repository root); the JSON goes next to it as .json."""
    model: Path = Path("models/smollm2")
    """Model directory (``python -m eval.upstream.models`` builds it; never the Hugging Face hub)."""
    threads: int = torch.get_num_threads()
    """torch CPU threads, for the server (OMP_NUM_THREADS) and model.generate() alike. By default what the server
    uses when not told: torch's default, one per core. On a shared machine use --threads 1: OpenMP threads that
    wait for each other while one is descheduled make multi-thread timings meaningless."""
    tokens: int = 64
    """Completion tokens per request."""
    concurrency: int = 8
    """Requests sent at once in the concurrent measurement."""
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    """The server's --dtype for the Pi-shaped measurement, one server each (() skips it)."""
    pi_requests: int = 16
    """Pi-shaped: requests sent at once (the demo's concurrency), each ~1,600 shared prompt tokens + its own."""
    pi_tokens: int = 96
    """Pi-shaped: completion tokens per request at most (the demo's cap)."""


@dataclasses.dataclass
class Answer:
    token_ids: list[int]
    logprobs: list[float]
    seconds: float  # request sent to the stream's end


def messages(topic: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a long story about {topic}."}]


def ask(client: httpx.Client, url: str, topic: str, tokens: int, chat: list[dict[str, str]] | None = None) -> Answer:
    """One streamed greedy request with the fields the capture proxy adds; its token ids and log-probs. ``chat``:
    these messages instead of the story prompt, which may end before ``tokens``."""
    body = {
        "model": "bench",
        "messages": chat or messages(topic),
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "logprobs": True,
        "return_token_ids": True,
    }
    token_ids: list[int] = []
    logprobs: list[float] = []
    t0 = time.perf_counter()
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                token_ids += choice.get("token_ids") or []
                logprobs += [entry["logprob"] for entry in (choice.get("logprobs") or {}).get("content") or []]
    seconds = time.perf_counter() - t0
    if chat is None and (len(token_ids) != tokens or len(logprobs) != tokens):
        raise RuntimeError(
            f"the prompt about {topic} got {len(token_ids)} token ids and {len(logprobs)} log-probs, not {tokens}: "
            "it stopped early, so requests are not of one length; pick another prompt"
        )
    return Answer(token_ids, logprobs, seconds)


def concurrently(
    url: str, topics: list[str], tokens: int, chats: list[list[dict[str, str]]] | None = None
) -> tuple[list[Answer], float]:
    """All requests at once, one connection each; the answers and the wall time from the first send to the last end."""
    answers: list[Answer | BaseException | None] = [None] * len(topics)
    clients = [httpx.Client(timeout=httpx.Timeout(600.0, connect=30.0)) for _ in topics]

    def one(i: int) -> None:
        try:
            answers[i] = ask(clients[i], url, topics[i], tokens, chats[i] if chats else None)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread below
            answers[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(topics))]
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - t0
    for client in clients:
        client.close()
    for answer in answers:
        if isinstance(answer, BaseException):
            raise answer
    return [a for a in answers if isinstance(a, Answer)], seconds


class Generate:
    """model.generate() in this process: the unbatched reference, with the server's chat template and dtype."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
        self.model.eval()

    def __call__(self, topic: str, tokens: int) -> tuple[list[int], float, float]:
        """Greedy token ids, wall seconds and CPU seconds (this process, all threads)."""
        text = self.tokenizer.apply_chat_template(messages(topic), add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([self.tokenizer.encode(text, add_special_tokens=False)])  # (1, T)
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            out = self.model.generate(ids, do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens)
        return out[0, ids.shape[1] :].tolist(), time.perf_counter() - t0, time.process_time() - c0


def run_rounds(cfg: Config, console: Console, tmp: Path) -> dict[str, Any]:
    os.environ["OMP_NUM_THREADS"] = str(cfg.threads)  # the server inherits it: torch's intra-op thread count
    torch.set_num_threads(cfg.threads)
    reference = Generate(cfg.model)
    server = ReferenceServer(cfg.model, log=tmp / "server.log")
    try:
        client = httpx.Client(timeout=httpx.Timeout(600.0, connect=30.0))
        topics = TOPICS[: cfg.concurrency]
        console.print("  warm-up: every prompt once, concurrently, then one alone")
        concurrently(server.url, topics, cfg.tokens)
        ask(client, server.url, topics[0], cfg.tokens)
        rounds = []
        for r in range(2 if cfg.quick else 5):
            topic = topics[r % len(topics)]  # the single request's prompt, and model.generate()'s
            row: dict[str, Any] = {"topic": topic}

            def single(row: dict[str, Any] = row, topic: str = topic) -> None:
                c0 = cpu_seconds(server.proc.pid)
                answer = ask(client, server.url, topic, cfg.tokens)
                row["single"] = {"tokens": cfg.tokens, "seconds": answer.seconds, "cpu_s": _since(c0, server)}
                row["single_answer"] = answer

            def batch(row: dict[str, Any] = row) -> None:
                c0 = cpu_seconds(server.proc.pid)
                answers, seconds = concurrently(server.url, topics, cfg.tokens)
                tokens = sum(len(a.token_ids) for a in answers)
                row["concurrent"] = {"tokens": tokens, "seconds": seconds, "cpu_s": _since(c0, server)}
                row["concurrent_answers"] = answers

            for step in (single, batch) if r % 2 == 0 else (batch, single):
                step()
            ids, seconds, cpu_s = reference(topic, cfg.tokens)
            row["generate"] = {"tokens": len(ids), "seconds": seconds, "cpu_s": cpu_s}
            alone, batched = row.pop("single_answer"), row.pop("concurrent_answers")[topics.index(topic)]
            row["batched_ids_equal"] = alone.token_ids == batched.token_ids
            row["generate_ids_equal"] = alone.token_ids == ids
            row["max_logprob_diff"] = max(abs(a - b) for a, b in zip(alone.logprobs, batched.logprobs, strict=True))
            rounds.append(row)
            rates = {k: row[k]["tokens"] / row[k]["seconds"] for k in ("single", "concurrent", "generate")}
            console.print(
                f"  round {r + 1}: single {rates['single']:.1f} tok/s, {cfg.concurrency} concurrent "
                f"{rates['concurrent']:.1f} tok/s ({rates['concurrent'] / rates['single']:.2f}x), "
                f"model.generate() {rates['generate']:.1f} tok/s; load average {os.getloadavg()[0]:.1f}"
            )
        client.close()
    finally:
        server.stop()
    engine_line = re.search(r"^engine: .*$", server.output(), re.MULTILINE)
    return {"rounds": rounds, "engine": engine_line.group(0) if engine_line else None}


def pi_shaped(cfg: Config, console: Console, tmp: Path) -> list[list[str]]:
    """Per --dtype, with the shared prompt's KV held once and with a copy per request (``--no-share-prefix``, the
    baseline): a server of its own, then ``pi_requests`` requests at once that share a ~1,600-token system prompt
    (Pi's shape, cached after a warm-up request) and differ in their question; greedy, at most ``pi_tokens`` each.
    Rows: dtype, shared or not, wall seconds, tokens, aggregate tokens/s, the engine's log line."""
    system = " ".join(f"Rule {i}: keep the tests green, edit only what the task names." for i in range(120))
    chats = [
        [{"role": "system", "content": system}, {"role": "user", "content": f"Write a long story about {topic}."}]
        for topic in (TOPICS * cfg.pi_requests)[: cfg.pi_requests]
    ]
    topics = [c[1]["content"] for c in chats]
    rows = []
    for dtype, share in itertools.product(cfg.dtypes, (True, False)):
        log = tmp / f"server-{dtype}-{share}.log"
        with ReferenceServer(cfg.model, log=log, dtype=dtype, share_prefix=share) as server:
            concurrently(server.url, topics[:1], cfg.pi_tokens, chats[:1])  # the shared prompt into the cache
            answers, seconds = concurrently(server.url, topics, cfg.pi_tokens, chats)
            engine = re.search(r"^engine: .*$", server.output(), re.MULTILINE)
        tokens = sum(len(a.token_ids) for a in answers)
        held = "once" if share else "per request"
        console.print(
            f"  Pi-shaped, {dtype}, prompt KV {held}: {cfg.pi_requests} requests, {tokens} tokens in {seconds:.1f} s"
        )
        line = engine.group(0) if engine else "-"
        rows.append([dtype, held, f"{seconds:.1f}", str(tokens), f"{tokens / seconds:.1f}", line])
    return rows


def _since(c0: float | None, server: ReferenceServer) -> float | None:
    c1 = cpu_seconds(server.proc.pid)
    return None if c0 is None or c1 is None else c1 - c0


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def rate(row: dict[str, Any], path: str) -> float:
        return row[path]["tokens"] / row[path]["seconds"]

    def cpu_rate(row: dict[str, Any], path: str) -> float | None:
        cpu_s = row[path]["cpu_s"]
        return row[path]["tokens"] / cpu_s if cpu_s else None

    paths = ("single", "concurrent", "generate")
    cpu_ratios = [c / s for row in rounds if (c := cpu_rate(row, "concurrent")) and (s := cpu_rate(row, "single"))]
    return {
        "tokens_per_s": {p: [rate(row, p) for row in rounds] for p in paths},
        "cpu_tokens_per_s": {p: [cpu_rate(row, p) for row in rounds] for p in paths},
        "ratio": statistics.median(rate(row, "concurrent") / rate(row, "single") for row in rounds),
        "cpu_ratio": statistics.median(cpu_ratios) if cpu_ratios else None,
        "single_vs_generate": statistics.median(rate(row, "single") / rate(row, "generate") for row in rounds),
        "batched_equal": sum(row["batched_ids_equal"] for row in rounds),
        "generate_equal": sum(row["generate_ids_equal"] for row in rounds),
        "max_logprob_diff": max(row["max_logprob_diff"] for row in rounds),
        "rounds": len(rounds),
    }


def evaluate(summary: dict[str, Any], concurrency: int) -> list[dict[str, str]]:
    n, ratio, cpu_ratio = summary["rounds"], summary["ratio"], summary["cpu_ratio"]
    return [
        {"name": f"concurrency {concurrency} / single request, aggregate tokens/s", "measured": f"{ratio:.2f}x",
         "limit": f">= {TARGET:g}x", "result": "PASS" if ratio >= TARGET else "MISS",
         **({} if ratio >= TARGET else {"close": WIDEN})},
        {"name": f"concurrency {concurrency} / single request, tokens per server CPU second",
         "measured": "-" if cpu_ratio is None else f"{cpu_ratio:.2f}x", "limit": "-", "result": "info"},
        {"name": "single request / model.generate(), tokens/s", "measured": f"{summary['single_vs_generate']:.2f}x",
         "limit": "-", "result": "info"},
        {"name": "greedy token ids, batched row == same prompt alone", "measured": f"{summary['batched_equal']}/{n}",
         "limit": f"{n}/{n}", "result": "PASS" if summary["batched_equal"] == n else "MISS"},
        {"name": "greedy token ids, server alone == model.generate()", "measured": f"{summary['generate_equal']}/{n}",
         "limit": f"{n}/{n}", "result": "PASS" if summary["generate_equal"] == n else "MISS"},
        {"name": "largest absolute log-prob difference, batched row vs alone",
         "measured": f"{summary['max_logprob_diff']:.1e}", "limit": "-", "result": "info"},
    ]  # fmt: skip


def tables(summary: dict[str, Any], verdicts: list[dict[str, str]], concurrency: int) -> list[tuple]:
    labels = {
        "single": "server, 1 request",
        "concurrent": f"server, {concurrency} concurrent (aggregate)",
        "generate": "model.generate(), in-process",
    }

    def fmt(xs: list[float | None], spec: str) -> str:
        values = [x for x in xs if x is not None]
        return f"{statistics.median(values):{spec}}" if values else "-"

    rates, cpu = summary["tokens_per_s"], summary["cpu_tokens_per_s"]
    paths = [
        [
            label,
            fmt(rates[p], ".1f"),
            f"{min(rates[p]):.1f}-{max(rates[p]):.1f}",
            fmt([1000 / r for r in rates[p]], ".0f"),
            fmt(cpu[p], ".1f"),
        ]
        for p, label in labels.items()
    ]
    targets = [[v["name"], v["measured"], v["limit"], v["result"]] for v in verdicts]
    return [
        (["path", "tokens/s (median)", "tokens/s (range)", "ms per token", "tokens per CPU s (median)"], paths),
        (["target", "measured", "limit", "result"], targets),
    ]


def notes(cfg: Config, result: dict[str, Any], elapsed: float, load: tuple[float, float]) -> list[str]:
    cpus = len(os.sched_getaffinity(0))
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return [
        (
            f"{when}, {'quick' if cfg.quick else 'full'} run ({elapsed:.0f} s), {platform.machine()} with {cpus} CPUs, "
            f"load average {load[0]:.1f} at the start and {load[1]:.1f} at the end; Python "
            f"{platform.python_version()}, torch {torch.__version__}, transformers {version('transformers')}."
        ),
        (
            f"{cfg.threads} torch thread(s) in the server (OMP_NUM_THREADS; it logged: "
            f'"{result["engine"] or "nothing"}") and for model.generate(); fp32 on CPU.'
        ),
        (
            f"{cfg.model.name}, streamed greedy Chat Completions with logprobs and return_token_ids, {cfg.tokens} "
            f'tokens each (checked), {cfg.concurrency} prompts "Write a long story about <topic>."; '
            f"{result['summary']['rounds']} rounds after a warm-up, single and concurrent in alternating order, "
            "medians; the ratio is the median of the per-round ratios. Tokens per CPU second: the server process's "
            "user + system time."
        ),
        (
            "Prefix cache on (the server's default): after the warm-up each prompt's KV is cached, so both paths "
            "measure decoding; the single request's row is compared with the same prompt's row of the batch."
        ),
        f"What limits the ratio: {WIDEN}",
    ]


WIDEN = (
    "one 8-row forward of SmolLM2 costs about 2x a 1-row forward on one core here "
    "(the engine adds little: in-place KV writes, one logits product for all rows). One row is bound by "
    "memory, 8 rows by arithmetic, and MKL runs its generic code path on AMD CPUs (MKL_VERBOSE says 'Intel(R) "
    "Architecture processors', not AVX2): about 30 GFLOPS for these 8-row products. What would widen it: "
    "AVX2 kernels (an Intel CPU, or a torch built on OpenBLAS/BLIS), a GPU, or more threads on a quiet "
    "machine (--threads 2: arithmetic scales with cores, memory bandwidth less)."
)


def main(cfg: Config) -> int:
    console = Console() if sys.stdout.isatty() else Console(width=130)
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    console.print(f"[bold]reference server: {cfg.concurrency} concurrent requests vs one, {cfg.model}[/]")
    with tempfile.TemporaryDirectory(prefix="polar-bench-server-") as tmp:
        result = run_rounds(cfg, console, Path(tmp))
        by_dtype = pi_shaped(cfg, console, Path(tmp))
    result["summary"] = summary = summarize(result["rounds"])
    verdicts = evaluate(summary, cfg.concurrency)
    note_lines = notes(cfg, result, time.monotonic() - t0, (load0, os.getloadavg()[0]))
    note_lines.append(
        f"Pi-shaped (third table): {cfg.pi_requests} greedy requests at once sharing a ~1,600-token system prompt "
        f"(cached by a warm-up request), at most {cfg.pi_tokens} tokens each, one server per --dtype, with the "
        f"prompt's KV held once for all (the default) and per request (--no-share-prefix); the CPU: "
        f"{cpu_name()}."
    )
    out = cfg.out if cfg.out.is_absolute() else ROOT / cfg.out
    data = {**result, "targets": verdicts, "pi_shaped": by_dtype}
    head = ["--dtype", "shared prompt KV", "wall s", "tokens", "tokens/s", "engine"]
    shown = [*tables(summary, verdicts, cfg.concurrency), *([(head, by_dtype)] if by_dtype else [])]
    report.write_results(console, out, cfg, shown, note_lines, data)
    console.print(f"wrote {out} and {out.with_suffix('.json')} in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Config)))
