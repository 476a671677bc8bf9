"""eval/demo.py end to end on the tiny model: the run folder it writes, the summary's numbers against those files,
and a Ctrl-C that leaves no process behind.

The reference server replays a script so that rewards differ within the task's group and GRPO takes real steps:
each session reads the file, then its bash call fixes the bug only in the checkouts of samples 0 and 2 (the
checkout's folder ends with the session id, whose last part is the sample), then answers.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import psutil
import pytest

from eval import demo_report
from eval.runs import read_rewards, read_sessions
from reconstruct import schema

ROOT = Path(__file__).resolve().parents[2]
TASK = "polar-toy__pager-1"
SAMPLES = 4
FIX = "sed -i 's|return total // per_page|return (total + per_page - 1) // per_page|' pager/paging.py"
SCRIPT = [
    {"content": None, "reasoning": "Read the code first.",
     "tool_calls": [{"name": "bash", "arguments": {"command": "cat pager/paging.py"}}]},
    {"content": "Fixing page_count.",
     "tool_calls": [{"name": "bash", "arguments": {"command": f"case $PWD in *[02]/repo) {FIX};; esac"}}]},
    {"content": "page_count now counts the last, partial page.", "tool_calls": []},
]  # fmt: skip
CALLS_PER_SESSION = len(SCRIPT)


def demo_command(model: Path, tmp: Path) -> list[str]:
    script = tmp / "script.json"
    script.write_text(json.dumps(SCRIPT))
    return [sys.executable, "-m", "eval.demo", "--model", str(model), "--script", str(script), "--tasks", TASK,
            "--samples", str(SAMPLES), "--steps", "2", "--max-tokens", "None", "--out", str(tmp / "runs")]  # fmt: skip


def fast_demo_run(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Path:
    """The run folder of one fast demo, made once per test session (tests/test_notebooks.py reads it too)."""
    base = tmp_path_factory.getbasetemp() / "fast-demo"
    finished = sorted(base.glob("runs/*/summary.json"))
    if finished:
        return finished[0].parent
    base.mkdir(exist_ok=True)
    done = subprocess.run(demo_command(model, base), check=False, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (base / "stdout.txt").write_text(done.stdout)
    return next(base.glob("runs/*/summary.json")).parent


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory, tiny_model_dir) -> Path:
    return fast_demo_run(tmp_path_factory, tiny_model_dir)


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.read_text().splitlines() if line]


@pytest.mark.slow
def test_demo_writes_the_run_folder_and_its_summary_agrees_with_the_files(demo_run):
    run = demo_run
    for path in ("summary.json", "report.html", "logs/server.log", "logs/mitmdump-before.log", "logs/mitmdump-after.log",
                 "trajectories.parquet", "trajectories.stats.json", "trajectories.after.parquet",
                 "adapter/adapter_config.json", "adapter/adapter_model.safetensors", "adapter/config.yaml",
                 "adapter/metrics.jsonl", "before/tasks.jsonl", "after/tasks.jsonl"):  # fmt: skip
        assert (run / path).is_file(), path
    summary = json.loads((run / "summary.json").read_text())
    assert summary == {**summary, **demo_report.summary(run)}  # the numbers written are the files' numbers

    for phase, model in (("before", Path(summary["model"]).name), ("after", demo_report.ADAPTER_NAME)):
        numbers, captured = summary[phase], records(run / "captures" / phase)
        sessions, rewards = read_sessions(run / phase), read_rewards(run / phase)
        traces = schema.read(demo_report.trajectories_path(run, phase))
        assert numbers["sessions"] == sessions.height == rewards.height == SAMPLES
        assert numbers["calls_captured"] == len(captured) == SAMPLES * CALLS_PER_SESSION
        assert {r["request"]["model"] for r in captured} == {model} == set(sessions["model"])
        # Every call of a session merges into one trace, and every trace got its session's reward.
        assert numbers["traces"] == traces.height == SAMPLES
        assert numbers["calls_per_trace_max"] == CALLS_PER_SESSION
        assert numbers["rewarded_traces"] == traces.filter(pl.col("reward").is_not_null()).height == SAMPLES
        assert numbers["tokens_trainable"] == traces["loss_mask"].list.sum().sum() > 0
        # Samples 0 and 2 fixed the bug: resolved, the others left no edit.
        resolved = rewards.filter(pl.col("resolved")).sort("sample_id")["sample_id"].to_list()
        assert resolved == [0, 2] and numbers["resolved"] == 2 and numbers["pass_rate"] == 0.5
        assert dict(zip(traces["session_id"], traces["reward"])) == dict(zip(rewards["session_id"], rewards["reward"]))

    metrics = [json.loads(line) for line in (run / "adapter/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2] and summary["train"]["steps"] == 2
    assert summary["train"]["groups_with_signal"] == summary["train"]["groups"] == 1
    assert "GRPO ran 2 step(s)" in summary["note"]
    assert [p["phase"] for p in summary["phases"] if p["commands"]] == [
        "rollout before", "grade, reconstruct, join (before)", "train: GRPO on a LoRA adapter", "serve the adapter",
        "rollout after", "grade, reconstruct, join (after)"]  # fmt: skip
    report = (run / "report.html").read_text()
    assert report.count("<svg") == 2 and "accelerate launch" in report

    # The summary phase reruns alone too, and recounts the same numbers.
    subprocess.run([sys.executable, "-m", "eval.demo_report", str(run)], cwd=ROOT, check=True, capture_output=True)
    assert json.loads((run / "summary.json").read_text()) == summary


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.slow
def test_ctrl_c_stops_every_phase_and_service(tiny_model_dir, tmp_path):
    # Its own process group, signalled as a whole: what a terminal's Ctrl-C does to a foreground job.
    demo = subprocess.Popen(demo_command(tiny_model_dir, tmp_path), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("runs/*/captures/before/*.jsonl")) and time.monotonic() < deadline:
        assert demo.poll() is None, demo.stdout.read()
        time.sleep(0.2)
    running = descendants(demo.pid)
    assert any("eval.serve" in " ".join(p.cmdline()) for p in running)  # the rollout is under way
    os.killpg(demo.pid, signal.SIGINT)
    out, _ = demo.communicate(timeout=60)
    assert demo.returncode == 130, out[-3000:]
    assert "interrupted" in out
    time.sleep(1)
    assert [p for p in running if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
