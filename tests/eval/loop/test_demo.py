"""python -m eval loop's cpu preset (make demo) end to end on the tiny model: the run folder it writes, the summary's
numbers against those files, learning measured through the whole loop, and a Ctrl-C that leaves no process behind.

The reference server replays a script per session so that rewards differ within the trained task's group: in
samples 0 and 2 the bash call fixes the bug, the other samples answer that they cannot. Replies are teacher-forced,
so each stage's captures hold the served policy's log-probs of the same tokens: GRPO must raise those of the
rewarded reply and lower those of the unrewarded one, as the next stage's captures show.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl
import psutil
import pytest

from eval.errors import EvalError
from eval.loop import report as demo_report
from eval.loop import run as loop
from eval.loop.config import load, preset
from eval.runs import read_rewards, read_sessions
from reconstruct import schema
from tests.captures import v1_lines

ROOT = Path(__file__).resolve().parents[3]
TASK, HELDOUT, TEACH = "polar-toy__retries-1", "polar-toy__units-1", "polar-toy__greeting-1"
SAMPLES, HELDOUT_SAMPLES, OTHER_HELDOUT_SAMPLES = 4, 2, 1  # held-out: SFT and grpo1, base
FIX = [
    {
        "content": None,
        "tool_calls": [{"name": "bash", "arguments": {"command": "sed -i 's/= 3/= 5/' client/policy.py"}}],
    },
    {"content": "The retry limit is now 5.", "tool_calls": []},
]
GIVE_UP = [{"content": "I cannot fix this.", "tool_calls": []}]
SCRIPT = {"*retries-1-[02]": FIX, "*": GIVE_UP}
STAGES = ["base", "sft", "grpo1"]
# The first test of a worker runs the whole loop (about 90 s alone, several times that beside the other tests).
DEMO_TIMEOUT = 1200


FAST = {  # the cpu preset's keys this test changes: one toy task of each kind, scripted replies, one round
    "harness": "mini",  # the script's replies are mini's commands (tests/eval/loop/test_demo_pi.py runs Pi)
    "teach": [TEACH],
    "tasks": [TASK],
    "heldout": [HELDOUT],
    "samples": SAMPLES,
    "heldout_samples": HELDOUT_SAMPLES,
    "other_heldout_samples": OTHER_HELDOUT_SAMPLES,
    "groups": 1,  # dynamic sampling, as by default: the first batch (FIX on two of four samples) is enough
    "pool": [TASK],
    "rounds": 1,
    "sft_steps": 2,
    "sft_lr": 0.01,
    "lr": 0.005,
    "grpo_steps": 1,
    "max_tokens": "none",
    "threads": 1,
}


def sets(**keys: object) -> list[str]:
    """``--set KEY=VALUE`` words, each VALUE as TOML writes it."""
    return [w for k, v in keys.items() for w in ("--set", f"{k}={json.dumps(v)}")]


def demo_command(model: Path, tmp: Path) -> list[str]:
    """python -m eval loop with the cpu preset (make demo's) and FAST on the tiny model, runs under tmp/runs/."""
    script = tmp / "script.json"
    script.write_text(json.dumps(SCRIPT))
    keys = {**FAST, "model": str(model), "script": str(script), "out": str(tmp / "runs" / "{time}")}
    return [sys.executable, "-m", "eval", "loop", "cpu", *sets(**keys)]


def fast_demo_run(run_once, model: Path) -> Path:
    """The run folder of one fast demo, made once per test run (tests/test_notebooks.py reads it too)."""

    def run(base: Path) -> None:
        done = subprocess.run(demo_command(model, base), check=False, cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        (base / "stdout.txt").write_text(done.stdout)

    return next(run_once("fast-demo", run).glob("runs/*/summary.json")).parent


@pytest.fixture(scope="session")
def demo_run(run_once, tiny_model_dir) -> Path:
    return fast_demo_run(run_once, tiny_model_dir)


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in v1_lines(folder)]


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT)
def test_demo_writes_the_run_folder_and_its_summary_agrees_with_the_files(demo_run):
    run = demo_run
    for path in (
        "summary.json",
        "config.json",
        "report.html",
        "logs/server.log",
        "logs/teacher-server.log",
        "teacher-script.json",
        "tasks.jsonl",
        "teacher/trajectories.parquet",
        "adapters/sft/adapter_model.safetensors",
        "adapters/sft/metrics.jsonl",
        "adapters/grpo1/adapter_config.json",
        "adapters/grpo1/metrics.jsonl",
        *(f"{s}/trajectories.parquet" for s in STAGES),
        *(f"{s}-heldout/rewards.parquet" for s in STAGES),
        *(f"{s}-heldout/trajectories.parquet" for s in STAGES),
        *(f"logs/mitmdump-{s}.log" for s in STAGES),
    ):
        assert (run / path).is_file(), path
    summary = json.loads((run / "summary.json").read_text())
    assert summary == {**summary, **demo_report.summary(run)}  # the numbers written are the files' numbers
    assert summary["order"] == STAGES

    # The teacher session: the worked fix replayed through the harness and the proxy, resolved, trained on by SFT.
    teacher = summary["stages"]["teacher"]
    assert (teacher["resolved"], teacher["graded"]) == (1, 1)
    assert summary["train"]["sft"]["steps"] == 2 and summary["train"]["sft"]["sessions"] == 1

    for stage in STAGES:
        numbers = summary["stages"][stage]
        sessions, rewards = read_sessions(run / stage), read_rewards(run / stage)
        traces = schema.read(demo_report.trajectories_path(run, stage))
        assert numbers["graded"] == sessions.height == rewards.height == traces.height == SAMPLES
        captured = records(run / "captures" / stage)
        assert numbers["calls_captured"] == len(captured) == 2 * 2 + 1 * 2  # FIX: 2 calls, GIVE_UP: 1
        model = Path(summary["model"]).name if stage == "base" else stage
        assert {r["request"]["model"] for r in captured} == {model} == set(sessions["model"])
        resolved = rewards.filter(pl.col("resolved")).sort("sample_id")["sample_id"].to_list()
        assert resolved == [0, 2] and numbers["pass_rate"] == 0.5 and numbers["ci95"][0] < 0.5 < numbers["ci95"][1]
        heldout_samples = OTHER_HELDOUT_SAMPLES if stage == "base" else HELDOUT_SAMPLES
        assert numbers["heldout"]["graded"] == heldout_samples and numbers["heldout"]["resolved"] == 0
        # The held-out sessions are reconstructed too: their stats stand apart from the trained tasks'.
        assert numbers["heldout"]["calls_captured"] == numbers["heldout"]["traces"] == heldout_samples  # GIVE_UP
        assert 0 < numbers["heldout"]["prompt_tokens_mean"] <= numbers["heldout"]["prompt_tokens_max"]
        assert dict(zip(traces["session_id"], traces["reward"], strict=True)) == dict(
            zip(rewards["session_id"], rewards["reward"], strict=True)
        )

    grpo = summary["train"]["grpo1"]
    assert grpo["steps"] == 1 and grpo["groups_with_signal"] == grpo["groups"] == 1
    gain = next(t for t in summary["tests"] if t["to"] == "grpo1" and t["from"] == "sft")
    assert gain["split"] == "trained" and gain["ci95_delta"][0] <= 0 <= gain["ci95_delta"][1]
    heldout_tests = {(t["from"], t["to"]) for t in summary["tests"] if t["split"] == "held-out"}
    assert heldout_tests == {("base", "sft"), ("sft", "grpo1"), ("base", "grpo1")}
    assert "On held-out tasks, GRPO's own gain" in summary["note"]
    assert gain["p_value"] == pytest.approx(1.0) and gain["verdict"].startswith(
        "no significant change"
    )  # replayed: same counts
    assert "GRPO's own gain" in summary["note"] and "Held-out tasks" in summary["note"]
    report = (run / "report.html").read_text()
    assert report.count("<svg") == 1 + 2 and "accelerate launch" in report and "95 % interval" in report

    # The summary phase reruns alone too, and recounts the same numbers.
    subprocess.run([sys.executable, "-m", "eval", "loop-report", str(run)], cwd=ROOT, check=True, capture_output=True)
    assert json.loads((run / "summary.json").read_text()) == summary


