"""``python -m eval demo --resume RUN`` after ``kill -9``: the demo on the tiny model (tests/eval/demo/test_demo.py's
fast flags: scripted replies, so each stage's tokens are the same in any run) is killed with SIGKILL while it trains
SFT, with the trainer it started left behind, as a killed shell leaves it (suspended as it starts, so that it is
certainly unfinished), and a partial adapter folder. The resumed run stops that trainer, keeps the finished teacher
phase (its files untouched), moves the unfinished phase's partial adapter aside, and ends with the adapters of an
uninterrupted run of the same seed."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from tests.eval.demo.test_demo import DEMO_TIMEOUT, ROOT, demo_command, fast_demo_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(DEMO_TIMEOUT)]


def running_in(run: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(str(run) in word for word in proc.info["cmdline"] or ()):
            found.append(proc)
    return [p for p in found if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def stop_sft(demo: subprocess.Popen, parent: Path, log: Path) -> tuple[Path, list[psutil.Process]]:
    """The run folder and its SFT trainer's processes, stopped (SIGSTOP) as soon as they start: so they are
    certainly still there, unfinished, when the demo is killed, as a trainer mid-step would be."""
    deadline = time.monotonic() + DEMO_TIMEOUT / 2
    while time.monotonic() < deadline:
        assert demo.poll() is None, log.read_text()[-4000:]
        for config in parent.glob("*/config.json"):
            trainer = [p for p in running_in(config.parent) if any("sft.py" in w for w in p.cmdline())]
            for proc in trainer:
                proc.suspend()
            if trainer:
                return config.parent, trainer
        time.sleep(0.05)
    raise AssertionError("the demo never reached its SFT phase")


def adapter_difference(a: Path, b: Path) -> float:
    """The largest difference between two adapters' tensors, relative to the largest value of each tensor."""
    left, right = load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")
    assert left.keys() == right.keys()
    return max(float((left[k] - right[k]).abs().max() / right[k].abs().max().clamp(min=1e-12)) for k in left)


def test_a_killed_demo_resumes_from_its_unfinished_phase_and_ends_as_an_uninterrupted_one(
    run_once, tiny_model_dir, tmp_path
):
    whole = fast_demo_run(run_once, tiny_model_dir)

    command = demo_command(tiny_model_dir, tmp_path)
    log = tmp_path / "first-attempt.log"  # a file, not a pipe: what the demo leaves behind holds its output open
    with log.open("w") as out:
        demo = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    run, trainer = stop_sft(demo, tmp_path / "runs", log)
    teacher = {p: p.read_bytes() for p in (run / "teacher").rglob("*") if p.is_file()}
    teacher_marker = (run / ".done" / "teacher.json").read_text()
    os.killpg(demo.pid, signal.SIGKILL)  # the demo alone: its phases run in sessions of their own
    demo.wait(timeout=60)
    assert all(p.is_running() for p in trainer)  # what a kill -9 leaves: the phase's processes
    assert not (run / ".done" / "train-sft.json").exists()
    (run / "adapters" / "sft").mkdir(parents=True, exist_ok=True)
    (run / "adapters" / "sft" / "config.yaml").write_text("partial\n")  # as a trainer leaves it at its start

    resumed = subprocess.run(
        [*command, "--resume", str(run)], cwd=ROOT, capture_output=True, text=True, timeout=DEMO_TIMEOUT
    )
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    assert "process(es) an earlier attempt left running" in resumed.stdout
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in trainer)
    assert "teacher: finished by an earlier attempt" in resumed.stdout
    assert {p: p.read_bytes() for p in (run / "teacher").rglob("*") if p.is_file()} == teacher
    assert (run / ".done" / "teacher.json").read_text() == teacher_marker
    assert (run / "attempts" / "1" / "adapters" / "sft" / "config.yaml").read_text() == "partial\n"  # aside
    summary = json.loads((run / "summary.json").read_text())
    assert [p["phase"] for p in summary["phases"]] == [p["phase"] for p in json.loads(
        (whole / "summary.json").read_text())["phases"]]  # fmt: skip
    # SFT reads tokens only, the same in both runs: the same adapter, bit for bit. GRPO also reads the log-probs the
    # server sent, which differ by about 1e-6 between any two runs (its batches form differently), and its first Adam
    # steps scale tiny gradients up: measured 1.7e-3 of a tensor's largest value at most. An adapter trained from
    # the wrong start or on another attempt's draws differs by its whole size.
    assert adapter_difference(run / "adapters" / "sft", whole / "adapters" / "sft") == 0
    assert adapter_difference(run / "adapters" / "grpo1", whole / "adapters" / "grpo1") < 1e-2
    assert running_in(run) == []

    again = subprocess.run(
        [*command[:-2], "--out", str(tmp_path / "other"), "--samples", "3", "--resume", str(run)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert again.returncode != 0 and "resume with the flags it ran with (--samples 4 there, 3 here)" in again.stderr
