"""Supervised fine-tuning of a LoRA adapter on the sampled tokens of trajectory Parquet (the data grpo.py reads).

    accelerate launch --config_file train/configs/cpu.yaml train/sft.py \\
        --trajectories runs/r1/trajectories.parquet --model models/tiny --output runs/r1/sft
    accelerate launch --config_file train/configs/ddp.yaml train/sft.py --config sft.yaml --min-reward 1 --output DIR
    accelerate launch --config_file train/configs/cpu.yaml train/grpo.py --adapter runs/r1/sft ...  # then RL

``--output`` becomes a PEFT adapter directory, as grpo.py's (``PeftModel.from_pretrained``, vLLM's
``POST /v1/load_lora_adapter`` and ``grpo.py --adapter`` load it), with the config used (config.yaml, valid
input for ``--config``) and one JSON line of metrics per step next to it.

The objective, for an optimizer step over a set B of sessions:
1. Data. Every session read or, with ``--min-reward R``, those whose reward is >= R (rejection-sampling
   fine-tuning); without it rewards and task ids may be null. Taught tokens: the sampled ones (loss_mask 1).
   Tool results and template tokens (loss_mask 0) are context only: in the input, never a target.
2. Per taught token: l_t = -log pi_theta(y_t | y_<t), at temperature 1 (the model's own distribution).
3. Aggregation over the step's N taught tokens (all micro-batches, all ranks).
   token_mean (default): L = 1/N sum_t l_t;
   session_mean: L = 1/|B| sum_s 1/N_s sum_{t in s} l_t (each session counts once: GRPO's Polar averaging).
   token_mean by default because it is the likelihood of the data, which SFT estimates (TRL's SFTTrainer and
   nanoGPT minimise it too): a token of a long agent trajectory teaches as much as one of a short answer.
   session_mean multiplies each token of a short session by up to (longest / shortest session), and SFT has no
   group baseline that needs sessions balanced.
4. Lengths. As grpo.py: a trace over max_len tokens is cut to a causal prefix (whole prompt, response end cut);
   one whose prompt alone is too long is skipped. Nothing is trimmed on the left.
5. Optimizer. AdamW; the learning rate warms up linearly for warmup_steps, then follows a cosine down to
   min_lr_frac * lr at the last step; the global gradient norm is clipped to grad_clip.
Shared with grpo.py: the model (train/policy.py: log-probs and loss in vocabulary chunks, so the (T, V) logits
never exist), reading and packing (train/data.py), the command line, metrics and saving (train/runtime.py).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from accelerate import Accelerator

from train import data, losses, runtime
from train.data import DataError, MicroBatch, Trace
from train.policy import Batching, check_policy_config, check_vocabulary, load_policy
from train.runtime import TrainConfigError


@dataclasses.dataclass
class Config:
    """SFT of a LoRA adapter on trajectory Parquet (see the module docstring for the objective)."""

    # ---- inputs and outputs
    trajectories: tuple[Path, ...]
    """Trajectory Parquet files (reconstruct/schema.py); rewards are needed only with --min-reward."""
    model: str
    """Base model: a local transformers directory, or a hub name where the hub is reachable."""
    output: Path
    """Adapter directory to write (must be new or empty): adapter, config.yaml, metrics.jsonl."""
    config: Path | None = None
    """YAML file of field values (a written config.yaml works); flags on the command line win over it."""
    adapter: Path | None = None
    """Continue from this PEFT adapter directory (sft.py's or grpo.py's --output) instead of a fresh LoRA."""
    seed: int = 0
    """Seeds the LoRA initialisation, the order of sessions and dropout."""

    # ---- data and schedule
    min_reward: float | None = None
    """Keep only sessions whose reward is >= this (rejection sampling); None: every session, rewards may be null."""
    sessions_per_step: int = 32
    """Sessions per optimizer step; micro-batches accumulate up to it."""
    epochs: int = 1
    """Passes over the kept sessions, reshuffled each pass."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (default: all epochs); the lr schedule ends there."""

    # ---- loss
    loss_agg: Literal["token_mean", "session_mean"] = "token_mean"
    """token_mean: mean NLL over the step's taught tokens; session_mean: each session's mean, then the mean."""

    # ---- lengths and memory
    max_len: int = 32768
    """Tokens per trace (prompt + response); a longer trace loses its response end."""
    micro_batch_tokens: int = 32768
    """Tokens per forward pass: traces are packed into one row up to this budget, without padding."""
    share_prefix: bool = False
    """Compute the prefix that traces share once, each trace's tail after it (grpo.py's --share-prefix: the same
    loss to float noise; the trainer's own attention)."""
    logprob_chunk: int = 512
    """Positions projected to the vocabulary at once: (chunk, vocab) logits are the most that ever exist."""
    gradient_checkpointing: bool = True
    """Recompute each decoder layer in the backward instead of keeping its activations."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Base weights' dtype; auto: bfloat16 under accelerate's mixed_precision bf16, or on a CPU where a bf16 matmul
    measured at start is >= 1.5x faster than fp32 (train/precision.py); else float32."""
    attn_implementation: str | None = None
    """transformers attention backend (flash_attention_2 on GPU avoids a (T, T) mask for packed rows)."""

    # ---- LoRA
    lora_r: int = 16
    """LoRA rank (ignored with --adapter, which brings its own)."""
    lora_alpha: int = 32
    """LoRA scaling numerator: the update is scaled by alpha / r."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input (PEFT's default; raise it against over-fitting a small data set)."""
    lora_targets: tuple[str, ...] = ("all-linear",)
    """Modules to adapt; all-linear: every linear layer of attention and MLP (not the output layer)."""

    # ---- optimizer
    lr: float = 1e-4
    """Peak AdamW learning rate (the usual order for LoRA SFT; grpo.py's 1e-5 is for RL's noisier gradient)."""
    warmup_steps: int = 0
    """Linear warm-up steps, then the cosine decay."""
    min_lr_frac: float = 0.1
    """The cosine ends at min_lr_frac * lr on the last step (1: constant after warm-up)."""
    weight_decay: float = 0.0
    """AdamW weight decay (0, as usual for LoRA SFT)."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this (None: no clipping; the norm is logged either way)."""
    max_bad_steps: int = 3
    """Stop after this many consecutive steps with a non-finite loss or gradient (each one is skipped)."""

    @property
    def temperature(self) -> float:
        """What policy.Policy divides the logits by: SFT fits the model's own distribution."""
        return 1.0

    def __post_init__(self) -> None:
        if not self.trajectories:
            raise TrainConfigError("--trajectories needs at least one Parquet file")
        check_policy_config(self)
        for name in ("sessions_per_step", "epochs", "max_bad_steps"):
            if getattr(self, name) < 1:
                raise TrainConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_steps is not None and self.max_steps < 1:
            raise TrainConfigError("--max-steps must be >= 1 (or None: all epochs)")
        if self.min_reward is not None and not math.isfinite(self.min_reward):
            raise TrainConfigError(f"--min-reward must be finite, or None to keep every session; got {self.min_reward}")
        if self.lr <= 0 or self.warmup_steps < 0 or self.weight_decay < 0 or not 0 <= self.min_lr_frac <= 1:
            raise TrainConfigError("--lr must be > 0, --warmup-steps and --weight-decay >= 0, --min-lr-frac in [0, 1]")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise TrainConfigError("--grad-clip must be > 0, or None")


