"""``python -m eval loop cpu ... --resume RUN`` after ``kill -9``: the demo's preset on the tiny model, two GRPO rounds
(tests/eval/loop/test_demo.py's fast keys: scripted replies, so each stage's tokens are the same in any run), is
killed with SIGKILL while it trains round 2, with the trainer it started left behind, as a killed shell leaves it
(suspended as it starts, so that it is certainly unfinished), and a partial adapter folder. The resumed run stops
that trainer, keeps every finished phase (their files untouched), moves the unfinished phase's partial adapter
aside, reloads round 1's adapter into a new server, and ends with the adapters of an uninterrupted run of the same
seed."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from tests.eval.loop.test_demo import DEMO_TIMEOUT, ROOT, demo_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(DEMO_TIMEOUT)]


def running_in(run: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(str(run) in word for word in proc.info["cmdline"] or ()):
            found.append(proc)
    return [p for p in found if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def stop_trainer(
    demo: subprocess.Popen, parent: Path, log: Path, output: str, timeout: float = DEMO_TIMEOUT / 2
) -> tuple[Path, list[psutil.Process]]:
    """The run folder and the processes of the trainer that writes RUN/<output>, stopped (SIGSTOP) as soon as they
    start: so they are certainly still there, unfinished, when the loop is killed, as a trainer mid-step would be."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert demo.poll() is None, log.read_text()[-4000:]
        for config in parent.glob("*/config.json"):
            trainer = [p for p in running_in(config.parent) if str(config.parent / output) in p.cmdline()]
            for proc in trainer:
                proc.suspend()
            if trainer:
                return config.parent, trainer
        time.sleep(0.05)
    raise AssertionError(f"the loop never started the trainer of {output}")


def adapter_difference(a: Path, b: Path) -> float:
    """The largest difference between two adapters' tensors, relative to the largest value of each tensor."""
    left, right = load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")
    assert left.keys() == right.keys()
    return max(float((left[k] - right[k]).abs().max() / right[k].abs().max().clamp(min=1e-12)) for k in left)


def test_a_loop_killed_in_round_2s_training_resumes_there_and_ends_as_an_uninterrupted_one(tiny_model_dir, tmp_path):
    command = [*demo_command(tiny_model_dir, tmp_path), "--set", "rounds=2"]
    whole = subprocess.run(
        [*command, "--set", f"out={tmp_path / 'whole' / '{time}'}"], cwd=ROOT, capture_output=True, text=True
    )
    assert whole.returncode == 0, whole.stdout[-4000:] + whole.stderr[-4000:]
    (uninterrupted,) = (tmp_path / "whole").iterdir()

    log = tmp_path / "first-attempt.log"  # a file, not a pipe: what the loop leaves behind holds its output open
    with log.open("w") as out:
        loop = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    run, trainer = stop_trainer(loop, tmp_path / "runs", log, "adapters/grpo2")
    finished = ("teacher", "train-sft", "base", "sft", "train-grpo1", "grpo1")
    markers = {key: (run / ".done" / f"{key}.json").read_text() for key in finished}
    kept = {p: p.read_bytes() for f in ("teacher", "sft", "grpo1", "adapters/grpo1") for p in (run / f).rglob("*")
            if p.is_file()}  # fmt: skip
    os.killpg(loop.pid, signal.SIGKILL)  # the loop alone: its phases run in sessions of their own
    loop.wait(timeout=60)
    assert all(p.is_running() for p in trainer)  # what a kill -9 leaves: the phase's processes
    assert not (run / ".done" / "train-grpo2.json").exists()
    (run / "adapters" / "grpo2").mkdir(parents=True, exist_ok=True)
    (run / "adapters" / "grpo2" / "config.yaml").write_text("partial\n")  # as a trainer leaves it at its start

    resumed = subprocess.run(
        [*command, "--resume", str(run)], cwd=ROOT, capture_output=True, text=True, timeout=DEMO_TIMEOUT
    )
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    assert "process(es) an earlier attempt left running" in resumed.stdout
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in trainer)
    for key in finished:
        assert f"{key}: finished by an earlier attempt" in resumed.stdout
        assert (run / ".done" / f"{key}.json").read_text() == markers[key]
    assert {p: p.read_bytes() for p in kept} == kept
    assert (run / "attempts" / "1" / "adapters" / "grpo2" / "config.yaml").read_text() == "partial\n"  # aside
    summary = json.loads((run / "summary.json").read_text())
    assert summary["order"] == ["base", "sft", "grpo1", "grpo2"]
    assert [p["phase"] for p in summary["phases"]] == [p["phase"] for p in json.loads(
        (uninterrupted / "summary.json").read_text())["phases"]]  # fmt: skip
    # The resumed server started without adapters: round 1's was loaded again before round 2 drew with it, and the
    # round-2 stage rolled out with round 2's (its rewards are the uninterrupted run's).
    assert summary["stages"]["grpo2"]["per_task"] == json.loads((uninterrupted / "summary.json").read_text())[
        "stages"]["grpo2"]["per_task"]  # fmt: skip
    # SFT reads tokens only, the same in both runs: the same adapter, bit for bit. GRPO also reads the log-probs the
    # server sent, which differ by about 1e-6 between any two runs (its batches form differently), and its first Adam
    # steps scale tiny gradients up: measured 1.7e-3 of a tensor's largest value at most. An adapter trained from
    # the wrong start or on another attempt's draws differs by its whole size.
    assert adapter_difference(run / "adapters" / "sft", uninterrupted / "adapters" / "sft") == 0
    for adapter in ("grpo1", "grpo2"):
        assert adapter_difference(run / "adapters" / adapter, uninterrupted / "adapters" / adapter) < 1e-2, adapter
    assert running_in(run) == []

    again = subprocess.run(
        [*command, "--set", f"out={tmp_path / 'other'}", "--set", "samples=3", "--resume", str(run)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert again.returncode != 0 and "resume it with the config it ran with (samples 4 there, 3 here)" in again.stderr
