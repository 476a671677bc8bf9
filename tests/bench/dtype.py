"""Benchmark what bf16 costs: SmolLM2 served and re-scored in fp32 and bf16, log-probs and server time.

Run:  .venv/bin/python -m tests.bench.dtype [--sessions 8] [--out tests/bench/results/dtype.md]

For each server dtype (``python -m eval serve --dtype float32`` and ``bfloat16``): ``--sessions`` chat sessions (a
system prompt and one task each, ``--max-tokens`` sampled at temperature 1, 4 at a time) through ``mitmdump`` with
the addon, as a harness would send them; ``python -m reconstruct`` builds their trajectories; then
``reconstruct audit``'s scorer teacher-forces each trace through the model loaded in fp32 and in bf16, and compares
its log-prob of every sampled token with the one the server sent. That difference is what truncated importance
sampling has to absorb (train/losses.py). The server's wall time for the sessions is reported per dtype.

Served and scored in the same dtype by the same code, the gap is float noise; across dtypes it is bf16's
rounding. Exit status 0 when everything ran; info rows only (no target: how much mismatch is tolerable is the
importance-sampling correction's question).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import openai
import torch
import tyro
from rich.console import Console

from eval.sessions.procs import Mitmdump, ReferenceServer
from reconstruct import schema
from reconstruct._audit import audit
from tests.bench import report
from train.precision import cpu_name

ROOT = Path(__file__).resolve().parents[2]
TASKS = [
    "Write a Python function that reverses a linked list.",
    "Explain what a race condition is, with an example.",
    "Fix the bug: `for i in range(len(xs)): xs.remove(xs[i])`.",
    "Summarise how git rebase differs from git merge.",
    "Write a shell one-liner that counts lines in every .py file.",
    "What does the HTTP status 409 mean, and when is it used?",
    "Write a SQL query for the second highest salary.",
    "Describe binary search and its complexity.",
]


@dataclasses.dataclass
class Config:
    """Served against re-scored log-probs, by dtype, on SmolLM2."""

    model: Path = Path("models/smollm2")
    """SmolLM2-135M-Instruct as ``python -m eval models smollm2 models/smollm2`` writes it."""
    sessions: int = 8
    max_tokens: int = 48
    out: Path = Path("tests/bench/results/dtype.md")
    """Markdown results file (relative to the repository root); the JSON goes next to it as .json."""


def capture(cfg: Config, dtype: str, folder: Path) -> tuple[Path, float]:
    """The sessions served in ``dtype``, captured and reconstructed: the trajectory file and the sessions' seconds."""
    folder.mkdir(parents=True)
    server = ReferenceServer(ROOT / cfg.model, log=folder / "server.log", dtype=dtype)
    proxy = Mitmdump(server.url, folder / "captures", log=folder / "mitm.log", polar_upstream="vllm")
    try:

        def session(i: int) -> None:
            client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=f"dtype-{dtype}-{i}", max_retries=0)
            messages = [
                {"role": "system", "content": "You are a careful software engineer."},
                {"role": "user", "content": TASKS[i % len(TASKS)]},
            ]
            client.chat.completions.create(
                model="smollm2", messages=messages, max_tokens=cfg.max_tokens, temperature=1.0, seed=i
            )

        t0 = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(session, range(cfg.sessions)))
        seconds = time.monotonic() - t0
    finally:
        proxy.stop()
        server.stop()
    out = folder / "trajectories.parquet"
    command = [sys.executable, "-m", "reconstruct", str(folder / "captures"), "-o", str(out)]
    subprocess.run([*command, "--tokenizer", str(ROOT / cfg.model)], check=True, cwd=ROOT, capture_output=True)
    return out, seconds


def main(cfg: Config) -> int:
    from transformers import AutoModelForCausalLM

    console = Console() if sys.stdout.isatty() else Console(width=130)
    t0 = time.monotonic()
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for served in ("float32", "bfloat16"):
            console.print(f"[bold]served in {served}[/]: {cfg.sessions} sessions through mitmdump ...")
            path, seconds = capture(cfg, served, Path(tmp) / served)
            df = schema.read(path, columns=["prompt_ids", "response_ids", "loss_mask", "logprobs"])
            for scored in ("float32", "bfloat16"):
                model = AutoModelForCausalLM.from_pretrained(ROOT / cfg.model, dtype=getattr(torch, scored)).eval()
                found = audit(df, model, threshold=1e-2)
                rows.append(
                    {"served": served, "scored": scored, "server_s": seconds, "traces": found.traces,
                     "tokens": found.tokens, "mean": found.mean, **found.quantiles, "max": found.max,
                     "share_above_1e-2": found.share_above}
                )  # fmt: skip
                console.print(f"  scored in {scored}: mean |diff| {found.mean:.2e}, max {found.max:.2e}")
    quantiles = [k for k in rows[0] if k.startswith("p")]
    table = [
        [str(r["served"]), str(r["scored"]), f"{r['server_s']:.1f}", str(r["traces"]), str(r["tokens"]),
         f"{r['mean']:.2e}", *(f"{r[q]:.2e}" for q in quantiles), f"{r['max']:.2e}",
         f"{100 * float(r['share_above_1e-2']):.1f} %"]  # type: ignore[arg-type]
        for r in rows
    ]  # fmt: skip
    head = ["served", "scored", "server s", "traces", "tokens", "mean abs diff", *quantiles, "max", "> 1e-2"]
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    notes = [
        (
            f"{when} ({time.monotonic() - t0:.0f} s), {cpu_name()} ({platform.machine()}) with "
            f"{len(os.sched_getaffinity(0))} CPUs; torch {torch.__version__}."
        ),
        (
            f"{cfg.sessions} chat sessions of one call each, {cfg.max_tokens} tokens at temperature 1, 4 concurrent, "
            "through mitmdump + addon/polar.py to the reference server; abs diff is the absolute difference of the scored and served log-prob of each "
            "sampled token; server s is the wall time of all the sessions."
        ),
    ]
    out = cfg.out if cfg.out.is_absolute() else ROOT / cfg.out
    report.write_results(console, out, cfg, [(head, table)], notes, {"rows": rows, "targets": []})
    console.print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Config)))
