"""The trainers as users launch them: ``accelerate launch`` with the shipped configs. One process (``cpu.yaml``)
against two (``ddp.yaml``, ``fsdp.yaml``: written for GPUs, run here on the CPU over gloo, see train/launch.py), each
config checked for what it is: DDP holds a replica on every rank, FSDP2 a shard. Weights are global, so the data
split must not change the maths, and a rank with less data, or none at all, runs padding passes instead of leaving
the other waiting in a collective. FSDP2's sharded checkpoint resumes to the adapter of an uninterrupted run."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from eval.sessions.procs import stop_tree
from tests.train.helpers import groups, trace, write

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT = 300  # a hang in a collective fails here; a busy 2-core box needs far less than this (~10 s)
# runtime.print_placement's line, one per rank
PLACEMENT = re.compile(r"rank (\d+) of (\d+) \((\S+), ([^,]+), cpu\): ([\d.,]+) of the model's ([\d.,]+) MiB")


def launch(config: str, processes: int, script: str, args: list[str], output: Path) -> str:
    """``accelerate launch --config_file train/configs/CONFIG`` of ``script`` in float32; its stdout."""
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", f"train/configs/{config}"]
    cmd += ["--num_processes", str(processes), "--num_cpu_threads_per_process", "1", "--mixed_precision", "no"]
    cmd += ["--main_process_port", "0", script, *args, "--dtype", "float32", "--output", str(output)]
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


def placements(stdout: str) -> dict[int, tuple[str, str, float, float]]:
    """Each rank's ``(distributed type, backend, MiB held, MiB of the whole model)``, as it printed them."""
    found = {}
    for rank, world, kind, backend, here, everywhere in PLACEMENT.findall(stdout):
        assert int(world) == len(PLACEMENT.findall(stdout))
        found[int(rank)] = (kind, backend, float(here.replace(",", "")), float(everywhere.replace(",", "")))
    return found


def assert_same_adapter(one: Path, other: Path, atol: float = 1e-5) -> None:
    a = safetensors.torch.load_file(one / "adapter_model.safetensors")
    b = safetensors.torch.load_file(other / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol)


