"""The GPU check: train/grpo.py's step on Qwen3-4B- and Qwen3.5-4B-shaped models, ready for the first GPU lent.

Run:  .venv/bin/python -m tests.bench.gpu [--tiny] [--out tests/bench/results/gpu.md]

Needs only torch, transformers, peft and accelerate, and no hub: the models are built from configs written here
with random weights in bf16, on the first CUDA device (else the CPU): Qwen3-4B's shape (36 layers, hidden 2560, 32
query and 8 key-value heads, vocabulary 151,936) and Qwen3.5-4B's text model, the seed's family (32 layers, hidden
2560, three Gated DeltaNet layers to one full-attention layer, vocabulary 248,320). It measures:

1. A GRPO step: ``grpo.accumulate`` over every micro-batch (fused chunked log-probs, GRPO loss, backward), then
   clipping and AdamW, with grpo.py's LoRA (r 16 on every linear layer of the decoder) and gradient checkpointing.
   Sixteen 2048-token traces in 8192-token micro-batches: tokens/s, MFU and peak memory. Then the same traces as
   two groups of eight that share a 1024-token prompt, packed with ``--share-prefix`` (each prompt computed once
   per micro-batch).
2. Peak memory of the log-probs at 8K and 32K tokens: the loss path from the last hidden states, fused chunks
   (what grpo.py trains with) against full logits; and one whole 32K-token micro-batch through the model.
3. FSDP on one device: the step of 1. with every decoder layer and the policy under FSDP2 (``fully_shard``, a
   process group of one), which is what ``train/configs/fsdp.yaml`` makes of it.
4. Qwen3.5-4B: the step of 1. (same traces, LoRA on what grpo.py's all-linear resolves to there, Gated DeltaNet's
   in_proj_qkv/z/a/b and out_proj included) packed and padded (one trace a row), with the batching the policy chose
   at load and the linear-attention kernels found (flash-linear-attention ``fla``, ``causal_conv1d``). Packed is
   ``varlen`` where they import on a GPU (trace bounds reach the kernels, which restart the state at each one);
   without them a packed row leaks state from trace to trace and is timed only. Then a correctness check: each of
   three short traces alone against the three packed in one row and padded in one micro-batch, no-grad, the largest
   log-prob difference: padded is right by construction, so its difference is the bf16 kernels' noise, and varlen
   packing is right when its difference is of that size.

MFU counts 4 x (parameters) x tokens per step (forward 2, backward through the activations 2: the frozen base gets
no weight gradient under LoRA) plus attention's 4 x layers x tokens x context x width (forward and backward,
causal) for the full-attention layers only, against the device's dense bf16 peak (PEAK_FLOPS). A Gated DeltaNet
layer's cost is counted in its projections' weights; its chunked recurrence (a (128 x 128) state per value head:
about 2 % of the layer's matmuls, at any length) and its convolution are left out, so MFU there is slightly low. With gradient checkpointing the GPU runs one forward more than counted. ``--tiny`` runs the same code on
models of a few hundred thousand weights and short traces, so the check runs in ``make test``
(tests/bench/test_gpu.py) and never rots; its figures mean nothing.

Must finish within 8 minutes on one GPU, so a lent device's 15 minutes hold it twice. Estimate, not measured: 1. and
3. are 12 steps of 32,768 tokens at 5.7e14 counted FLOPs (8.4e14 run, with the recomputed forward), 2.'s 32K
micro-batch 1.6e15 run, 4. eight steps at 5.6e14 counted (8.4e14 run): 1.9e16 FLOPs, 19 s at the H200's peak and
about a minute at 30 % MFU. The rest is building the models (random init on the device, seconds), Triton compiling
and autotuning fla's kernels at their first call (tens of seconds), and, without the kernels, transformers' torch
fallback for Gated DeltaNet (a Python loop over 64-token chunks: slower by an unmeasured factor, which the margin
of several times is for).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.metadata
import importlib.util
import os
import socket
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

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
# Qwen3.5-4B's text config (its published config.json, named as Qwen3_5TextConfig's signature names them): the
# published full_attention_interval 4 is written out as layer_types; its rope's mrope sections are left out, as
# a text-only model gives the three sections the same positions, which is plain rope.
QWEN35_4B = {
    "vocab_size": 248320,
    "hidden_size": 2560,
    "intermediate_size": 9216,
    "num_hidden_layers": 32,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
TINY_QWEN35 = {**QWEN35_4B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4}
TINY_QWEN35 |= {"layer_types": QWEN35_4B["layer_types"][:4], "num_attention_heads": 4, "num_key_value_heads": 2}
TINY_QWEN35 |= {"head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4}
TINY_QWEN35 |= {"linear_key_head_dim": 16, "linear_value_head_dim": 16}
# The correctness check's traces: shorter and longer than the kernels' 64-token chunks, in every model.
CHECK_LENGTHS = (96, 40, 150)


@dataclasses.dataclass
class Config:
    """GRPO step, log-prob memory and FSDP on one device at Qwen3-4B's shape; packed and padded at Qwen3.5-4B's."""

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


def build_policy(family: str, shape: dict[str, Any], device: torch.device, micro_batch: int) -> tuple[Any, Any]:
    """(policy.Policy over a random ``family`` model ("qwen3", "qwen3.5") of ``shape`` in bf16 with grpo.py's LoRA,
    its grpo.Config); the policy chooses its batching from the model, as in training."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    from train import attention, grpo, policy

    config_class, model_class = {
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "qwen3.5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
    }[family]
    torch.manual_seed(0)
    config = config_class(**shape, bos_token_id=None, eos_token_id=2, pad_token_id=0, use_cache=False)
    config._attn_implementation = attention.register()  # the trainer's attention, as load_policy sets it
    with torch.device(device):
        base = model_class(config).to(torch.bfloat16)
    policy.enable_checkpointing(base)
    lora = LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules=policy.lora_target_names(base), task_type="CAUSAL_LM"
    )
    with warnings.catch_warnings():  # peft reads is_gradient_checkpointing, which transformers 5 deprecates
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        peft_model = get_peft_model(base, lora)
    cfg = grpo.Config(
        trajectories=(),
        model=f"random-{family}",
        output=Path("unused"),
        max_len=micro_batch,
        micro_batch_tokens=micro_batch,
        lora_r=16,
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
    """Model FLOPs of one LoRA step over ``tokens`` in traces of ``context`` tokens (see the module doc): attention's
    term for the full-attention layers only (every layer where ``shape`` lists no layer types)."""
    width = shape["num_attention_heads"] * shape["head_dim"]
    kinds = shape.get("layer_types") or ["full_attention"] * shape["num_hidden_layers"]
    return 4.0 * params * tokens + 4.0 * kinds.count("full_attention") * tokens * context * width


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


# A run of the step: (share prompts by --share-prefix, rows: "packed" (varlen where the policy has it) or "padded").
Run = tuple[bool, Literal["packed", "padded"]]
QWEN3_RUNS: dict[str, Run] = {"grpo": (False, "packed"), "grpo_share_prefix": (True, "packed")}
QWEN35_RUNS: dict[str, Run] = {"packed": (False, "packed"), "padded": (False, "padded")}


def grpo_runs(
    policy: Any, cfg: Any, sizes: Sizes, shape: dict[str, Any], device: torch.device, runs: dict[str, Run]
) -> dict[str, Any]:
    """Tokens/s, MFU and peak memory of a GRPO step for each of ``runs``, and the batching its forward used (a packed
    row is ``varlen`` where the policy has the kernels, plain ``packed`` otherwise); the first run's step function."""
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
    for name, (shared, rows) in runs.items():
        traces = make_traces(sizes, shape["vocab_size"], shared)
        run_cfg = dataclasses.replace(cfg, share_prefix=shared)
        mbs = grpo.rank_micro_batches(
            traces, run_cfg, losses.AGGREGATIONS[cfg.loss_agg], rank=0, world=1, batching=rows
        )
        steps[name] = step_of(mbs)
        row: dict[str, Any] = {
            "batching": "varlen" if rows == "packed" and policy.batching == "varlen" else rows,
            "micro_batches": len(mbs),
            "computed_tokens": sum(mb.computed_tokens() for mb in mbs),
        }
        with peak_memory(device, row):
            seconds = time_steps(steps[name], device, rounds=3)
        tokens = sizes.traces * sizes.trace  # the traces' own tokens: what a user's batch holds
        flops = step_flops(shape, params, tokens, sizes.trace)
        row |= {"step_s": seconds, "tokens_per_s": tokens / seconds, "mfu": flops / seconds / peak if peak else None}
        results[name] = row
    results["step"] = steps[next(iter(runs))]
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
        runs = grpo_runs(policy, cfg, sizes, shape, device, {"grpo": QWEN3_RUNS["grpo"]})
        return {"grpo": runs["grpo"]}
    finally:
        dist.destroy_process_group()


def kernel_versions() -> dict[str, str | None]:
    """The linear-attention kernels transformers runs Gated DeltaNet with when they import: their distributions and
    versions, None where absent."""
    distributions = importlib.metadata.packages_distributions()
    found: dict[str, str | None] = {}
    for module in ("fla", "causal_conv1d"):
        if importlib.util.find_spec(module) is None:
            found[module] = None
            continue
        names = sorted(set(distributions.get(module, [])))
        found[module] = ", ".join(f"{n} {importlib.metadata.version(n)}" for n in names) or "installed, no metadata"
    return found


def packing_check(policy: Any, cfg: Any, vocab: int, device: torch.device) -> dict[str, Any]:
    """The largest |log-prob - the trace's alone| over the CHECK_LENGTHS traces, packed in one row (as the policy
    runs a packed row: varlen or not) and padded one a row, no-grad."""
    from train import data, grpo, losses

    rng = np.random.default_rng(1)
    traces = [
        data.Trace(
            session=i,
            tokens=rng.integers(3, vocab, n),
            n_prompt=1,
            trained=np.arange(0, n - 1),
            behav_logp=np.full(n - 1, np.nan, np.float32),
            adv=1.0,
        )
        for i, n in enumerate(CHECK_LENGTHS)
    ]
    longest = max(CHECK_LENGTHS)
    run_cfg = dataclasses.replace(cfg, max_len=longest, micro_batch_tokens=len(traces) * longest)

    def logp_by_trace(batch: list[Any], rows: Literal["packed", "padded"]) -> dict[int, torch.Tensor]:
        [mb] = grpo.rank_micro_batches(batch, run_cfg, losses.AGGREGATIONS[cfg.loss_agg], 0, 1, batching=rows)
        mb = mb.to(device)
        logp = policy(mb.input_ids, mb.position_ids, mb.sel, mb.targets)[0].float()  # (N,)
        return {t.session: logp[mb.session == t.session] for t in batch}

    policy.eval()
    with torch.no_grad():
        alone = {t.session: logp_by_trace([t], "packed")[t.session] for t in traces}
        together = {rows: logp_by_trace(traces, rows) for rows in ("packed", "padded")}
    policy.train()
    worst = {rows: max(float((got[s] - alone[s]).abs().max()) for s in alone) for rows, got in together.items()}
    return {"lengths": list(CHECK_LENGTHS), "packed_max_diff": worst["packed"], "padded_max_diff": worst["padded"]}


def hybrid_runs(shape: dict[str, Any], sizes: Sizes, device: torch.device) -> dict[str, Any]:
    """Part 4 on a random Qwen3.5 of ``shape``: the batching chosen, packed and padded steps, the packing check."""
    policy, gcfg = build_policy("qwen3.5", shape, device, sizes.micro_batch)
    policy.train()
    results = grpo_runs(policy, gcfg, sizes, shape, device, QWEN35_RUNS)
    results.pop("step")
    results |= {"batching": policy.batching, "batching_reason": policy.batching_reason}
    results["lora_targets"] = sorted(policy.peft.peft_config["default"].target_modules)
    results["check"] = packing_check(policy, gcfg, shape["vocab_size"], device)
    return results


def main(cfg: Config) -> int:
    console = Console() if sys.stdout.isatty() else Console(width=130)
    t0 = time.monotonic()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    shape, hybrid_shape, sizes = (TINY, TINY_QWEN35, SMALL) if cfg.tiny else (QWEN3_4B, QWEN35_4B, FULL)
    if device.type == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    kernels = kernel_versions()
    size = "tiny" if cfg.tiny else "4B"
    console.print(f"[bold]device {device_name(device)}; models Qwen3-{size} and Qwen3.5-{size} shapes, bf16[/]")
    console.print(f"linear-attention kernels: {kernels}")
    policy, gcfg = build_policy("qwen3", shape, device, sizes.micro_batch)
    policy.train()
    console.print("1. GRPO step, plain packing and shared prefixes")
    steps = grpo_runs(policy, gcfg, sizes, shape, device, QWEN3_RUNS)
    steps.pop("step")
    console.print("2. log-prob memory")
    memory = logprob_memory(shape, sizes, device)
    long = long_micro_batch(policy, gcfg, shape, sizes.long[-1], device)
    console.print("3. FSDP2 on one device")
    fsdp = fsdp_run(policy, gcfg, sizes, shape, device)
    del policy  # the Qwen3.5 model needs its device memory
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    console.print("4. Qwen3.5: GRPO step packed and padded, packing check")
    try:
        hybrid = hybrid_runs(hybrid_shape, sizes, device)
        console.print(f"  batching chosen: {hybrid['batching']} ({hybrid['batching_reason']})")
    except Exception:  # noqa: BLE001 - written beside parts 1-3 rather than losing them: device minutes are few
        hybrid = {"error": traceback.format_exc()}
        console.print(f"[red]Qwen3.5 part failed[/]\n{hybrid['error']}")
    elapsed = time.monotonic() - t0

    def fmt(v: Any, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    def step_row(name: str, r: dict[str, Any]) -> list[str]:
        return [name, r["batching"], str(r["micro_batches"]), str(r["computed_tokens"]), fmt(r["step_s"], ".3f"),
                fmt(r["tokens_per_s"], ",.0f"), fmt(r["mfu"], ".1%"), fmt(r["peak_gib"], ".2f")]  # fmt: skip

    step_rows = [
        step_row(f"Qwen3-{size} grpo", steps["grpo"]),
        step_row(f"Qwen3-{size} grpo --share-prefix", steps["grpo_share_prefix"]),
        step_row(f"Qwen3-{size} grpo under FSDP2", fsdp["grpo"]),
    ]
    memory_rows = [[r["method"], str(r["tokens"]), fmt(r["peak_gib"], ".2f")] for r in memory]
    memory_rows.append(["whole micro-batch (fused)", str(long["tokens"]), fmt(long["peak_gib"], ".2f")])
    tables = [
        (["step", "batching", "micro-batches", "tokens computed", "s", "tokens/s", "MFU", "peak GiB"], step_rows),
        (["log-probs (Qwen3)", "tokens", "peak GiB"], memory_rows),
    ]
    found = ", ".join(f"{k} {v or 'absent'}" for k, v in kernels.items())
    notes = [
        f"device {device_name(device)}, torch {torch.__version__}; linear-attention kernels: {found}",
        f"Qwen3-{size} shape: {steps['parameters']:,} weights, {steps['trainable']:,} trainable (LoRA r16)",
    ]
    if "error" in hybrid:
        notes.append(f"Qwen3.5 part failed: {hybrid['error'].strip().splitlines()[-1]} (traceback in the JSON)")
    else:
        # Without the kernels a packed Qwen3.5 row carries each trace's state into the next: timed, not trained on.
        leaking = " (state leaks across traces: timing only)" if hybrid["packed"]["batching"] == "packed" else ""
        step_rows.append(step_row(f"Qwen3.5-{size} grpo packed{leaking}", hybrid["packed"]))
        step_rows.append(step_row(f"Qwen3.5-{size} grpo padded", hybrid["padded"]))
        check = hybrid["check"]
        check_rows = [
            [f"packed in one row ({hybrid['packed']['batching']})", f"{check['packed_max_diff']:.3g}"],
            ["padded, one trace a row (the bf16 noise)", f"{check['padded_max_diff']:.3g}"],
        ]
        lengths = ", ".join(map(str, check["lengths"]))
        tables.append(([f"Qwen3.5 traces of {lengths} tokens", "max |log-prob - alone|"], check_rows))
        weights = f"{hybrid['parameters']:,} weights, {hybrid['trainable']:,} trainable"
        notes += [
            f"Qwen3.5-{size} shape: {weights} (LoRA r16 on {', '.join(hybrid['lora_targets'])})",
            f"Qwen3.5 batching chosen at load: {hybrid['batching']} ({hybrid['batching_reason']})",
        ]
    notes += [
        "bf16, gradient checkpointing; MFU counts attention for full-attention layers only (module doc)",
        f"{sizes.traces} traces of {sizes.trace} tokens a step, micro-batches of {sizes.micro_batch}; best of 3 steps",
        f"finished in {elapsed:.0f} s",
    ]
    out = cfg.out if cfg.out.is_absolute() else ROOT / cfg.out
    data = {"device": device_name(device), "kernels": kernels, "step": steps, "memory": memory, "long": long}
    data |= {"fsdp": fsdp, "qwen35": hybrid}
    report.write_results(console, out, cfg, tables, notes, data | {"elapsed_s": elapsed})
    console.print(f"wrote {out} and {out.with_suffix('.json')} in {elapsed:.0f} s")
    return 1 if "error" in hybrid else 0


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Config)))
