"""The GPU check (tests/bench/gpu.py) at tiny size on the CPU: the code a lent GPU will run, kept working."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_runs_at_tiny_size(tmp_path):
    out = tmp_path / "gpu.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "tests.bench.gpu", "--tiny", "--out", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.with_suffix(".json").read_text())
    assert results["device"] == "cpu" and results["config"]["tiny"] is True
    runs = [results["step"]["grpo"], results["step"]["grpo_share_prefix"], results["fsdp"]["grpo"]]
    assert all(r["tokens_per_s"] > 0 and math.isfinite(r["step_s"]) for r in runs)
    # The shared prompts are computed once per micro-batch: fewer tokens through the model for the same traces.
    assert results["step"]["grpo_share_prefix"]["computed_tokens"] < results["step"]["grpo"]["computed_tokens"]
    assert [(r["method"], r["tokens"]) for r in results["memory"]] == [
        ("fused", 256), ("full", 256), ("fused", 1024), ("full", 1024)
    ]  # fmt: skip
    assert results["long"]["tokens"] == 1024 and results["long"]["seconds"] > 0
    assert "grpo --share-prefix" in out.read_text()
    # Qwen3.5: no CUDA here, so the policy pads; the packed row runs without trace bounds (and leaks, which the
    # packing check sees: padding is exact on the CPU).
    hybrid = results["qwen35"]
    assert hybrid["batching"] == "padded" and "no CUDA device" in hybrid["batching_reason"]
    assert (hybrid["packed"]["batching"], hybrid["padded"]["batching"]) == ("packed", "padded")
    assert all(hybrid[k]["tokens_per_s"] > 0 and math.isfinite(hybrid[k]["step_s"]) for k in ("packed", "padded"))
    assert {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj", "q_proj"} <= set(hybrid["lora_targets"])
    assert hybrid["check"]["padded_max_diff"] < 1e-3 < hybrid["check"]["packed_max_diff"]
    assert set(results["kernels"]) == {"fla", "causal_conv1d"}
    assert "Qwen3.5-tiny grpo padded" in out.read_text()
