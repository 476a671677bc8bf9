"""How long ``make test`` takes: the whole suite as ``make test`` runs it, timed, against the 5-minute target.

Run:  .venv/bin/python -m tests.bench.suite

A wall-clock target, unlike the other benches' ratios: what a contributor waits for on a quiet 2-core machine. The
load average before the run is recorded beside it, since other work on the machine stretches the time. The suite's
own pass/fail is part of the result: a failing suite is reported as such, whatever its time. Writes
tests/bench/results/suite.md and .json.
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "tests" / "bench" / "results"
LIMIT_S = 300.0
# Measured on 2026-12-03 (docs/benchmarks.md, "Test suite"): what the suite's CPU goes to now.
CLOSE_IT = (
    "the suite is CPU-bound (about 640 CPU-seconds on 2 cores); what is left is process start-up repeated hundreds "
    "of times: each mini session imports the openai SDK (~1.2 CPU-s), each rollout and score process swebench's "
    "harness (~1.4 CPU-s: it imports datasets and modal eagerly), each trainer and accelerate launcher torch "
    "(~3 CPU-s); the two whole demo loops (mini and Pi, ~120 CPU-s each) start ~80 such processes apiece. Closing "
    "it takes fewer processes per demo stage (one score and one reconstruct process for both splits) or phase "
    "processes forked from an interpreter that has the imports, as the tests' reference servers are"
)
COMMAND = [
    sys.executable,
    "-m",
    "pytest",
    "-n",
    "2",
    "--dist",
    "loadfile",
    "-q",
    "-p",
    "no:cacheprovider",
    "--durations=15",
]


def main() -> int:
    console = Console()
    load_before = os.getloadavg()[0]
    console.print(f"running the suite ({' '.join(COMMAND[2:])}); load average {load_before:.2f}")
    start = time.monotonic()
    done = subprocess.run(COMMAND, cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
    wall = time.monotonic() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_after = os.getloadavg()  # the 15-minute figure spans most of the run: the suite alone reads about 2
    summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    green = done.returncode == 0
    targets = [
        {
            "name": "make test wall time, quiet 2-core machine",
            "value": wall,
            "measured": f"{wall / 60:.1f} min",
            "unit": "s",
            "limit": f"<= {LIMIT_S / 60:.0f} min",
            "result": ("PASS" if wall <= LIMIT_S else "MISS") if green else "FAILED",
            "close": "" if wall <= LIMIT_S else CLOSE_IT,
        }
    ]
    durations = sorted(
        ((float(t), name) for t, name in re.findall(r"^([\d.]+)s \w+ +(\S+)", done.stdout, re.M)), reverse=True
    )[:15]
    notes = [
        (
            f"{datetime.now(UTC):%Y-%m-%d %H:%M UTC}, {platform.machine()} with {os.cpu_count()} CPUs; Python "
            f"{platform.python_version()}; load average {load_before:.2f} before the run."
        ),
        f"`{' '.join(['python', *COMMAND[1:]])}`: exit {done.returncode}, {summary}.",
        f"CPU of the suite's processes: {usage.ru_utime + usage.ru_stime:.0f} s in {wall:.0f} s of wall time.",
        (
            f"Load average at the end: {load_after[0]:.2f} / {load_after[1]:.2f} / {load_after[2]:.2f} (1 / 5 / 15 "
            "min); above 2, other work shared the cores and the wall time is longer than on a quiet machine."
        ),
    ]
    data = {"targets": targets, "counts": counts, "exit": done.returncode, "wall_s": wall, "notes": notes}
    (RESULTS / "suite.json").write_text(json.dumps(data, indent=1) + "\n")
    lines = ["| target | measured | limit | result |", "| --- | ---: | ---: | --- |"]
    lines += [f"| {t['name']} | {t['measured']} | {t['limit']} | {t['result']} |" for t in targets]
    lines += ["", *(f"- {n}" for n in notes)]
    if durations:
        lines += ["", "Slowest test phases (setup, call or teardown):", ""]
        lines += [f"- {t:.1f} s {name}" for t, name in durations]
    (RESULTS / "suite.md").write_text("\n".join(lines) + "\n")
    console.print(f"make test: {wall / 60:.1f} min, {summary} -> {targets[0]['result']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