# ---- the loss weights, the lr schedule, one micro-batch (pure helpers; the loop is in main)


def token_mean_weights(trace_session: np.ndarray, n_tokens: np.ndarray, norm_tokens: int) -> np.ndarray:
    """Every taught token of the step alike: (M,) per-token weight 1 / sum_m n_m. The other arguments are unused."""
    return np.full(len(n_tokens), 1.0 / float(np.sum(n_tokens)))


AGGREGATIONS: dict[str, losses.Aggregation] = {
    "token_mean": token_mean_weights,
    "session_mean": losses.session_mean_weights,  # 1 / (|B| N_s), as GRPO's Polar averaging
}


def lr_factor(step: int, total: int, warmup_steps: int, min_lr_frac: float) -> float:
    """Multiplier of --lr at optimizer step ``step`` (0-based) of ``total``: linear warm-up, then a cosine that
    reaches ``min_lr_frac`` on the last step."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    done = min(1.0, (step - warmup_steps) / max(1, total - 1 - warmup_steps))
    return min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * done))


def rank_micro_batches(
    step_traces: list[Trace],
    aggregate: losses.Aggregation,
    cfg: Config,
    rank: int,
    world: int,
    batching: Batching,
) -> list[MicroBatch]:
    """This rank's micro-batches of one optimizer step (same count on every rank), as grpo.py packs them."""
    padded = batching == "padded"
    return data.rank_micro_batches(
        step_traces, aggregate, cfg.max_len, cfg.micro_batch_tokens, rank, world, cfg.share_prefix, padded
    )  # the per-token weights sum to 1 over the step


