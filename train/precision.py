"""Which dtype the base weights take: bf16 where this machine runs it faster, fp32 elsewhere.

CPUs differ: an Intel Xeon with AMX-BF16 ran a 2048 x 2048 matmul at 320 GFLOP/s in bf16 against 58 in fp32, while
MKL takes a generic (slower) bf16 path on CPUs without those units. So ``--dtype auto`` on the CPU measures a short
matmul in both dtypes at start and takes bf16 only where it is at least ``BF16_MIN_SPEEDUP`` times faster. On a GPU,
auto keeps fp32 unless accelerate runs with mixed precision bf16 (its own choice). ``--dtype`` overrides either.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

import torch

__all__ = ["BF16_MIN_SPEEDUP", "bf16_matmul_speedup", "choose_dtype", "cpu_name"]

BF16_MIN_SPEEDUP = 1.5  # below this, bf16's rounding is not worth its speed


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows elsewhere."""
    info = Path("/proc/cpuinfo")
    if info.is_file():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _matmul_seconds(dtype: torch.dtype, size: int, repeats: int) -> float:
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    a @ b  # warm-up: kernel selection, first-touch of the output
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeats):
            a @ b
        best = min(best, time.perf_counter() - t0)
    return best


def bf16_matmul_speedup(size: int = 1024, repeats: int = 4) -> float:
    """fp32 time / bf16 time of a ``size`` x ``size`` matmul on this CPU, best of 3 (about 0.1-0.5 s in all)."""
    return _matmul_seconds(torch.float32, size, repeats) / _matmul_seconds(torch.bfloat16, size, repeats)


def choose_dtype(requested: str, mixed_precision: str = "no", cuda: bool | None = None) -> tuple[torch.dtype, str]:
    """The weights' dtype for ``--dtype requested`` (auto, float32, bfloat16), and why, for the log."""
    if requested == "float32":
        return torch.float32, "--dtype float32"
    if requested == "bfloat16":
        return torch.bfloat16, "--dtype bfloat16"
    if requested != "auto":
        raise ValueError(f"--dtype must be auto, float32 or bfloat16, not {requested!r}")
    if mixed_precision == "bf16":
        return torch.bfloat16, "auto: accelerate runs with mixed precision bf16"
    if torch.cuda.is_available() if cuda is None else cuda:
        return torch.float32, "auto: a GPU without bf16 mixed precision"
    speedup = bf16_matmul_speedup()
    verdict = f"bf16 matmul {speedup:.2f}x fp32 on this CPU ({cpu_name()}), threshold {BF16_MIN_SPEEDUP}x"
    if speedup >= BF16_MIN_SPEEDUP:
        return torch.bfloat16, f"auto: {verdict}"
    return torch.float32, f"auto: {verdict}"
