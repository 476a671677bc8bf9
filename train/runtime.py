"""The plumbing of train/grpo.py and train/sft.py, kept out of the algorithms: the command line and the YAML form of
the config, the start of a run, the micro-batches of a step, step metrics, the metrics log, checkpoints and the
adapter directory.

Only the main process writes; every function that gathers from several processes says so and is called by all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import shutil
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import tyro
import yaml
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from train import launch
from train.data import DataError, MicroBatch, Rollout

if TYPE_CHECKING:
    from _typeshed import DataclassInstance  # any config dataclass: grpo.Config, sft.Config

__all__ = [
    "MetricsLog",
    "NoLog",
    "Progress",
    "StepStats",
    "TrainConfigError",
    "clip_and_reduce",
    "config_yaml",
    "data_counts",
    "keep_trainable_weights",
    "micro_steps",
    "parse_config",
    "perf",
    "print_placement",
    "run",
    "save_adapter",
    "save_checkpoint",
    "start",
    "yaml_args",
]


class TrainConfigError(ValueError):
    """A training setting, or a combination of settings, that cannot work; the message says what to change."""


class StepStats:
    """Sums, counts, minima and maxima of one step on this rank, kept on the device (no sync per micro-batch) and
    reduced over ranks in ``finish``: sums and counts together, so means are global, not means of means."""

    def __init__(self) -> None:
        self.sum: dict[str, torch.Tensor] = {}
        self.count: dict[str, int] = defaultdict(int)
        self.lo: dict[str, torch.Tensor] = {}
        self.hi: dict[str, torch.Tensor] = {}

    def add(self, key: str, values: torch.Tensor, extremes: bool = False) -> None:
        values = values.detach().double()
        self.sum[key] = self.sum[key] + values.sum() if key in self.sum else values.sum()
        self.count[key] += values.numel()
        if extremes:
            lo = values.min() if values.numel() else values.new_tensor(math.inf)
            hi = values.max() if values.numel() else values.new_tensor(-math.inf)
            self.lo[key] = torch.minimum(self.lo[key], lo) if key in self.lo else lo
            self.hi[key] = torch.maximum(self.hi[key], hi) if key in self.hi else hi

    def add_tokens(
        self,
        mb: MicroBatch,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        entropy: torch.Tensor,
        parts: dict[str, torch.Tensor],
        eps_low: float,
        eps_high: float,
        tis_cap: float | None,
    ) -> None:
        """GRPO's per-token metrics of one micro-batch; the clip bounds and TIS cap are the config's."""
        adv, ratio, captured = mb.adv, parts["ratio"].detach(), ~torch.isnan(mb.behav_logp)  # (N,) each
        self.add("policy/entropy", entropy)
        self.add("policy/approx_kl", (ratio - 1) - (logp - old_logp))  # k3 of pi_old vs pi_theta
        self.add("policy/clip_frac_low", ((adv < 0) & (ratio < 1 - eps_low)).float())
        self.add("policy/clip_frac_high", ((adv > 0) & (ratio > 1 + eps_high)).float())
        self.add("policy/kl_ref", parts["kl"])
        self.add("sampling/captured_frac", captured.float())
        self.add("sampling/is_weight", parts["is_weight"][captured], extremes=True)
        if tis_cap is not None:
            self.add("sampling/is_truncated_frac", (parts["is_weight"][captured] >= tis_cap).float())
        self.add("sampling/logp_diff", (old_logp - mb.behav_logp)[captured].abs(), extremes=True)
        self.add("perf/trained_tokens", torch.ones(()) * len(mb.sel))

    def finish(self, accelerator: Accelerator) -> dict[str, float]:
        keys, dev = sorted(self.sum), accelerator.device
        inf = torch.tensor(math.inf, dtype=torch.float64, device=dev)
        totals = torch.stack(
            [
                torch.stack([self.sum[k].to(dev), torch.tensor(float(self.count[k]), dtype=torch.float64, device=dev)])
                for k in keys
            ]
        )  # (K, 2)
        ext = torch.stack([torch.stack([-self.lo.get(k, inf).to(dev), self.hi.get(k, -inf).to(dev)]) for k in keys])
        totals = accelerator.reduce(totals, "sum").cpu()  # (K, 2)
        ext = accelerator.gather(ext[None]).cpu().amax(0)  # (K, 2): -min, max over ranks
        out = {}
        for i, k in enumerate(keys):
            total, count = float(totals[i, 0]), float(totals[i, 1])
            if k.startswith("perf/"):
                out[k] = total
            elif k in self.lo:
                out[f"{k}_mean"] = total / count if count else math.nan
                out[f"{k}_min"], out[f"{k}_max"] = -float(ext[i, 0]), float(ext[i, 1])
            else:
                out[k] = total / count if count else math.nan
        return out


@dataclasses.dataclass
class Progress:
    """The data position, saved with each checkpoint (accelerate's custom checkpoint object)."""

    step: int = 0  # optimizer steps completed
    bad_steps: int = 0  # consecutive non-finite steps
    plan: str = ""  # fingerprint of the session order: a resume must see the same one

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.bad_steps, self.plan = state["step"], state["bad_steps"], state["plan"]


class MetricsLog:
    """metrics.jsonl (and TensorBoard when installed) under the output directory: main process only."""

    def __init__(self, output: Path, keep_until: int | None) -> None:
        self.path = output / "metrics.jsonl"
        if keep_until is not None and self.path.exists():  # resuming: drop rows logged after the checkpoint
            rows = [r for r in self.path.read_text().splitlines() if json.loads(r)["step"] <= keep_until]
            self.path.write_text("".join(r + "\n" for r in rows))
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb: Any = SummaryWriter(str(output / "tensorboard"))
        except ImportError:
            self.tb = None

    def log(self, row: dict[str, Any]) -> None:
        # Standard JSON has no NaN or infinity: a mean over nothing, or a skipped step's loss, is written as null.
        row = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
        with self.path.open("a") as f:  # opened per row: an interrupted run leaves every row written, no handle
            f.write(json.dumps(row, allow_nan=False) + "\n")
        for k, v in row.items():
            if self.tb is not None and isinstance(v, float | int) and k != "step":  # None is not float
                self.tb.add_scalar(k, v, row["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


class NoLog:
    """The stand-in on every other rank."""

    def log(self, row: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def config_yaml(cfg: DataclassInstance) -> str:
    def plain(v: Any) -> Any:
        return str(v) if isinstance(v, Path) else [plain(x) for x in v] if isinstance(v, tuple) else v

    text: str = yaml.safe_dump({k: plain(v) for k, v in dataclasses.asdict(cfg).items()}, sort_keys=False)
    return text


def save_adapter(accelerator: Accelerator, policy: torch.nn.Module, directory: Path, cfg: DataclassInstance) -> None:
    """PEFT adapter directory + config.yaml. Every rank calls it (gathering FSDP/ZeRO-3 shards is collective)."""
    if accelerator.is_fsdp2:  # the trained weights' shards only, gathered to the main process: not the base model
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        state = get_model_state_dict(policy, options=options)
    else:
        state = accelerator.get_state_dict(policy)
    if accelerator.is_main_process:
        peft_model = accelerator.unwrap_model(policy).peft
        peft_model.save_pretrained(str(directory), state_dict={k.removeprefix("peft."): v for k, v in state.items()})
        (directory / "config.yaml").write_text(config_yaml(cfg))
    accelerator.wait_for_everyone()


def save_checkpoint(
    accelerator: Accelerator, policy: torch.nn.Module, output: Path, cfg: DataclassInstance, progress: Progress
) -> None:
    """OUTPUT/checkpoint: accelerate state (adapter weights, optimizer, scheduler, RNG, Progress) + the adapter.
    Written beside and renamed into place, so an interruption never leaves half a checkpoint."""
    tmp, final = output / ".checkpoint.tmp", output / "checkpoint"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    save_adapter(accelerator, policy, tmp, cfg)
    if accelerator.is_main_process:
        (tmp / "trainer_state.json").write_text(json.dumps(progress.state_dict()))  # read before load_state
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    accelerator.wait_for_everyone()


def keep_trainable_weights(models: list[torch.nn.Module], weights: list[dict[str, Any]], _dir: str) -> None:
    """accelerate save-state hook: keep only the adapter's weights, not a copy of the frozen base model."""
    for model, state in zip(models, weights, strict=False):
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        for k in [k for k in state if k not in trainable]:
            del state[k]


def yaml_args(path: Path, fields: set[str]) -> list[str]:
    """A YAML mapping of config fields (a written config.yaml works) as command-line flags, to put before the real
    ones: later flags win. ``config`` itself is skipped."""
    values = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(values, dict) or set(values) - fields:
        unknown = sorted(set(values) - fields) if isinstance(values, dict) else values
        raise ValueError(f"{path}: expected a mapping of config fields; unknown: {unknown}")
    args: list[str] = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if key == "config":
            continue
        if isinstance(value, bool):
            args.append(flag if value else f"--no-{key.replace('_', '-')}")
        elif isinstance(value, list | tuple):
            args += [flag, *map(str, value)]
        else:
            args += [flag, str(value)]
    return args


C = TypeVar("C")


def parse_config(cls: type[C], argv: Sequence[str] | None = None) -> C:
    """tyro over the config dataclass ``cls``; ``--config FILE.yaml`` supplies values first, so flags on the
    command line win. A YAML file that cannot be read, or that names unknown fields, raises TrainConfigError."""
    argv = list(sys.argv[1:] if argv is None else argv)
    path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if "--config" in argv[:-1]:
        path = argv[argv.index("--config") + 1]
    try:
        fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        prefix = yaml_args(Path(path), fields) if path not in (None, "None") else []
    except (OSError, ValueError) as e:
        raise TrainConfigError(str(e)) from e
    return tyro.cli(cls, args=prefix + argv)


def run(main: Callable[[C], None], cls: type[C]) -> None:
    """A training script's command line: ``main`` on the config ``cls`` parsed from sys.argv. A setting or input
    the user can fix prints one line and exits 2; anything else is a bug and keeps its traceback."""
    try:
        main(parse_config(cls))
    except (DataError, TrainConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    _end_processes()


def _end_processes() -> None:
    """Destroys the process group of a multi-process run, once ``main``'s model is gone. The order matters: the
    model's DDP reducer holds the group too, and when it drops the last reference, gloo's group is destroyed with
    the GIL held while it joins a worker thread that may need the GIL to free its last collective's tensor: a hang
    at exit, after the adapter is written (pytorch/pytorch#56297: 2 two-process launches in 16 hung on this box,
    0 in 60 since). Dropped last by ``destroy_process_group``, the group is destroyed by its own binding, which
    releases the GIL first."""
    gc.collect()  # the model and its reducer sit in reference cycles (hooks, the Accelerator)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def start(cfg: DataclassInstance, seed: int) -> Accelerator:
    """The run's Accelerator as the user launched it (``launch.accelerator``: a GPU config on a CPU box runs on
    gloo, DDP as DDP and FSDP as FSDP2), every RNG seeded, and the config printed as a table by the main process."""
    accelerator = launch.accelerator()
    set_seed(seed)
    accelerator.print("\n".join(f"{k:>22} | {v}" for k, v in dataclasses.asdict(cfg).items()))
    deepspeed = (
        accelerator.state.deepspeed_plugin if accelerator.distributed_type == DistributedType.DEEPSPEED else None
    )
    sharded = accelerator.is_fsdp2 or (deepspeed is not None and deepspeed.zero_stage == 3)
    if getattr(cfg, "share_prefix", False) and sharded and accelerator.num_processes > 1:
        # A family's first pass runs the decoder twice (prefix, tails), other passes once, and its last pass's
        # backward runs through the first's prefix: the per-layer all-gathers and reshards of sharded weights would
        # no longer line up across ranks (tests/train/test_launch.py).
        raise TrainConfigError(
            "--share-prefix runs the decoder twice in some passes and once in others, which sharded weights "
            "(FSDP, DeepSpeed ZeRO-3) cannot follow across ranks: train without --share-prefix, or with DDP"
        )
    return accelerator


def print_placement(accelerator: Accelerator, model: torch.nn.Module) -> None:
    """One line from every rank, after ``accelerator.prepare``: how the run is distributed and how many bytes of the
    model's parameters this rank holds, so a log shows whether a sharded config really shards (FSDP2 holds its
    shard of each weight, a DTensor placed Shard(0); DDP and one process hold all of them)."""
    here = everywhere = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p  # a DTensor's numel is the whole weight's
        here, everywhere = here + local.numel() * local.element_size(), everywhere + p.numel() * p.element_size()
    kind = "FSDP2" if accelerator.is_fsdp2 else accelerator.distributed_type.value  # MULTI_CPU, MULTI_GPU, NO, ...
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "no process group"
    held = "sharded" if here < everywhere else "all of it"
    print(
        f"rank {accelerator.process_index} of {accelerator.num_processes} ({kind}, {backend}, "
        f"{accelerator.device.type}): {here / 2**20:,.2f} of the model's {everywhere / 2**20:,.2f} MiB of "
        f"parameters on this rank ({held})",
        flush=True,
    )


def data_counts(rollout: Rollout, cut: dict[str, int]) -> dict[str, float]:
    """The step-0 metrics of what was read and cut (``data.make_traces``'s counts): traces, the truncated
    fraction, sessions dropped on reading and traces skipped, by reason."""
    n_traces = len(rollout.trace_session)
    return {
        "data/traces": n_traces,
        "completions/truncated_frac": cut["truncated"] / n_traces,
        **{f"data/dropped_sessions_{k}": v for k, v in rollout.dropped_sessions.items()},
        **{f"data/skipped_traces_{k}": v for k, v in cut.items() if k != "truncated"},
    }


def micro_steps(accelerator: Accelerator, policy: torch.nn.Module, mbs: list[MicroBatch]) -> Iterator[MicroBatch]:
    """The step's micro-batches on the device, each accumulated inside the loop body under the right gradient sync:
    one all-reduce per step, at the last one, where DeepSpeed also steps its engine."""
    for j, mb in enumerate(mbs):
        last = j == len(mbs) - 1
        accelerator.sync_gradients = last
        with contextlib.nullcontext() if last else accelerator.no_sync(policy):
            yield mb.to(accelerator.device)


def clip_and_reduce(
    accelerator: Accelerator, trainable: list[torch.nn.Parameter], grad_clip: float | None, loss: float
) -> tuple[float, float, bool]:
    """After a step's backward passes (called by every rank): clip the global gradient norm, sum the loss over
    ranks, and say whether the step may be taken, ``(loss, grad_norm, finite)``. DeepSpeed reports no norm here
    (its engine has already stepped): then only the loss is checked. ``trainable`` are the parameters as
    ``accelerator.prepare`` left them: FSDP2 replaces each with its shard, and the ones it replaced get no gradient,
    so their norm would be 0 and nothing clipped."""
    if accelerator.is_fsdp2 and not all(isinstance(p, DTensor) for p in trainable):
        raise RuntimeError("clip_and_reduce got parameters from before accelerator.prepare: take them after it")
    norm = accelerator.clip_grad_norm_(trainable, grad_clip or math.inf)
    grad_norm = float(norm) if norm is not None else math.nan
    loss = float(accelerator.reduce(torch.tensor(loss, device=accelerator.device, dtype=torch.float64), "sum"))
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    return loss, grad_norm, math.isfinite(loss) and (math.isfinite(grad_norm) or deepspeed)


def perf(accelerator: Accelerator, mbs: list[MicroBatch], seconds: float) -> dict[str, float]:
    """A step's speed (called by every rank): its seconds, and the tokens its forward passes read on every rank
    together (padding passes of idle ranks left out) in all and per second."""
    real = [mb for mb in mbs if len(mb.sel) or mb.prefix is not None]
    mine = torch.tensor(sum(mb.computed_tokens() for mb in real), device=accelerator.device)
    tokens = int(accelerator.reduce(mine, "sum").item())
    return {"perf/step_s": seconds, "perf/tokens": tokens, "perf/tokens_per_s": tokens / seconds}