def accumulate(accelerator: Accelerator, policy: torch.nn.Module, mb: MicroBatch, stats: runtime.StepStats) -> float:
    """Add one micro-batch's share of the step's NLL gradient to ``.grad``; returns its loss contribution."""

    def token_loss(logp: torch.Tensor, sl: slice) -> torch.Tensor:  # (c,) weighted NLL of tokens sl
        return -mb.weight[sl] * logp

    logp, entropy, loss = policy(
        mb.input_ids,
        mb.position_ids,
        mb.sel,
        mb.targets,
        mb.prefix,
        with_entropy=True,
        token_loss=token_loss,
    )  # (N,), (N,), ()
    # The weights are global (they sum to 1 over every rank's tokens), while DDP/FSDP/DeepSpeed average gradients
    # over ranks: scale back up so the step's gradient is that of the whole batch.
    accelerator.backward(loss * accelerator.num_processes)
    stats.add("loss/token_nll", -logp)
    stats.add("policy/entropy", entropy)
    stats.add("perf/trained_tokens", torch.ones(()) * len(mb.sel))
    return float(loss.detach())


# ---- the run


def main(cfg: Config) -> None:
    if cfg.output.exists() and any(cfg.output.iterdir()):
        raise TrainConfigError(f"{cfg.output} exists and is not empty; pick a new --output")
    accelerator = runtime.start(cfg, cfg.seed)
    print0, rank, world = accelerator.print, accelerator.process_index, accelerator.num_processes

    # 1. Trajectories -> kept sessions -> traces cut to max_len
    rollout = data.load(cfg.trajectories, require_reward=cfg.min_reward is not None, require_task=False)
    n_sessions = len(rollout.session_ids)
    keep = rollout.reward >= cfg.min_reward if cfg.min_reward is not None else np.ones(n_sessions, bool)  # (S,)
    if not keep.any():
        raise DataError(
            f"{', '.join(map(str, cfg.trajectories))}: no session has reward >= {cfg.min_reward} "
            f"({n_sessions} sessions, rewards {np.nanmin(rollout.reward):g} to "
            f"{np.nanmax(rollout.reward):g}); lower --min-reward"
        )
    traces, cut = data.make_traces(rollout, np.zeros(n_sessions), keep, cfg.max_len)
    cut["below_min_reward"] = cut.pop("zero_std")  # make_traces counts the sessions left out under that name
    if not traces:
        raise DataError(f"{', '.join(map(str, cfg.trajectories))}: no trace with a taught token to train: {cut}")

    # 2. Model: base + LoRA (fresh or --adapter), wrapped so that one forward gives log-probs and the loss
    policy = load_policy(cfg, accelerator.mixed_precision)
    check_vocabulary(policy, traces)
    batching = policy.batching
    print0(f"batching: {batching} ({policy.batching_reason})")
    print0(f"dtype: {policy.dtype_reason}")

    # 3. Plan: sessions (reshuffled per epoch) -> optimizer steps -> packed micro-batches per rank; optimizer
    by_session: dict[int, list[Trace]] = defaultdict(list)
    for t in traces:
        by_session[t.session].append(t)
    singletons = [[s] for s in sorted(by_session)]  # plan_steps keeps groups whole; here every session is its own
    plan = [
        (e, step)
        for e in range(cfg.epochs)
        for step in data.plan_steps(singletons, cfg.sessions_per_step, cfg.seed + e)
    ][: cfg.max_steps]
    aggregate = AGGREGATIONS[cfg.loss_agg]  # the loss variant, picked once

    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, len(plan), cfg.warmup_steps, cfg.min_lr_frac)
    )
    if accelerator.state.deepspeed_plugin is not None:  # no dataloader for DeepSpeed to read a batch size from
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1
    policy, optimizer = accelerator.prepare(policy, optimizer)
    trainable = [p for p in policy.parameters() if p.requires_grad]  # FSDP2 replaced them with their shards
    runtime.print_placement(accelerator, policy)
    # from_pretrained leaves the model in eval mode, where transformers skips gradient checkpointing.
    policy.train()
    if accelerator.is_main_process:
        cfg.output.mkdir(parents=True, exist_ok=True)
        (cfg.output / "config.yaml").write_text(runtime.config_yaml(cfg))
    log = runtime.MetricsLog(cfg.output, None) if accelerator.is_main_process else runtime.NoLog()
    n_taught = sum(len(t.trained) for t in traces)
    log.log(
        {
            "step": 0,
            "data/sessions": n_sessions,
            "data/kept_sessions": len(by_session),
            "data/taught_tokens": n_taught,
            **runtime.data_counts(rollout, cut),
        }
    )
    print0(
        f"{n_sessions} sessions, {len(by_session)} kept"
        f"{f' (reward >= {cfg.min_reward})' if cfg.min_reward is not None else ''}: {len(traces)} traces, "
        f"{n_taught} taught tokens ({cut}); {len(plan)} steps of <= {cfg.sessions_per_step} sessions "
        f"on {world} process(es)"
    )

    # 4. Steps: accumulate micro-batches, clip, update, log
    bad_steps = 0
    for k, (epoch, sessions) in enumerate(plan):
        t0, stats, loss = time.perf_counter(), runtime.StepStats(), 0.0
        mbs = rank_micro_batches([t for s in sessions for t in by_session[s]], aggregate, cfg, rank, world, batching)
        for mb in runtime.micro_steps(accelerator, policy, mbs):
            loss += accumulate(accelerator, policy, mb, stats)
        loss, grad_norm, finite = runtime.clip_and_reduce(accelerator, trainable, cfg.grad_clip, loss)
        lr = optimizer.param_groups[0]["lr"]
        if finite:
            optimizer.step()
            bad_steps = 0
        else:
            bad_steps += 1
        scheduler.step()  # the schedule follows the step count, skipped steps included
        optimizer.zero_grad(set_to_none=True)

        row = {
            "step": k + 1,
            "epoch": epoch,
            "loss/nll": loss,
            **stats.finish(accelerator),
            "optim/grad_norm": grad_norm,
            "optim/lr": lr,
            "optim/skipped": int(bad_steps > 0),
            **runtime.perf(accelerator, mbs, time.perf_counter() - t0),
        }
        log.log(row)
        print0(
            f"step {k + 1}/{len(plan)}  loss {loss:.4f}  nll/token {row['loss/token_nll']:.4f}  "
            f"grad {grad_norm:.3g}  lr {lr:.2e}  {row['perf/tokens_per_s']:.0f} tok/s"
        )
        if bad_steps:
            print0(f"step {k + 1} skipped: non-finite loss {loss} or gradient norm {grad_norm}")
            if bad_steps >= cfg.max_bad_steps:
                raise FloatingPointError(f"{bad_steps} consecutive steps with a non-finite loss or gradient")

    # 5. The adapter, loadable by PEFT, vLLM and grpo.py --adapter
    runtime.save_adapter(accelerator, policy, cfg.output, cfg)
    log.close()
    print0(f"adapter written to {cfg.output}")


if __name__ == "__main__":
    runtime.run(main, Config)  # flags (after any --config YAML) -> Config -> main