def sampled(run: Path, stage: str, rewarded: bool) -> list[tuple[int, float]]:
    """(token id, captured log-prob) of every sampled token of a stage's rewarded (or unrewarded) sessions."""
    traces = schema.read(demo_report.trajectories_path(run, stage)).filter(pl.col("reward") == float(rewarded))
    return [
        (t, lp)
        for ids, lps, mask in zip(traces["response_ids"], traces["logprobs"], traces["loss_mask"], strict=True)
        for t, lp, m in zip(ids, lps, mask, strict=True)
        if m
    ]


def mean_logprob(run: Path, stage: str, rewarded: bool) -> float:
    """Mean captured log-prob of the sampled tokens of a stage's rewarded (or unrewarded) sessions, leaving out
    the tokens both replies share (the end-of-turn marker): GRPO pushes those up and down at once."""
    shared = {t for t, _ in sampled(run, stage, True)} & {t for t, _ in sampled(run, stage, False)}
    return float(np.mean([lp for t, lp in sampled(run, stage, rewarded) if t not in shared]))


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT)
def test_the_loop_learns_the_rewarded_reply(demo_run):
    """The same replies, served by the SFT adapter and then by the GRPO adapter trained on the SFT stage's
    rewards: the policy now gives the rewarded reply more probability and the unrewarded one less."""
    rewarded = {s: mean_logprob(demo_run, s, True) for s in ("base", "sft", "grpo1")}
    unrewarded = {s: mean_logprob(demo_run, s, False) for s in ("sft", "grpo1")}
    assert rewarded["grpo1"] > rewarded["sft"] + 0.02
    assert unrewarded["grpo1"] < unrewarded["sft"] - 0.2
    assert rewarded["grpo1"] - unrewarded["grpo1"] > rewarded["sft"] - unrewarded["sft"] + 0.2  # the preference
    # SFT taught the teacher's tool-call form: the base gave it less probability than the SFT adapter does.
    assert rewarded["sft"] > rewarded["base"] + 0.02


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT)
def test_reuse_copies_the_teacher_and_base_stage_only_from_a_run_with_the_same_inputs(demo_run, tmp_path):
    saved = json.loads((demo_run / "config.json").read_text())
    model = saved["model"]
    keys = {**FAST, "model": model, "script": saved["config"]["script"]}  # the script the run replayed, not a copy
    same = load(preset("cpu"), sets(**{**keys, "reuse": str(demo_run), "rounds": 3, "lr": 1e-4})[1::2])
    run = tmp_path / "run"
    wrote = loop.reuse_phases(demo_run, run, same, model)  # the same SFT settings: the SFT stage comes too
    assert wrote == [*(run / f for f in (*loop.REUSED, *loop.REUSED_SFT)), run / "adapters" / "sft"]
    copied = (*loop.REUSED, *loop.REUSED_SFT, "adapters/sft")
    for path in (*copied, *(f"captures/{f}" for f in (*loop.REUSED, *loop.REUSED_SFT))):
        theirs = contents(demo_run / path)
        assert theirs and contents(run / path) == theirs, path
    for key in ("train-sft", "sft"):  # the markers, which a resumed run keeps, say where they came from
        marker = json.loads((run / ".done" / f"{key}.json").read_text())
        assert marker == {**json.loads((demo_run / ".done" / f"{key}.json").read_text()), "copied_from": str(demo_run)}
    assert sorted(p.name for p in (run / ".done").iterdir()) == ["sft.json", "train-sft.json"]

    other_sft = load(preset("cpu"), sets(**{**keys, "reuse": str(demo_run), "sft_steps": 9})[1::2])
    wrote = loop.reuse_phases(demo_run, tmp_path / "other-sft", other_sft, model)
    assert wrote == [tmp_path / "other-sft" / f for f in loop.REUSED]  # the SFT stage depends on SFT's settings
    assert not (tmp_path / "other-sft" / "sft").exists() and not (tmp_path / "other-sft" / ".done").exists()

    other_seed = load(preset("cpu"), sets(**{**keys, "seed": 1})[1::2])
    with pytest.raises(EvalError, match=r"not the same seed as"):
        loop.reuse_phases(demo_run, tmp_path / "seed1", other_seed, model)
    with pytest.raises(EvalError, match=r"not the same model as"):
        loop.reuse_phases(demo_run, tmp_path / "other-model", same, str(tmp_path))
    assert not (tmp_path / "seed1").exists() and not (tmp_path / "other-model").exists()


