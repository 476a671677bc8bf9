"""The GPU check: train/grpo.py's step on a Qwen3-4B-shaped model, ready for the first GPU a session is lent.

Run:  .venv/bin/python -m tests.bench.gpu [--tiny] [--out tests/bench/results/gpu.md]

Needs only torch, transformers, peft and accelerate, and no hub: the model is built from a config written here,
Qwen3-4B's shape (36 layers, hidden 2560, 32 query and 8 key-value heads, vocabulary 151,936) with random
weights in bf16, on the first CUDA device (else the CPU). It measures:

1. A GRPO step: ``grpo.accumulate`` over every micro-batch (fused chunked log-probs, GRPO loss, backward), then
   clipping and AdamW, with grpo.py's LoRA (r 16 on every linear layer of the decoder) and gradient checkpointing.
   Sixteen 2048-token traces in 8192-token micro-batches: tokens/s, MFU and peak memory. Then the same traces as
   two groups of eight that share a 1024-token prompt, packed with ``--share-prefix`` (each prompt computed once
   per micro-batch).
2. Peak memory of the log-probs at 8K and 32K tokens: the loss path from the last hidden states, fused chunks
   (what grpo.py trains with) against full logits; and one whole 32K-token micro-batch through the model.
3. FSDP on one device: the step of 1. with every decoder layer and the policy under FSDP2 (``fully_shard``, a
   process group of one), which is what ``train/configs/fsdp.yaml`` makes of it.

MFU counts 4 x (parameters) x tokens per step (forward 2, backward through the activations 2: the frozen base gets
no weight gradient under LoRA) plus attention's 4 x layers x tokens x context x width (forward and backward,
causal), against the device's dense bf16 peak (PEAK_FLOPS). With gradient checkpointing the GPU runs one forward
more than counted. ``--tiny`` runs the same code on a model of a few hundred thousand weights and short traces, so
the check runs in ``make test`` (tests/bench/test_gpu.py) and never rots; its figures mean nothing.
Must finish within 8 minutes on one GPU, so a lent device's 15 minutes hold it twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import tyro
from rich.console import Console

from tests.bench import report

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30
# Dense bf16 peak FLOP/s by device name (the vendors' figures, without sparsity); MFU is left out for others.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}
QWEN3_4B = {
    "vocab_size": 151936,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": True,
}
TINY = {**QWEN3_4B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
TINY |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


@dataclasses.dataclass
class Config:
    """GRPO step, log-prob memory and FSDP on one device, at Qwen3-4B's shape."""

    tiny: bool = False
    """A model of a few hundred thousand weights and short traces: checks the code runs (make test), in seconds."""
    out: Path = Path("tests/bench/results/gpu.md")
    """Markdown results file (relative to the repository root); the JSON goes next to it as .json."""


@dataclasses.dataclass(frozen=True)
class Sizes:
    trace: int  # tokens per trace
    prompt: int  # tokens of the prompt a group shares (share-prefix run)
    traces: int  # traces per step
    micro_batch: int  # tokens per micro-batch
    long: tuple[int, ...]  # token counts of the log-prob memory runs


FULL = Sizes(trace=2048, prompt=1024, traces=16, micro_batch=8192, long=(8192, 32768))
SMALL = Sizes(trace=64, prompt=32, traces=8, micro_batch=256, long=(256, 1024))


def build_policy(shape: dict[str, Any], device: torch.device, micro_batch: int) -> tuple[Any, Any]:
    """(policy.Policy over a random Qwen3 of ``shape`` in bf16 with grpo.py's LoRA, its grpo.Config)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from train import grpo, policy

    torch.manual_seed(0)
    config = Qwen3Config(**shape, bos_token_id=None, eos_token_id=2, pad_token_id=0, use_cache=False)
    with torch.device(device):
        base = Qwen3ForCausalLM(config).to(torch.bfloat16)
    base.activation_checkpointing_enable({"use_reentrant": False})
    # What grpo.py's --lora-targets all-linear resolves to on Qwen3: every linear layer of the decoder.
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft reads is_gradient_checkpointing, which transformers 5 deprecates
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        peft_model = get_peft_model(base, lora)
    cfg = grpo.Config(
        trajectories=(),
        model="random-qwen3",
        output=Path("unused"),
        max_len=micro_batch,
        micro_batch_tokens=micro_batch,
        lora_r=16,
        attn_implementation="sdpa",
    )
    return policy.Policy(peft_model, cfg), cfg


def make_traces(sizes: Sizes, vocab: int, shared: bool) -> list[Any]:
    """``sizes.traces`` traces; with ``shared``, two groups whose traces begin with the group's prompt."""
    from train import data

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, sizes.prompt) for _ in range(2)]
    traces = []
    for i in range(sizes.traces):
        prompt = prompts[i % 2] if shared else rng.integers(3, vocab, sizes.prompt)
        tokens = np.concatenate([prompt, rng.integers(3, vocab, sizes.trace - sizes.prompt)])
        n_sampled = sizes.trace - sizes.prompt
        traces.append(
            data.Trace(
                session=i,
                tokens=tokens,
                n_prompt=sizes.prompt,
                trained=np.arange(sizes.prompt - 1, sizes.trace - 1),
                behav_logp=-rng.random(n_sampled).astype(np.float32) * 4,
                adv=float(i % 2) - 0.5,
            )
        )
    return traces


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def peak_memory(device: torch.device, into: dict[str, Any]) -> Iterator[None]:
    """``into["peak_gib"]``: the most device memory allocated inside the block, above what was there before."""
    if device.type != "cuda":
        yield
        into["peak_gib"] = None  # the CPU has no allocator counter; resident memory would mix in everything else
        return
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    yield
    sync(device)
    into["peak_gib"] = (torch.cuda.max_memory_allocated(device) - before) / GiB