def steps_logged(output: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (output / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def grpo_args(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> list[str]:
    # 1 group per step (4, 3 and 2 sessions) over 2 processes: one rank runs a padding pass in some steps.
    rows = groups({"a": [1, 0, 0, 1], "b": [0, 1, 0.5], "c": [1, 0]}, traces=2)
    path = write(tmp_path_factory.mktemp("grpo") / "t.parquet", rows)
    args = ["--trajectories", str(path), "--model", str(tiny_model_dir), "--groups-per-step", "1"]
    args += ["--max-len", "32", "--micro-batch-tokens", "32", "--lr", "0.01", "--lora-r", "4", "--save-every", "0"]
    return args


@pytest.fixture(scope="module")
def grpo_one(tmp_path_factory: pytest.TempPathFactory, grpo_args: list[str]) -> Path:
    """The adapter of one process (``cpu.yaml``), which every two-process launch must equal."""
    output: Path = tmp_path_factory.mktemp("grpo") / "one"
    stdout = launch("cpu.yaml", 1, "train/grpo.py", grpo_args, output)
    kind, _, here, everywhere = placements(stdout)[0]
    assert kind == "NO" and here == everywhere
    return output


@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 60)
def test_grpo_over_two_processes_with_ddp_holds_a_replica_and_equals_one(
    tmp_path: Path, grpo_args: list[str], grpo_one: Path
) -> None:
    stdout = launch("ddp.yaml", 2, "train/grpo.py", grpo_args, tmp_path / "ddp")
    ranks = placements(stdout)
    assert sorted(ranks) == [0, 1]
    for kind, backend, here, everywhere in ranks.values():
        assert (kind, backend) == ("MULTI_CPU", "gloo") and here == everywhere  # DDP: the whole model on each rank
    assert_same_adapter(grpo_one, tmp_path / "ddp")
    assert steps_logged(tmp_path / "ddp") == steps_logged(grpo_one) == [0, 1, 2, 3]


@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 60)
def test_grpo_over_two_processes_with_fsdp_holds_a_shard_and_equals_one(
    tmp_path: Path, grpo_args: list[str], grpo_one: Path
) -> None:
    stdout = launch("fsdp.yaml", 2, "train/grpo.py", grpo_args, tmp_path / "fsdp")
    ranks = placements(stdout)
    assert sorted(ranks) == [0, 1]
    for kind, backend, here, everywhere in ranks.values():
        assert (kind, backend) == ("FSDP2", "gloo")
        assert here == pytest.approx(everywhere / 2, rel=0.02)  # half of every weight (dim 0), not a replica
    assert_same_adapter(grpo_one, tmp_path / "fsdp")  # gathered from the shards: LoRA weights only, as one's
    assert steps_logged(tmp_path / "fsdp") == steps_logged(grpo_one) == [0, 1, 2, 3]


@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 60)
def test_fsdp_resumes_from_its_sharded_checkpoint_to_the_adapter_of_an_uninterrupted_run(
    tmp_path: Path, grpo_args: list[str]
) -> None:
    # Dropout, a warm-up and 3 epochs: the RNG, the schedule and the optimizer's moments must all come back.
    args = [*grpo_args, "--save-every", "2", "--epochs", "3", "--max-steps", "5", "--warmup-steps", "3"]
    args += ["--lora-dropout", "0.1"]
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    launch("fsdp.yaml", 2, "train/grpo.py", args, whole)
    checkpoint = whole / "checkpoint"  # the last one, after step 4 of 5
    assert json.loads((checkpoint / "trainer_state.json").read_text())["step"] == 4
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):  # torch.distributed.checkpoint: one file per rank
        assert sorted(p.name for p in (checkpoint / part).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    # Every weight, the frozen base's too, saved as two shards: one per rank, none gathered.
    weights = FileSystemReader(checkpoint / "pytorch_model_fsdp_0").read_metadata().state_dict_metadata
    assert weights and all(isinstance(w, TensorStorageMetadata) and len(w.chunks) == 2 for w in weights.values())

    # A run that died in step 5: its output as it was then (the metrics row of step 5 was never written).
    broken.mkdir()
    shutil.copytree(checkpoint, broken / "checkpoint")
    rows = (whole / "metrics.jsonl").read_text().splitlines()
    (broken / "metrics.jsonl").write_text("".join(r + "\n" for r in rows[:-1]))
    stdout = launch("fsdp.yaml", 2, "train/grpo.py", [*args, "--resume", str(broken / "checkpoint")], broken)
    assert "resumed from" in stdout and "after step 4" in stdout
    assert_same_adapter(whole, broken, atol=1e-6)
    assert steps_logged(broken) == steps_logged(whole) == [0, 1, 2, 3, 4, 5]


@pytest.mark.slow
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT + 60)
def test_sft_over_two_processes_equals_one_when_a_rank_has_no_trace_at_all(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    # One trace per session and one session per step: the second rank gets no trace in any step, and runs only
    # padding passes, which under FSDP2 must still make every all-gather and reduce-scatter the other rank makes.
    rows = groups({"a": [1, 1]}, prompt_len=8, response_len=8)
    args = ["--trajectories", str(write(tmp_path / "t.parquet", rows)), "--model", str(tiny_model_dir)]
    args += ["--sessions-per-step", "1", "--max-len", "32", "--micro-batch-tokens", "32", "--lr", "0.01"]
    args += ["--lora-r", "4"]
    launch("cpu.yaml", 1, "train/sft.py", args, tmp_path / "one")
    assert len(steps_logged(tmp_path / "one")) >= 2
    for config in ("ddp.yaml", "fsdp.yaml"):
        launch(config, 2, "train/sft.py", args, tmp_path / config)
        assert_same_adapter(tmp_path / "one", tmp_path / config)
        assert steps_logged(tmp_path / config) == steps_logged(tmp_path / "one")


@pytest.mark.slow
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT + 60)
def test_shared_prefix_chunks_over_two_processes_with_ddp_equal_one_and_fsdp_is_refused(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    # Each task's samples share a 14-token prompt; at 32 tokens a micro-batch the 4 tails of 10 go in 4 chunks, the
    # prefix's gradient gathered by the first three and sent by the last, all on one rank while the other runs
    # padding passes. The gathered gradient is scaled once, by the process count, as every pass's loss is.
    rows = []
    for t, (task, rewards) in enumerate({"a": [1, 0, 0, 1], "b": [0, 1, 1]}.items()):
        prompt = [(20 + 31 * t + k) % 4000 for k in range(14)]
        for i, reward in enumerate(rewards):
            own = [(500 + 17 * t + 7 * i + k) % 4000 for k in range(2)]
            response = [(900 + 11 * t + 5 * i + k) % 4000 for k in range(8)]
            rows.append(trace(session=f"{task}-{i}", task=task, prompt=prompt + own, response=response, reward=reward))
    args = ["--trajectories", str(write(tmp_path / "t.parquet", rows)), "--model", str(tiny_model_dir)]
    args += ["--groups-per-step", "1", "--max-len", "32", "--micro-batch-tokens", "32", "--lr", "0.01"]
    args += ["--lora-r", "4", "--save-every", "0", "--share-prefix"]
    launch("cpu.yaml", 1, "train/grpo.py", args, tmp_path / "one")
    assert steps_logged(tmp_path / "one") == [0, 1, 2]
    launch("ddp.yaml", 2, "train/grpo.py", args, tmp_path / "ddp")
    assert_same_adapter(tmp_path / "one", tmp_path / "ddp")
    # FSDP all-gathers each layer's weights at each decoder call: a shared-prefix pass makes two, a padding pass one
    with pytest.raises(AssertionError, match="sharded weights"):
        launch("fsdp.yaml", 2, "train/grpo.py", args, tmp_path / "fsdp")