def contents(path: Path) -> dict[Path, bytes]:
    """A file's bytes, or a folder's files' by their paths within it."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return {p.relative_to(path): p.read_bytes() for p in files}


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def command_line(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:  # it ended since it was listed
        return ""


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT)
@pytest.mark.parametrize(
    ("signum", "group", "status", "said"),
    [
        (signal.SIGINT, True, 130, "interrupted"),  # a terminal's Ctrl-C: the foreground job's whole group
        (signal.SIGTERM, False, 143, "terminated"),  # kill PID, as a scheduler stops a job: the loop alone
    ],
)
def test_ctrl_c_or_sigterm_stops_every_phase_and_service(tiny_model_dir, tmp_path, signum, group, status, said):
    demo = subprocess.Popen(
        demo_command(tiny_model_dir, tmp_path),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    # Interrupted in its first rollout (the teacher's): a server, a proxy and the rollout's processes are running
    # then, as in every later rollout, and waiting for a later one would only add the SFT phase's minute.
    deadline = time.monotonic() + DEMO_TIMEOUT / 2
    running: list[psutil.Process] = []
    while time.monotonic() < deadline:
        assert demo.poll() is None, demo.stdout.read()
        running = descendants(demo.pid)
        commands = [command_line(p) for p in running]
        if all(any(name in c for c in commands) for name in ("eval rollout", "eval serve", "mitmdump")):
            break
        time.sleep(0.2)
    commands = [command_line(p) for p in running]
    assert any("eval rollout" in c for c in commands), commands  # the rollout is under way
    if group:
        os.killpg(demo.pid, signum)
    else:
        os.kill(demo.pid, signum)
    out, _ = demo.communicate(timeout=60)
    assert demo.returncode == status, out[-3000:]
    assert f"{said}: the phases and services were stopped; the same command resumes" in out
    time.sleep(1)
    assert [p for p in running if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
