"""The entrypoint as users run it: ``accelerate launch`` with the shipped CPU config, and two processes (DDP over
gloo) that must reach the same adapter as one: weights are global, so the data split must not change the maths."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tests.train.helpers import groups, write

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_accelerate_launch_and_two_processes_agree(tmp_path, tiny_model_dir):
    # 1 group per step (4, 3 and 2 sessions) over 2 processes: one rank runs a padding pass in some steps.
    rows = groups({"a": [1, 0, 0, 1], "b": [0, 1, 0.5], "c": [1, 0]}, traces=2)
    trajectories = write(tmp_path / "t.parquet", rows)
    args = [
        "train/grpo.py",
        "--trajectories",
        str(trajectories),
        "--model",
        str(tiny_model_dir),
        "--groups-per-step",
        "1",
        "--max-len",
        "32",
        "--micro-batch-tokens",
        "32",
        "--lr",
        "0.01",
        "--lora-r",
        "4",
        "--save-every",
        "0",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    bin_dir = Path(sys.executable).parent
    one = subprocess.run(
        [
            str(bin_dir / "accelerate"),
            "launch",
            "--config_file",
            "train/configs/cpu.yaml",
            "--num_cpu_threads_per_process",
            "1",
            *args,
            "--output",
            str(tmp_path / "one"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            *args,
            "--output",
            str(tmp_path / "two"),
        ],
        cwd=ROOT,
        env={**env, "ACCELERATE_USE_CPU": "true"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert "on 2 process(es)" in two.stdout

    a = safetensors.torch.load_file(tmp_path / "one" / "adapter_model.safetensors")
    b = safetensors.torch.load_file(tmp_path / "two" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5)
    for run in ("one", "two"):
        steps = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        assert [s["step"] for s in steps] == [0, 1, 2, 3]
