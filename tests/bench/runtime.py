"""Benchmark what a session's runtime costs: the docker runtime's container against the local runtime's checkout.

Run:  make bench-docker     (needs DOCKER_HOST: `.ci/dockerd start`; builds the family images it needs)
  or  .venv/bin/python -m tests.bench.runtime [--sessions 10] [--out tests/bench/results/runtime.md]

For each of ``--sessions`` sessions on generated tasks, with no model in the loop, the phases a rollout session
goes through in each runtime (eval/sessions/runtime.py), timed one after another on an idle machine:

- **start**: local: the fresh checkout (eval.tasks.load.checkout); docker: ``docker run`` of the task's image with its
  limits and binds, until the relay inside answers (the host-side relay included);
- **exec**: a command that does nothing (``true``), as the harness is started: a subprocess, or ``docker exec``;
- **patch**: ``git add -A`` and ``git diff --cached`` against the base commit, after a one-line edit;
- **stop**: local: the checkout removed; docker: ``docker rm -f``.

Medians and p90 over the sessions, and docker's over local's per phase (a ratio measured in the same run).
Figures are reported, not judged: exit status 1 only when a phase could not run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import tyro
from rich.console import Console

from eval.harness.presets import base_env
from eval.sessions.images import build_images
from eval.sessions.runtime import RUNTIMES, Limits
from eval.tasks.load import load_tasks
from tests.bench.report import percentile, write_results

console = Console(stderr=True)
PHASES = ("start", "exec", "patch", "stop")


@dataclasses.dataclass
class Config:
    sessions: int = 10
    """Sessions per runtime (one after another)."""
    tasks: str = "family:heldout"
    """Tasks the sessions cycle through (their images are built first)."""
    task_count: int = 3
    """How many of --tasks."""
    out: Path = Path(__file__).parent / "results" / "runtime.md"
    """Markdown table; the raw numbers go to the .json beside it."""


def one_session(runtime: str, task: dict[str, Any], work: Path, n: int) -> dict[str, float]:
    """The four phases of one session with nothing in it but a one-line edit; seconds each."""
    times: dict[str, float] = {}
    session = f"bench-runtime-{runtime}-{n}"
    with contextlib.ExitStack() as stack:
        start = time.perf_counter()
        box = stack.enter_context(
            RUNTIMES[runtime].open(
                task, session, work / session, proxy="http://127.0.0.1:9", run_tag="bench-runtime", limits=Limits()
            )
        )
        times["start"] = time.perf_counter() - start
        env = base_env(work / session / "home", None, box.system_path)
        start = time.perf_counter()
        ran = box.run("shell", ["true"], env, 60)
        times["exec"] = time.perf_counter() - start
        if ran.exit_code != 0:
            raise RuntimeError(f"{runtime}: `true` exited {ran.exit_code}: {ran.stderr}")
        box.run("shell", ["bash", "-c", "echo edited >> README.md"], env, 60)
        start = time.perf_counter()
        if not box.patch(task["base_commit"]):
            raise RuntimeError(f"{runtime}: the edit left no patch")
        times["patch"] = time.perf_counter() - start
        start = time.perf_counter()
    if runtime == "local":
        import shutil

        shutil.rmtree(work / session)
    times["stop"] = time.perf_counter() - start
    return times


def main(config: Config) -> int:
    tasks = load_tasks(config.tasks)[: config.task_count]
    build_images(tasks, out=console)
    samples: dict[str, dict[str, list[float]]] = {r: {p: [] for p in PHASES} for r in ("local", "docker")}
    with tempfile.TemporaryDirectory(prefix="polar-bench-runtime-") as tmp:
        for runtime in ("local", "docker"):
            for n in range(config.sessions):
                for phase, seconds in one_session(runtime, tasks[n % len(tasks)], Path(tmp), n).items():
                    samples[runtime][phase].append(seconds)
    rows = []
    for phase in (*PHASES, "total"):
        med: dict[str, float] = {}
        cells = [phase]
        for runtime in ("local", "docker"):
            by_phase = samples[runtime].values()
            xs = samples[runtime][phase] if phase != "total" else [sum(t) for t in zip(*by_phase, strict=True)]
            med[runtime] = statistics.median(xs)
            cells += [f"{1000 * med[runtime]:.0f}", f"{1000 * (percentile(xs, 90) or 0):.0f}"]
        rows.append([*cells, f"{med['docker'] / med['local']:.1f}"])
    head = ["phase", "local median ms", "local p90 ms", "docker median ms", "docker p90 ms", "docker / local"]
    setting = "docker: --network none, the relay, default limits (eval/sessions/runtime.py)"
    notes = [
        f"{config.sessions} sessions per runtime on {len(tasks)} tasks of {config.tasks}, one after another; {setting}"
    ]
    write_results(console, config.out, config, [(head, rows)], notes, {"seconds": samples})
    return 0


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Config)))