def step_flops(shape: dict[str, Any], params: int, tokens: int, context: int) -> float:
    """Model FLOPs of one LoRA step over ``tokens`` in traces of ``context`` tokens (see the module doc)."""
    width = shape["num_attention_heads"] * shape["head_dim"]
    return 4.0 * params * tokens + 4.0 * shape["num_hidden_layers"] * tokens * context * width


def time_steps(step: Callable[[], None], device: torch.device, rounds: int) -> float:
    """Best seconds of ``rounds`` steps, after one warm-up step."""
    step()
    best = float("inf")
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def grpo_runs(policy: Any, cfg: Any, sizes: Sizes, shape: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Tokens/s, MFU and peak memory of a GRPO step, plain packing and shared prefixes; the step function too."""
    from accelerate import Accelerator

    from train import grpo, losses, runtime

    accelerator = Accelerator(cpu=device.type == "cpu")
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-6)
    importance = lambda o, b: losses.truncated_importance(o, b, 2.0)  # noqa: E731
    params = sum(p.numel() for p in policy.parameters())
    peak = PEAK_FLOPS.get(next((k for k in PEAK_FLOPS if k in device_name(device)), ""))
    results: dict[str, Any] = {"parameters": params, "trainable": sum(p.numel() for p in trainable)}

    def step_of(mbs: list[Any]) -> Callable[[], None]:
        def step() -> None:
            for mb in mbs:
                grpo.accumulate(accelerator, policy, mb.to(device), None, cfg, importance, runtime.StepStats())
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    steps = {}
    for name, shared in (("grpo", False), ("grpo_share_prefix", True)):
        traces = make_traces(sizes, shape["vocab_size"], shared)
        run_cfg = dataclasses.replace(cfg, share_prefix=shared)
        mbs = grpo.rank_micro_batches(
            traces, run_cfg, losses.AGGREGATIONS[cfg.loss_agg], rank=0, world=1, batching="packed"
        )
        steps[name] = step_of(mbs)
        row: dict[str, Any] = {"micro_batches": len(mbs), "computed_tokens": sum(mb.input_ids.shape[1] for mb in mbs)}
        with peak_memory(device, row):
            seconds = time_steps(steps[name], device, rounds=3)
        tokens = sizes.traces * sizes.trace  # the traces' own tokens: what a user's batch holds
        flops = step_flops(shape, params, tokens, sizes.trace)
        row |= {"step_s": seconds, "tokens_per_s": tokens / seconds, "mfu": flops / seconds / peak if peak else None}
        results[name] = row
    results["step"] = steps["grpo"]
    return results


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def logprob_memory(shape: dict[str, Any], sizes: Sizes, device: torch.device) -> list[dict[str, Any]]:
    """Peak memory of the loss path from hidden states at each long size: fused chunks against full logits."""
    from train.logprobs import full_logits_logprobs, fused_token_loss

    head = torch.nn.Linear(shape["hidden_size"], shape["vocab_size"], bias=False, device=device)
    head = head.to(torch.bfloat16).requires_grad_(False)  # frozen under LoRA
    rows = []
    for tokens in sizes.long:
        for method in ("fused", "full"):
            h = torch.randn(tokens, shape["hidden_size"], device=device, dtype=torch.bfloat16, requires_grad=True)
            t = torch.randint(0, shape["vocab_size"], (tokens,), device=device)
            row: dict[str, Any] = {"method": method, "tokens": tokens}
            with peak_memory(device, row):
                if method == "fused":
                    fused_token_loss(h, t, head, lambda logp, sl: -logp, chunk=512)[0].backward()
                else:
                    (-full_logits_logprobs(h, t, head)).sum().backward()
            rows.append(row)
            del h, t
    return rows


def long_micro_batch(policy: Any, cfg: Any, shape: dict[str, Any], tokens: int, device: torch.device) -> dict[str, Any]:
    """Peak memory and seconds of one GRPO micro-batch holding one trace of ``tokens`` tokens."""
    from accelerate import Accelerator

    from train import grpo, losses, runtime

    sizes = Sizes(trace=tokens, prompt=tokens // 8, traces=1, micro_batch=tokens, long=())
    run_cfg = dataclasses.replace(cfg, max_len=tokens, micro_batch_tokens=tokens)
    [mb] = grpo.rank_micro_batches(
        make_traces(sizes, shape["vocab_size"], False),
        run_cfg,
        losses.AGGREGATIONS[cfg.loss_agg],
        rank=0,
        world=1,
        batching="packed",
    )
    importance = lambda o, b: losses.truncated_importance(o, b, 2.0)  # noqa: E731
    accelerator = Accelerator(cpu=device.type == "cpu")
    row: dict[str, Any] = {"tokens": tokens}
    with peak_memory(device, row):
        sync(device)
        t0 = time.perf_counter()
        grpo.accumulate(accelerator, policy, mb.to(device), None, run_cfg, importance, runtime.StepStats())
        sync(device)
    row["seconds"] = time.perf_counter() - t0
    policy.zero_grad(set_to_none=True)
    return row


def fsdp_run(policy: Any, cfg: Any, sizes: Sizes, shape: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The GRPO step of ``grpo_runs`` with each decoder layer and the policy under FSDP2, one process."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )
    try:
        for layer in policy.peft.get_base_model().model.layers:
            fully_shard(layer)
        fully_shard(policy)
        runs = grpo_runs(policy, cfg, sizes, shape, device)
        return {"grpo": runs["grpo"]}
    finally:
        dist.destroy_process_group()


def main(cfg: Config) -> int:
    console = Console() if sys.stdout.isatty() else Console(width=130)
    t0 = time.monotonic()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    shape, sizes = (TINY, SMALL) if cfg.tiny else (QWEN3_4B, FULL)
    if device.type == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    console.print(f"[bold]device {device_name(device)}; model {'tiny' if cfg.tiny else 'Qwen3-4B shape'}, bf16[/]")
    policy, gcfg = build_policy(shape, device, sizes.micro_batch)
    policy.train()
    console.print("1. GRPO step, plain packing and shared prefixes")
    steps = grpo_runs(policy, gcfg, sizes, shape, device)
    steps.pop("step")
    console.print("2. log-prob memory")
    memory = logprob_memory(shape, sizes, device)
    long = long_micro_batch(policy, gcfg, shape, sizes.long[-1], device)
    console.print("3. FSDP2 on one device")
    fsdp = fsdp_run(policy, gcfg, sizes, shape, device)
    elapsed = time.monotonic() - t0

    def fmt(v: Any, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    step_rows = [
        [name, str(r["micro_batches"]), str(r["computed_tokens"]), fmt(r["step_s"], ".3f"),
         fmt(r["tokens_per_s"], ",.0f"), fmt(r["mfu"], ".1%"), fmt(r["peak_gib"], ".2f")]
        for name, r in (("grpo", steps["grpo"]), ("grpo --share-prefix", steps["grpo_share_prefix"]),
                        ("grpo under FSDP2", fsdp["grpo"]))
    ]  # fmt: skip
    memory_rows = [[r["method"], str(r["tokens"]), fmt(r["peak_gib"], ".2f")] for r in memory]
    memory_rows.append(["whole micro-batch (fused)", str(long["tokens"]), fmt(long["peak_gib"], ".2f")])
    tables = [
        (["step", "micro-batches", "tokens computed", "s", "tokens/s", "MFU", "peak GiB"], step_rows),
        (["log-probs", "tokens", "peak GiB"], memory_rows),
    ]
    notes = [
        f"device {device_name(device)}, torch {torch.__version__}",
        f"model {'tiny' if cfg.tiny else 'Qwen3-4B shape'}: {steps['parameters']:,} weights",
        f"{steps['trainable']:,} trainable (LoRA r16), bf16, gradient checkpointing",
        f"{sizes.traces} traces of {sizes.trace} tokens a step, micro-batches of {sizes.micro_batch}; best of 3 steps",
        f"finished in {elapsed:.0f} s",
    ]
    out = cfg.out if cfg.out.is_absolute() else ROOT / cfg.out
    data = {"device": device_name(device), "step": steps, "memory": memory, "long": long, "fsdp": fsdp}
    report.write_results(console, out, cfg, tables, notes, data | {"elapsed_s": elapsed})
    console.print(f"wrote {out} and {out.with_suffix('.json')} in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Config)))
