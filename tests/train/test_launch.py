"""The trainers as users launch them: ``accelerate launch`` with the shipped configs. One process (``cpu.yaml``)
against two (``ddp.yaml``, ``fsdp.yaml``: written for GPUs, run here on the CPU over gloo, see train/launch.py):
weights are global, so the data split must not change the maths, and a rank with less data, or none at all, runs
padding passes instead of leaving the other waiting in a collective."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from eval.procs import stop_tree
from tests.train.helpers import groups, write

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT = 300  # a hang in a collective fails here; a busy 2-core box needs far less than this (~10 s)


def launch(config: str, processes: int, script: str, args: list[str], output: Path) -> str:
    """``accelerate launch --config_file train/configs/CONFIG`` of ``script`` in float32; its stdout."""
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", f"train/configs/{config}"]
    cmd += ["--num_processes", str(processes), "--num_cpu_threads_per_process", "1", "--mixed_precision", "no"]
    cmd += ["--main_process_port", "0", script, *args, "--output", str(output)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as run:
        try:
            stdout, stderr = run.communicate(timeout=LAUNCH_TIMEOUT)
        except subprocess.TimeoutExpired:
            stop_tree(run)  # the ranks too (torchrun starts them in sessions of their own), or they outlive the test
            stdout, stderr = run.communicate()
            pytest.fail(f"accelerate launch of {script} with {config} hung for {LAUNCH_TIMEOUT} s:\n{stderr[-3000:]}")
    assert run.returncode == 0, stderr[-3000:]
    assert f"on {processes} process(es)" in stdout
    return stdout


def assert_same_adapter(one: Path, other: Path) -> None:
    a = safetensors.torch.load_file(one / "adapter_model.safetensors")
    b = safetensors.torch.load_file(other / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5)


def steps_logged(output: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (output / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT + 60)
def test_grpo_over_two_processes_with_ddp_and_fsdp_equals_one(tmp_path, tiny_model_dir):
    # 1 group per step (4, 3 and 2 sessions) over 2 processes: one rank runs a padding pass in some steps.
    rows = groups({"a": [1, 0, 0, 1], "b": [0, 1, 0.5], "c": [1, 0]}, traces=2)
    args = ["--trajectories", str(write(tmp_path / "t.parquet", rows)), "--model", str(tiny_model_dir)]
    args += ["--groups-per-step", "1", "--max-len", "32", "--micro-batch-tokens", "32", "--lr", "0.01"]
    args += ["--lora-r", "4", "--save-every", "0"]
    launch("cpu.yaml", 1, "train/grpo.py", args, tmp_path / "one")
    for config in ("ddp.yaml", "fsdp.yaml"):
        launch(config, 2, "train/grpo.py", args, tmp_path / config)
        assert_same_adapter(tmp_path / "one", tmp_path / config)
        assert steps_logged(tmp_path / config) == steps_logged(tmp_path / "one") == [0, 1, 2, 3]


@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 60)
def test_sft_over_two_processes_equals_one_when_a_rank_has_no_trace_at_all(tmp_path, tiny_model_dir):
    # One trace per session and one session per step: the second rank gets no trace in any step.
    rows = groups({"a": [1, 1]}, prompt_len=8, response_len=8)
    args = ["--trajectories", str(write(tmp_path / "t.parquet", rows)), "--model", str(tiny_model_dir)]
    args += ["--sessions-per-step", "1", "--max-len", "32", "--micro-batch-tokens", "32", "--lr", "0.01"]
    args += ["--lora-r", "4"]
    launch("cpu.yaml", 1, "train/sft.py", args, tmp_path / "one")
    launch("ddp.yaml", 2, "train/sft.py", args, tmp_path / "two")
    assert_same_adapter(tmp_path / "one", tmp_path / "two")
    assert steps_logged(tmp_path / "two") == steps_logged(tmp_path / "one")
    assert len(steps_logged(tmp_path / "one")) >= 2
