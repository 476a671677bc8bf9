"""GRPO on a LoRA adapter from trajectory Parquet: read rewarded traces, update the adapter, write it, stop.

    accelerate launch --config_file train/configs/cpu.yaml train/grpo.py \\
        --trajectories runs/r1/trajectories.parquet --model models/tiny --output runs/r1/adapter
    accelerate launch --config_file train/configs/ddp.yaml train/grpo.py --config run.yaml --output DIR

``--output`` becomes a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) that
``PeftModel.from_pretrained`` and vLLM (``--enable-lora``, ``POST /v1/load_lora_adapter``) load, with the
config used (config.yaml, valid input for ``--config``) and one JSON line of metrics per step next to it.

The objective, for an optimizer step over a set B of sessions (each Config default says whether it is Polar's
run, polar.md §4, or a deviation and why):
1. Advantages. A group is every session of one task_id among the trajectories read. Session i gets
   A_i = (r_i - mean_{j != i} r_j) / (std_g + 1e-6): leave-one-out baseline, one sample std per group
   (``--no-sample-std``: population std; ``--no-scale-by-std`` drops the division, as Dr. GRPO). A group whose
   rewards are all equal is skipped before any forward pass. Every sampled token (loss_mask 1) of the session's
   traces carries A_i. A step holds whole groups (``--groups-per-step`` of them), so its advantages sum to 0.
2. Policies. pi_theta: the model with the adapter being trained. pi_old: the same at the start of this run;
   ratios are taken against it. pi_b: the engine that sampled (captured logprobs; a trace without them has
   pi_b = pi_old). pi_ref: the base model, i.e. the adapter disabled (no second copy).
3. Clipped surrogate per token: rho = pi_theta / pi_old,
   l_t = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A), eps_low 0.2, eps_high 0.28.
4. Truncated importance sampling: l_t <- min(pi_old / pi_b, tis_cap) * l_t, tis_cap 2 (None: off).
5. KL to the base: l_t <- l_t + kl_coef * min(e^d - d - 1, 10), d = log pi_ref - log pi_theta (k3, clamped as
   slime does); kl_coef 0 by default, which skips the reference pass.
6. Aggregation. n_m: trained tokens of trace m; N_s: of all traces of session s.
   session_mean (Polar): L = 1/|B| sum_s 1/N_s sum_{m in s} sum_t l_t, each session's token mean, then the mean;
   token_mean (DAPO): L = sum_m w_m sum_t l_t / sum_m w_m n_m, with w = 1/k for a session cut into k traces;
   dr_grpo: L = sum_m w_m sum_t l_t / (|B| * dr_grpo_tokens).
7. Lengths. A trace over max_len tokens is cut to a causal prefix (whole prompt, response end cut); one
   whose prompt alone is too long is skipped. Nothing is trimmed on the left.
Pure functions: train/losses.py (the maths above), train/logprobs.py (log-probs and the loss in vocabulary
chunks: the (T, V) logits never exist), train/data.py (reading, checking, packing); the model: train/policy.py
(shared with sft.py); plumbing: train/runtime.py.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from accelerate import Accelerator

from train import data, losses, runtime
from train.data import DataError, MicroBatch, Trace
from train.policy import Batching, check_policy_config, check_vocabulary, load_policy
from train.runtime import TrainConfigError


@dataclasses.dataclass
class Config:
    """GRPO on a LoRA adapter from trajectory Parquet (see the module docstring for the objective)."""

    # ---- inputs and outputs
    trajectories: tuple[Path, ...]
    """Trajectory Parquet files (reconstruct/schema.py) with rewards joined."""
    model: str
    """Base model: a local transformers directory, or a hub name where the hub is reachable."""
    output: Path
    """Adapter directory to write (must be new or empty unless --resume): adapter, config.yaml, metrics.jsonl."""
    config: Path | None = None
    """YAML file of field values (a written config.yaml works); flags on the command line win over it."""
    adapter: Path | None = None
    """Start from this PEFT adapter directory (a previous round's --output) instead of a fresh LoRA."""
    resume: Path | None = None
    """Continue an interrupted run from its checkpoint directory (OUTPUT/checkpoint) with the same settings."""
    save_every: int = 10
    """Write a resumable checkpoint to OUTPUT/checkpoint every this many optimizer steps (0: never)."""
    seed: int = 0
    """Seeds the LoRA initialisation, the order of groups and dropout."""

    # ---- schedule
    groups_per_step: int = 4
    """Polar: task groups per optimizer step (4 tasks x 16 samples), all sessions of a group in the same step;
    micro-batches accumulate up to it. Groups without reward variance are skipped before the plan."""
    epochs: int = 1
    """Polar: passes over the trajectories (one step per rollout batch)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (default: all epochs)."""

    # ---- advantages and loss
    scale_by_std: bool = True
    """Polar: divide leave-one-out advantages by the group's reward std (--no-scale-by-std: Dr. GRPO)."""
    sample_std: bool = True
    """Polar: that std is the sample std (ddof 1); --no-sample-std: the population std (1.155x larger advantages
    at n = 4 samples, 1.03x at 16)."""
    loss_agg: Literal["session_mean", "token_mean", "dr_grpo"] = "session_mean"
    """Polar: session_mean, each session's token mean, then the mean over sessions; token_mean (DAPO): mean over
    the step's trained tokens, so long sessions weigh more; dr_grpo: token sums / dr_grpo_tokens, mean over
    sessions (no length normalisation)."""
    dr_grpo_tokens: int | None = None
    """The constant denominator of dr_grpo, in tokens (default: max_len)."""
    eps_low: float = 0.2
    """Polar: lower clip of the ratio, 1 - eps_low."""
    eps_high: float = 0.28
    """Polar: upper clip of the ratio, 1 + eps_high (clip-higher, DAPO)."""
    tis_cap: float | None = 2.0
    """Polar (TIS on, slime's cap): C of the truncated importance weight min(pi_old / pi_sampler, C) (None: off)."""
    kl_coef: float = 0.0
    """Deviation (Polar: 0.001): weight of the k3 KL to the base model (adapter disabled). 0 skips the reference
    forward pass, a third more compute per step, while a low-rank adapter already bounds the drift."""
    temperature: float = 1.0
    """Polar: sampling temperature of the trajectories; logits are divided by it (log-probs then match)."""

    # ---- lengths and memory
    max_len: int = 32768
    """Deviation (Polar: 32k prompt + 16k response): tokens per trace; a longer trace loses its response end.
    32k fits one 80 GB GPU's activations for a 4B model with checkpointing; raise it where memory allows."""
    micro_batch_tokens: int = 32768
    """Not in Polar (it packs 30k tokens per GPU): tokens per forward pass; traces are packed into one row up
    to this budget, without padding."""
    share_prefix: bool = False
    """Not in Polar: compute the prefix that traces share (a group's samples begin with one prompt) once, and each
    trace's tail after it, attending to its keys and values and continuing its recurrent state (train/prefix.py).
    Same log-probs and gradients to float noise, on every architecture; a step costs about its unique tokens. Needs
    the trainer's own attention (--attn-implementation unset)."""
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
    """Deviation (Polar trains all weights): LoRA rank, so that vLLM hot-loads the update (ignored with --adapter,
    which brings its own)."""
    lora_alpha: int = 32
    """LoRA scaling numerator: the update is scaled by alpha / r."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input (0 keeps the first step's pre-update log-probs free: no extra pass)."""
    lora_targets: tuple[str, ...] = ("all-linear",)
    """Modules to adapt; all-linear: every linear layer of attention and MLP (not the output layer)."""

    # ---- optimizer
    lr: float = 1e-5
    """Deviation (Polar: 1e-6 for full weights): AdamW learning rate; LoRA updates need about 10x more."""
    warmup_steps: int = 0
    """Polar: linear warm-up steps, then constant."""
    weight_decay: float = 0.1
    """Polar: AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.98)
    """Polar: AdamW betas."""
    grad_clip: float | None = 1.0
    """Polar (slime's default): clip the global gradient norm to this (None: no clipping; the norm is logged)."""
    max_bad_steps: int = 3
    """Stop after this many consecutive steps with a non-finite loss or gradient (each one is skipped)."""
    allow_no_signal: bool = False
    """When no group has reward variance, write the starting adapter unchanged (0 steps) instead of failing:
    a demo or smoke run completes its loop whatever the rewards were."""

    def __post_init__(self) -> None:
        check_policy_config(self)
        if self.save_every < 0:
            raise TrainConfigError("--save-every must be >= 0")
        for name in ("groups_per_step", "epochs", "max_bad_steps"):
            if getattr(self, name) < 1:
                raise TrainConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_steps is not None and self.max_steps < 1:
            raise TrainConfigError("--max-steps must be >= 1 (or None: all epochs)")
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise TrainConfigError("--eps-low must be in [0, 1) and --eps-high >= 0")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise TrainConfigError("--tis-cap must be > 0, or None to turn importance sampling off")
        if self.kl_coef < 0 or self.temperature <= 0 or self.lr <= 0:
            raise TrainConfigError("--kl-coef must be >= 0, --temperature and --lr > 0")
        if self.dr_grpo_tokens is not None and self.dr_grpo_tokens < 1:
            raise TrainConfigError("--dr-grpo-tokens must be >= 1")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise TrainConfigError("--grad-clip must be > 0, or None")


# ---- one micro-batch: forward, loss, backward (the bench times exactly this)


def accumulate(
    accelerator: Accelerator,
    policy: torch.nn.Module,
    mb: MicroBatch,
    old_logp: torch.Tensor | None,
    cfg: Config,
    importance: Any,
    stats: runtime.StepStats,
) -> float:
    """Add one micro-batch's share of the step's loss gradient to ``.grad``; returns its loss contribution."""
    args = (mb.input_ids, mb.position_ids, mb.sel, mb.targets, mb.prefix)
    ref_logp = None
    if cfg.kl_coef > 0:
        with torch.no_grad():
            ref_logp = policy(*args, reference=True)[0]  # (N,) adapter disabled: the base model
    options = {"importance": importance, "eps_low": cfg.eps_low, "eps_high": cfg.eps_high, "kl_coef": cfg.kl_coef}

    def token_loss(logp: torch.Tensor, sl: slice) -> torch.Tensor:  # (c,) terms of tokens sl
        old = logp.detach() if old_logp is None else old_logp[sl]  # nothing updated yet: pi_old = pi_theta
        ref = ref_logp[sl] if ref_logp is not None else None
        return losses.grpo_token_loss(logp, old, ref, mb.behav_logp[sl], mb.adv[sl], mb.weight[sl], **options)[0]

    logp, entropy, loss = policy(*args, with_entropy=True, token_loss=token_loss)  # (N,), (N,), ()
    # The weights are global (they sum over every rank's tokens), while DDP/FSDP/DeepSpeed average gradients
    # over ranks: scale back up so the step's gradient is that of the whole batch.
    accelerator.backward(loss * accelerator.num_processes)
    old = logp if old_logp is None else old_logp
    _, parts = losses.grpo_token_loss(logp, old, ref_logp, mb.behav_logp, mb.adv, mb.weight, **options)  # metrics
    stats.add_tokens(mb, logp, old, entropy, parts, cfg.eps_low, cfg.eps_high, cfg.tis_cap)
    return float(loss.detach())


# ---- planning: which traces form each micro-batch of each step, on this rank


def rank_micro_batches(
    step_traces: list[Trace],
    cfg: Config,
    aggregate: losses.Aggregation,
    rank: int,
    world: int,
    batching: Batching,
) -> list[MicroBatch]:
    """This rank's micro-batches of one optimizer step (same count on every rank); ``aggregate`` gives the weights,
    ``batching`` (the policy's) whether traces share a row."""
    norm_tokens = cfg.dr_grpo_tokens or cfg.max_len
    padded = batching == "padded"
    return data.rank_micro_batches(
        step_traces, aggregate, norm_tokens, cfg.micro_batch_tokens, rank, world, cfg.share_prefix, padded
    )


# ---- the run


def main(cfg: Config) -> None:
    if cfg.resume is None and cfg.output.exists() and any(cfg.output.iterdir()):
        raise TrainConfigError(f"{cfg.output} exists and is not empty; pick a new --output, or --resume its checkpoint")
    if cfg.resume is not None and not (cfg.resume / "trainer_state.json").is_file():
        raise TrainConfigError(f"{cfg.resume} is not a checkpoint of grpo.py (no trainer_state.json)")
    accelerator = runtime.start(cfg, cfg.seed)
    print0, rank, world = accelerator.print, accelerator.process_index, accelerator.num_processes

    # 1. Trajectories -> advantages per session -> trainable traces (usable groups, causal truncation)
    rollout = data.load(cfg.trajectories)
    group = np.unique(np.array(rollout.task_ids), return_inverse=True)[1]  # (S,)
    adv, usable = losses.group_advantages(
        rollout.reward, group, scale_by_std=cfg.scale_by_std, sample_std=cfg.sample_std
    )  # (S,), (S,)
    n_groups, n_usable = len(np.unique(group)), len(np.unique(group[usable]))
    if n_usable == 0 and cfg.allow_no_signal:
        print0(
            f"no usable group: all {n_groups} groups have equal rewards (or one session); writing the starting "
            "adapter unchanged (--allow-no-signal)"
        )
        save_untrained(
            accelerator,
            cfg,
            {
                "step": 0,
                "data/sessions": len(rollout.session_ids),
                "data/traces": len(rollout.trace_session),
                "data/groups": n_groups,
                "reward/zero_std_frac": 1.0,
            },
        )
        return
    if n_usable == 0:
        raise DataError(
            f"no usable group: all {n_groups} groups have equal rewards (or one session); nothing to learn. Next: "
            "more samples per task (rollout --samples), tasks nearer the model's level, dynamic sampling (eval loop "
            "--groups), a warm start with train/sft.py, or --allow-no-signal to write the adapter unchanged"
        )
    traces, cut = data.make_traces(rollout, adv, usable, cfg.max_len)
    if not traces:
        raise DataError(f"no trainable trace in the usable groups: {cut}")

    # 2. Model: base + LoRA, wrapped so that one forward gives log-probs
    policy = load_policy(cfg, accelerator.mixed_precision)
    check_vocabulary(policy, traces)
    batching = policy.batching
    print0(f"batching: {batching} ({policy.batching_reason})")
    print0(f"dtype: {policy.dtype_reason}")

    # 3. Plan: whole task groups -> optimizer steps -> packed micro-batches per rank; optimizer, schedule
    by_session: dict[int, list[Trace]] = defaultdict(list)
    for t in traces:
        by_session[t.session].append(t)
    by_group: dict[int, list[int]] = defaultdict(list)
    for s in sorted(by_session):
        by_group[int(group[s])].append(s)
    plan = data.plan_steps([by_group[g] for g in sorted(by_group)], cfg.groups_per_step, cfg.seed)
    order = [list(range(len(plan)))] + [
        np.random.default_rng([cfg.seed, e]).permutation(len(plan)).tolist() for e in range(1, cfg.epochs)
    ]
    schedule = [p for epoch in order for p in epoch][: cfg.max_steps]  # plan index of each optimizer step
    fingerprint = hashlib.sha256(
        json.dumps([[rollout.session_ids[s] for s in step] for step in plan] + [world]).encode()
    ).hexdigest()[:16]

    aggregate = losses.AGGREGATIONS[cfg.loss_agg]  # the loss variants, picked once
    importance = (
        functools.partial(losses.truncated_importance, cap=cfg.tis_cap)
        if cfg.tis_cap is not None
        else losses.no_importance
    )

    def micro_batches(p: int) -> list[MicroBatch]:
        return rank_micro_batches([t for s in plan[p] for t in by_session[s]], cfg, aggregate, rank, world, batching)

    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (cfg.warmup_steps + 1)))
    if accelerator.state.deepspeed_plugin is not None:  # no dataloader for DeepSpeed to read a batch size from
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1
    policy, optimizer = accelerator.prepare(policy, optimizer)
    trainable = [p for p in policy.parameters() if p.requires_grad]  # FSDP2 replaced them with their shards
    runtime.print_placement(accelerator, policy)
    progress = runtime.Progress(plan=fingerprint)
    accelerator.register_for_checkpointing(scheduler, progress)  # the scheduler steps once per optimizer step
    accelerator.register_save_state_pre_hook(runtime.keep_trainable_weights)
    if cfg.resume is not None:
        progress.step = json.loads((cfg.resume / "trainer_state.json").read_text())["step"]

    # 4. pi_old: log-probs of the policy as it starts, for every step that runs after an update. The first
    #    step needs no extra pass: nothing has been updated yet, so its own forward is pi_old (detached).
    fresh = progress.step == 0 and cfg.epochs == 1 and cfg.lora_dropout == 0
    need_old = sorted(set(schedule[progress.step :]) - ({schedule[0]} if fresh else set()))
    old: dict[tuple[int, int], torch.Tensor] = {}
    t0 = time.perf_counter()
    policy.eval()
    with torch.no_grad():
        for p in need_old:
            for j, mb in enumerate(micro_batches(p)):
                mb = mb.to(accelerator.device)
                old[p, j] = policy(mb.input_ids, mb.position_ids, mb.sel, mb.targets, mb.prefix)[0].cpu()  # (N,)
    policy.train()
    if need_old:
        print0(f"pi_old log-probs for {len(need_old)} steps in {time.perf_counter() - t0:.1f} s")

    # 5. Resume: adapter weights, optimizer, scheduler, RNG and the step counter
    if cfg.resume is not None:
        accelerator.load_state(str(cfg.resume), strict=False)  # the checkpoint holds only the adapter's weights
        if progress.plan != fingerprint:
            raise TrainConfigError(
                f"{cfg.resume}: saved with other trajectories, seed, --groups-per-step or process "
                "count; resume with the same settings"
            )
        print0(f"resumed from {cfg.resume} after step {progress.step}")
    if accelerator.is_main_process:
        cfg.output.mkdir(parents=True, exist_ok=True)
        (cfg.output / "config.yaml").write_text(runtime.config_yaml(cfg))
    log: runtime.MetricsLog | runtime.NoLog = (
        runtime.MetricsLog(cfg.output, progress.step if cfg.resume else None)
        if accelerator.is_main_process
        else runtime.NoLog()
    )
    if progress.step == 0:
        log.log(
            {
                "step": 0,
                "data/sessions": len(rollout.session_ids),
                "data/groups": n_groups,
                "reward/zero_std_frac": 1 - n_usable / n_groups,
                **runtime.data_counts(rollout, cut),
            }
        )
    print0(
        f"{len(rollout.session_ids)} sessions in {n_groups} groups ({n_groups - n_usable} skipped: equal "
        f"rewards), {len(traces)} traces to train ({cut}); {len(schedule)} steps of <= {cfg.groups_per_step} "
        f"groups on {world} process(es)"
    )

    # 6. Steps: accumulate micro-batches, clip, update, log, checkpoint
    for k in range(progress.step, len(schedule)):
        p, t0, stats, loss = schedule[k], time.perf_counter(), runtime.StepStats(), 0.0
        mbs = micro_batches(p)
        for j, mb in enumerate(runtime.micro_steps(accelerator, policy, mbs)):
            loss += accumulate(accelerator, policy, mb, old.get((p, j)), cfg, importance, stats)
        loss, grad_norm, finite = runtime.clip_and_reduce(accelerator, trainable, cfg.grad_clip, loss)
        if finite:
            optimizer.step()
            scheduler.step()
            progress.bad_steps = 0
        else:
            progress.bad_steps += 1
        optimizer.zero_grad(set_to_none=True)
        progress.step = k + 1

        row = stats.finish(accelerator)
        sessions = plan[p]
        r = rollout.reward[sessions]  # (|B|,)
        row = {
            "step": k + 1,
            "epoch": k // len(plan),
            "loss/total": loss,
            **row,
            "optim/grad_norm": grad_norm,
            "optim/lr": float(scheduler.get_last_lr()[0]),
            "optim/skipped": int(progress.bad_steps > 0),
            "reward/mean": float(r.mean()),
            "reward/std": float(r.std()),
            "reward/min": float(r.min()),
            "reward/max": float(r.max()),
            "reward/adv_abs_mean": float(np.abs(adv[sessions]).mean()),
            "reward/adv_mean": float(adv[sessions].mean()),
            **runtime.perf(accelerator, mbs, time.perf_counter() - t0),
        }
        log.log(row)
        print0(
            f"step {k + 1}/{len(schedule)}  loss {loss:+.4f}  reward {r.mean():.3f}  "
            f"clip {row['policy/clip_frac_low'] + row['policy/clip_frac_high']:.3f}  "
            f"grad {grad_norm:.3g}  {row['perf/tokens_per_s']:.0f} tok/s"
        )
        if progress.bad_steps:
            print0(f"step {k + 1} skipped: non-finite loss {loss} or gradient norm {grad_norm}")
            if progress.bad_steps >= cfg.max_bad_steps:
                raise FloatingPointError(f"{progress.bad_steps} consecutive steps with a non-finite loss or gradient")
        if cfg.save_every and (k + 1) % cfg.save_every == 0 and k + 1 < len(schedule):
            runtime.save_checkpoint(accelerator, policy, cfg.output, cfg, progress)

    # 7. The adapter, loadable by PEFT and vLLM
    runtime.save_adapter(accelerator, policy, cfg.output, cfg)
    log.close()
    print0(f"adapter written to {cfg.output}")


def save_untrained(accelerator: Accelerator, cfg: Config, row: dict[str, Any]) -> None:
    """The adapter as it starts (a fresh LoRA is the base model: B = 0), its config and the step-0 metrics row."""
    policy = load_policy(cfg, accelerator.mixed_precision)
    if accelerator.is_main_process:
        cfg.output.mkdir(parents=True, exist_ok=True)
        log = runtime.MetricsLog(cfg.output, None)
        log.log(row)
        log.close()
    runtime.save_adapter(accelerator, policy, cfg.output, cfg)
    accelerator.print(f"adapter written to {cfg.output} (untrained)")


if __name__ == "__main__":
    runtime.run(main, Config)  # flags (after any --config YAML) -> Config -> main
