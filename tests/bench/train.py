"""Benchmark train/grpo.py on CPU: a training step against a plain forward+backward, and log-prob memory.

Run:  .venv/bin/python -m tests.bench.train [--quick] [--out tests/bench/results/train.md]

1. Step time. A random Qwen3 (hidden 256, 4 layers, vocabulary 8192, so the output layer is a third of the
   weights, as in sub-1B models: the part our log-prob path changes weighs more here than in larger models)
   with grpo.py's LoRA (r 16, all linear layers) and gradient checkpointing. Four 256-token traces (16 prompt,
   240 sampled tokens) packed into two 512-token micro-batches: 1024 tokens per optimizer step. In rounds that
   rotate the order, it times
   - grpo step: ``grpo.accumulate`` on each micro-batch (fused chunked log-probs and GRPO loss with truncated IS
     and entropy, backward), gradient clipping, AdamW step: a run's first step, where pi_old comes free;
   - plain step: the model's own forward with labels (full logits, cross-entropy), backward, clip, AdamW step;
   - grpo step + pi_old pass: any later step of a run (one no-grad forward more);
   - grpo step + reference pass: with --kl-coef > 0 (one no-grad forward with the adapter disabled).
   Target: grpo step time <= 1.2 x plain step time. Time is the process's CPU time on one torch thread (the
   machine is shared: CPU time is what other processes disturb least), best of the rounds; medians are reported
   too, and wall-clock times are in the JSON.
2. Memory. Peak resident memory (VmHWM, reset just before) of the training path's log-probs + loss + backward
   for T tokens from hidden states (H 64, vocabulary 32768): ``fused_token_loss`` (chunk 512, what grpo.py
   trains with) vs full logits, each in a fresh process after a warm-up. Fused must grow with T x H, full
   logits with T x V.
3. Memory at the seed's vocabulary. The same fused path at Qwen3.5's 248,320-token vocabulary (H 64: the output
   layer is 61 MiB, the (chunk, V) blocks 485 MiB each) at 8192 and 32768 tokens (--quick: 2048 and 8192), fresh
   process each; full logits are left out (one (32768, 248320) fp32 tensor is 30 GiB). Checked: the peak at the
   longest trace is under half of one (T, V) fp32 tensor (so not even a bf16 copy of the logits was held), and each
   extra token costs at most 8 x 4H bytes (the path keeps the hidden states, their gradient and a few (T,)
   vectors: about 2 x 4H a token; a (T, V) tensor would add 4V, 3880 x 4H here). The rest of the peak is the
   (chunk, V) blocks of one chunk's work, the same at any T.

4. Packed attention and dtype. A random Llama of SmolLM2-135M's shape (hidden 576, 9 heads, 3 KV heads, MLP 1536,
   vocabulary 49152) cut to 4 layers, one packed row of two 1,800-token traces, forward + backward of the decoder:
   transformers' sdpa backend (a (T, T) block-diagonal mask from the restarting positions) against the trainer's
   span backend (train/attention.py: one causal SDPA per trace), each in fp32 and bf16; wall time, best of the
   rounds, on the CPU named in the notes. Info rows, no target: whether bf16 pays is the machine's to say
   (train/precision.py decides it at start).

Numbers are CPU numbers on whatever else the machine is doing; compare ratios. What needs a GPU: bf16 and
flash-attention speed, a whole 32k-token micro-batch against device memory, and multi-GPU (DDP/FSDP/DeepSpeed)
scaling. Exit status 0 when everything ran (a MISS is a result, not a failure).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
import tyro
from rich.console import Console

from tests.bench import report
from train.precision import cpu_name

ROOT = Path(__file__).resolve().parents[2]
SEED_VOCAB = 248320  # Qwen3.5's vocabulary


@dataclasses.dataclass
class Config:
    """Training-step and log-prob memory benchmark."""

    quick: bool = False
    """Short run (about 60 s): fewer rounds, memory up to 4096 tokens, the seed's vocabulary at 2048 and 8192 tokens
    (the full run takes about 2.5 min, 1.5 of them the seed's vocabulary at 8192 and 32768)."""
    out: Path = Path("tests/bench/results/train.md")
    """Markdown results file (relative to the repository root); the JSON goes next to it as .json."""
    threads: int = 1
    """torch CPU threads for the step benchmark (CPU time is summed over threads)."""


# ---- 1. step time


def _model_dir(tmp: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
    )
    Qwen3ForCausalLM(config).save_pretrained(tmp / "model")
    return tmp / "model"


def step_benchmark(cfg: Config, console: Console) -> dict[str, object]:
    from accelerate import Accelerator

    from train import data, grpo, losses, runtime
    from train.policy import load_policy

    torch.set_num_threads(cfg.threads)
    rounds = 3 if cfg.quick else 5
    with tempfile.TemporaryDirectory(prefix="polar-bench-train-") as tmpname:
        tmp = Path(tmpname)
        gcfg = grpo.Config(
            trajectories=(),
            model=str(_model_dir(tmp)),
            output=tmp / "out",
            max_len=512,
            micro_batch_tokens=512,
            lora_r=16,
            lora_alpha=32,
            lr=1e-5,
        )
        kl_cfg = dataclasses.replace(gcfg, kl_coef=0.01)
        policy = load_policy(gcfg, "no")
        rng = np.random.default_rng(0)
        traces = [
            data.Trace(
                session=i // 2,
                tokens=rng.integers(3, 8192, 256),
                n_prompt=16,
                trained=np.arange(15, 255),
                behav_logp=(np.full(240, np.nan, np.float32) if i % 2 else -rng.random(240).astype(np.float32) * 9),
                adv=float(i % 3) - 1,
            )
            for i in range(4)
        ]
        mbs = grpo.rank_micro_batches(
            traces, gcfg, losses.AGGREGATIONS[gcfg.loss_agg], rank=0, world=1, batching="packed"
        )
        tokens = sum(mb.input_ids.shape[1] for mb in mbs)
        accelerator = Accelerator(cpu=True)
        trainable = [p for p in policy.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=gcfg.lr)
        importance = lambda o, b: losses.truncated_importance(o, b, 2.0)  # noqa: E731

        def update() -> None:
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def grpo_step(old: list[torch.Tensor] | None = None, c: grpo.Config = gcfg) -> None:
            for j, mb in enumerate(mbs):
                grpo.accumulate(accelerator, policy, mb, old[j] if old else None, c, importance, runtime.StepStats())
            update()

        def grpo_step_with_old() -> None:
            policy.eval()
            with torch.no_grad():
                old = [policy(mb.input_ids, mb.position_ids, mb.sel, mb.targets)[0] for mb in mbs]
            policy.train()
            grpo_step(old)

        def plain_step() -> None:
            for mb in mbs:
                policy.peft(input_ids=mb.input_ids, position_ids=mb.position_ids, labels=mb.input_ids).loss.backward()
            update()

        methods: dict[str, Callable[[], None]] = {
            "plain": plain_step,
            "grpo": grpo_step,
            "grpo_old": grpo_step_with_old,
            "grpo_ref": lambda: grpo_step(c=kl_cfg),
        }
        cpu: dict[str, list[float]] = {k: [] for k in methods}
        wall: dict[str, list[float]] = {k: [] for k in methods}
        policy.train()
        for fn in methods.values():  # warm-up
            fn()
        names = list(methods)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                t0, c0 = time.perf_counter(), time.process_time()
                methods[name]()
                cpu[name].append(time.process_time() - c0)
                wall[name].append(time.perf_counter() - t0)
            console.print(f"  step round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in cpu.items()))
    best = {k: min(v) for k, v in cpu.items()}
    median = {k: statistics.median(v) for k, v in cpu.items()}
    return {
        "tokens_per_step": tokens,
        "threads": torch.get_num_threads(),
        "rounds": rounds,
        "cpu_s": cpu,
        "wall_s": wall,
        "best_s": best,
        "median_s": median,
        "tokens_per_s": {k: tokens / v for k, v in best.items()},
        "ratio": {k: best[k] / best["plain"] for k in best},
        "ratio_median": {k: median[k] / median["plain"] for k in median},
    }


# ---- 2. memory


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def child_memory(method: str, tokens: int, hidden: int, vocab: int, chunk: int) -> None:
    """In a fresh process: peak extra resident bytes of log-probs + backward, printed as JSON."""
    from train.logprobs import full_logits_logprobs, fused_token_loss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False).requires_grad_(False)  # frozen, as under LoRA

    def run(n: int) -> None:
        h = torch.randn(n, hidden, requires_grad=True)
        t = torch.randint(0, vocab, (n,))
        if method == "fused":
            fused_token_loss(h, t, head, lambda logp, sl: -logp, chunk=chunk)[0].backward()
        else:
            (-full_logits_logprobs(h, t, head)).sum().backward()

    run(64)  # page in the kernels' code first: it is resident memory too
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current resident size
    base = _vm("VmRSS")
    t0 = time.perf_counter()
    run(tokens)
    print(json.dumps({"peak_bytes": _vm("VmHWM") - base, "seconds": time.perf_counter() - t0}))


def memory_runs(
    methods: tuple[str, ...], sizes: list[int], hidden: int, vocab: int, chunk: int, console: Console
) -> dict[str, object]:
    """``child_memory`` of each method at each size, each in a fresh process (one torch thread)."""
    rows = []
    for tokens in sizes:
        for method in methods:
            call = f"child_memory({method!r}, {tokens}, {hidden}, {vocab}, {chunk})"
            code = f"from tests.bench.train import child_memory; {call}"
            out = subprocess.run(
                [sys.executable, "-c", code],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=600,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            if out.returncode != 0:
                raise RuntimeError(f"memory child {method} {tokens} failed:\n{out.stderr[-2000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"method": method, "tokens": tokens, **result})
            console.print(f"  memory {method:>7} T={tokens} V={vocab}: {result['peak_bytes'] / 2**20:.0f} MiB")
    return {"hidden": hidden, "vocab": vocab, "chunk": chunk, "rows": rows}


def memory_benchmark(cfg: Config, console: Console) -> dict[str, object]:
    sizes = [1024, 2048, 4096] if cfg.quick else [1024, 2048, 4096, 8192]
    return memory_runs(("fused", "full"), sizes, hidden=64, vocab=32768, chunk=512, console=console)


def seed_vocab_memory(cfg: Config, console: Console) -> dict[str, object]:
    sizes = [2048, 8192] if cfg.quick else [8192, 32768]
    return memory_runs(("fused",), sizes, hidden=64, vocab=SEED_VOCAB, chunk=512, console=console)


# ---- 4. packed attention and dtype


def attention_benchmark(cfg: Config, console: Console) -> dict[str, object]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from train import attention

    attention.register()
    torch.set_num_threads(max(cfg.threads, torch.get_num_threads()))
    rounds = 2 if cfg.quick else 3
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True,
    )  # fmt: skip
    ids = torch.randint(0, config.vocab_size, (1, 3600))
    positions = torch.cat([torch.arange(1800)] * 2)[None]  # (1, T): two traces
    seconds: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = LlamaForCausalLM(config).to(dtype)
        for backend in ("sdpa", attention.NAME):
            model.config._attn_implementation = backend
            spans = {"trace_spans": attention.trace_spans(positions)} if backend == attention.NAME else {}
            times = []
            for _ in range(rounds + 1):  # the first is a warm-up
                t0 = time.perf_counter()
                hidden = model.model(input_ids=ids, position_ids=positions, **spans).last_hidden_state
                hidden.float().square().mean().backward()
                times.append(time.perf_counter() - t0)
            name = f"{str(dtype).removeprefix('torch.')} {backend}"
            seconds[name] = min(times[1:])
            console.print(f"  {name}: {seconds[name]:.2f} s")
    return {"tokens": 3600, "traces": 2, "layers": 4, "threads": torch.get_num_threads(), "best_s": seconds}


# ---- report


def seed_vocab_targets(seed: dict[str, object]) -> list[dict[str, object]]:
    """Part 3's bounds: no (T, V) tensor at the longest trace, and growth of a few (T, H) tensors a token."""
    peak = {r["tokens"]: r["peak_bytes"] for r in seed["rows"]}
    lo, hi = min(peak), max(peak)
    per_token = (peak[hi] - peak[lo]) / (hi - lo)  # bytes per extra token
    of_tv = peak[hi] / (hi * seed["vocab"] * 4)
    of_h = per_token / (4 * seed["hidden"])
    block = seed["chunk"] * seed["vocab"] * 4  # one chunk's (chunk, V) fp32 logits
    return [
        {"name": f"seed vocab {seed['vocab']}: fused peak at {hi} tokens / one (T, V) fp32 tensor", "value": of_tv,
         "unit": "x", "limit": "< 0.5", "result": "PASS" if of_tv < 0.5 else "MISS"},
        {"name": f"seed vocab: bytes per extra token, {lo} -> {hi}, / (4 x hidden)", "value": of_h, "unit": "x",
         "limit": "<= 8", "result": "PASS" if of_h <= 8 else "MISS"},
        {"name": f"seed vocab: fused peak at {hi} / at {lo} tokens", "value": peak[hi] / peak[lo], "unit": "x",
         "limit": "-", "result": "info"},
        {"name": f"seed vocab: fused peak at {hi} tokens / one (chunk, V) fp32 block", "value": peak[hi] / block,
         "unit": "x", "limit": "-", "result": "info"},
    ]  # fmt: skip


def evaluate(step: dict[str, object], memory: dict[str, object]) -> list[dict[str, object]]:
    ratio = step["ratio"]
    rows = memory["rows"]
    peak = {(r["method"], r["tokens"]): r["peak_bytes"] for r in rows}
    sizes = sorted({r["tokens"] for r in rows})
    lo, hi = sizes[0], sizes[-1]
    grow = {m: (peak[m, hi] - peak[m, lo]) / (hi - lo) for m in ("fused", "full")}  # bytes per extra token
    v = memory["vocab"]
    return [
        {"name": "grpo step / plain fwd+bwd, CPU time (best)", "value": ratio["grpo"], "unit": "x", "limit": "<= 1.2",
         "result": "PASS" if ratio["grpo"] <= 1.2 else "MISS"},
        {"name": "grpo step / plain fwd+bwd, CPU time (median)", "value": step["ratio_median"]["grpo"], "unit": "x",
         "limit": "-", "result": "info"},
        {"name": "grpo step + pi_old pass / plain", "value": ratio["grpo_old"], "unit": "x", "limit": "-",
         "result": "info"},
        {"name": "grpo step + reference pass / plain", "value": ratio["grpo_ref"], "unit": "x", "limit": "-",
         "result": "info"},
        {"name": f"fused log-probs, peak at {hi} / at {lo} tokens", "value": peak["fused", hi] / peak["fused", lo],
         "unit": "x", "limit": "-", "result": "info"},
        {"name": "fused: bytes per extra token / (4 x vocab)", "value": grow["fused"] / (4 * v), "unit": "x",
         "limit": "< 0.1", "result": "PASS" if grow["fused"] < 0.1 * 4 * v else "MISS"},
        {"name": "full logits: bytes per extra token / (4 x vocab)", "value": grow["full"] / (4 * v), "unit": "x",
         "limit": "-", "result": "info"},
        {"name": f"full / fused peak at {hi} tokens", "value": peak["full", hi] / peak["fused", hi], "unit": "x",
         "limit": "-", "result": "info"},
    ]  # fmt: skip


def tables(
    step: dict[str, object],
    memory: dict[str, object],
    seed: dict[str, object],
    verdicts: list[dict[str, object]],
    attn: dict[str, object],
) -> list[tuple]:
    labels = {
        "plain": "plain forward+backward (full logits, CE)",
        "grpo": "grpo step (first of a run)",
        "grpo_old": "grpo step + pi_old pass (later steps)",
        "grpo_ref": "grpo step + reference pass (KL)",
    }
    s = [
        [
            labels[k],
            f"{step['best_s'][k]:.3f}",
            f"{step['median_s'][k]:.3f}",
            f"{step['tokens_per_s'][k]:.0f}",
            f"{step['ratio'][k]:.2f}x",
            f"{step['ratio_median'][k]:.2f}x",
        ]
        for k in labels
    ]
    by = {(r["method"], r["tokens"]): r["peak_bytes"] for r in memory["rows"]}
    sizes = sorted({r["tokens"] for r in memory["rows"]})
    m = [
        [
            str(t),
            f"{by['fused', t] / 2**20:.0f}",
            f"{by['full', t] / 2**20:.0f}",
            f"{t * memory['vocab'] * 4 / 2**20:.0f}",
        ]
        for t in sizes
    ]
    sv = [
        [str(r["tokens"]), f"{r['peak_bytes'] / 2**20:.0f}", f"{r['seconds']:.1f}",
         f"{r['tokens'] * seed['vocab'] * 4 / 2**20:,.0f}"]
        for r in seed["rows"]
    ]  # fmt: skip
    v = [[str(r["name"]), f"{r['value']:.3g}{r['unit']}", str(r["limit"]), str(r["result"])] for r in verdicts]
    best = attn["best_s"]
    base = best["float32 sdpa"]
    a = [[name, f"{t:.2f}", f"{base / t:.2f}x"] for name, t in best.items()]
    return [
        (["step", "best CPU s", "median CPU s", "tokens/s (best)", "vs plain (best)", "vs plain (median)"], s),
        (["tokens", "fused (chunk 512) peak MiB", "full-logits peak MiB", "one T x V fp32 tensor MiB"], m),
        (["tokens (vocab 248,320)", "fused (chunk 512) peak MiB", "s", "one T x V fp32 tensor MiB"], sv),
        (["target", "measured", "limit", "result"], v),
        (["packed 2 x 1800, fwd+bwd (dtype, attention)", "best wall s", "speed vs fp32 sdpa"], a),
    ]


def notes(
    cfg: Config, step: dict[str, object], memory: dict[str, object], seed: dict[str, object], elapsed: float
) -> list[str]:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return [
        (
            f"{when}, {'quick' if cfg.quick else 'full'} run ({elapsed:.0f} s), {cpu_name()} ({platform.machine()}) "
            f"with {cpus} CPUs "
            f"(shared); Python {platform.python_version()}, torch {torch.__version__}, transformers "
            f"{version('transformers')}, peft {version('peft')}; {step['threads']} torch thread(s) for the steps."
        ),
        (
            f"Steps: random Qwen3 (hidden 256, 4 layers, vocab 8192, tied), LoRA r 16 on all linear layers, gradient "
            f"checkpointing, {step['tokens_per_step']} tokens per step in 2 packed micro-batches, every response token "
            f"trained; CPU time, best and median of {step['rounds']} rotating rounds after a warm-up."
        ),
        (
            f"Memory: log-probs + loss + backward from (T, {memory['hidden']}) hidden states, vocab {memory['vocab']}, "
            f"chunk {memory['chunk']}, frozen output layer; peak resident memory above the level before the call, fresh "
            "process each."
        ),
        (
            f"Seed vocabulary: the fused path alone at vocab {seed['vocab']:,} (Qwen3.5), (T, {seed['hidden']}) hidden "
            f"states, chunk {seed['chunk']}, same method; a (chunk, V) fp32 block is "
            f"{seed['chunk'] * seed['vocab'] * 4 / 2**20:.0f} MiB, and the peak is a few of them plus what grows with "
            "T x H. Full logits are not run: one fp32 copy is 30 GiB at 32k tokens (18.5 GiB at Qwen3's 151,936)."
        ),
        (
            "Measure on a GPU (tests/bench/gpu.py): bf16 + flash-attention step time, a whole 32k-token micro-batch "
            "against torch.cuda max_memory_allocated, and multi-GPU scaling (DDP, FSDP, DeepSpeed)."
        ),
    ]


def main(cfg: Config) -> int:
    console = Console() if sys.stdout.isatty() else Console(width=130)
    t0 = time.monotonic()
    console.print("[bold]1. training step vs plain forward+backward[/]")
    step = step_benchmark(cfg, console)
    console.print("[bold]2. log-prob memory, fused chunks vs full logits[/]")
    memory = memory_benchmark(cfg, console)
    console.print(f"[bold]3. fused log-prob memory at the seed's vocabulary ({SEED_VOCAB:,})[/]")
    seed = seed_vocab_memory(cfg, console)
    console.print("[bold]4. packed attention (span backend vs sdpa mask), fp32 and bf16[/]")
    attn = attention_benchmark(cfg, console)
    verdicts = evaluate(step, memory) + seed_vocab_targets(seed)
    note_lines = notes(cfg, step, memory, seed, time.monotonic() - t0)
    out = cfg.out if cfg.out.is_absolute() else ROOT / cfg.out
    data = {"step": step, "memory": memory, "seed_vocab_memory": seed, "attention": attn, "targets": verdicts}
    report.write_results(console, out, cfg, tables(step, memory, seed, verdicts, attn), note_lines, data)
    console.print(f"wrote {out} and {out.with_suffix('.json')} in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Config)))
