"""eval/score.py: real checkouts, real patches, real pytest runs, graded by swebench's own grading."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from eval.runs import read_rewards, write_sessions
from eval.score import Args, grade, main, sandbox_env
from eval.tasks.instances import GIT_ENV
from eval.tasks.load import checkout, load_tasks, save_tasks

ROOT = Path(__file__).resolve().parents[2]
PAGER = "polar-toy__pager-1"


@pytest.fixture(scope="module")
def toy() -> dict[str, dict]:
    return {t["instance_id"]: t for t in load_tasks("toy")}


def edited(task: dict, tmp_path: Path, path: str, old: str, new: str) -> str:
    """The diff of one text replacement in a checkout of ``task``: a patch as a harness would leave it."""
    repo = checkout(task, tmp_path / "edit")
    text = (repo / path).read_text()
    assert old in text
    (repo / path).write_text(text.replace(old, new))
    env = {**os.environ, **GIT_ENV}  # a user's diff settings (noprefix, color) must not shape the patch
    return subprocess.run(["git", "diff"], cwd=repo, env=env, capture_output=True, text=True, check=True).stdout


def test_empty_patch(toy, tmp_path):
    g = grade(toy[PAGER], " \n", timeout=60, log_dir=tmp_path)
    assert (g.reward, g.resolved, g.reason, g.report) == (0.0, False, "empty_patch", None)


def test_test_patch_alone_is_graded_unresolved(toy, tmp_path):
    g = grade(toy[PAGER], toy[PAGER]["test_patch"], timeout=60, log_dir=tmp_path)
    assert (g.resolved, g.reason) == (False, "graded")
    assert g.report["tests_status"]["FAIL_TO_PASS"]["failure"] == toy[PAGER]["FAIL_TO_PASS"]


def test_wrong_fix_breaks_a_passing_test(toy, tmp_path):
    patch = edited(toy[PAGER], tmp_path, "pager/paging.py", "return total // per_page", "return total // per_page + 1")
    g = grade(toy[PAGER], patch, timeout=60, log_dir=tmp_path / "logs")
    assert (g.reward, g.reason) == (0.0, "graded")
    assert "tests/test_paging.py::test_exact_multiple" in g.report["tests_status"]["PASS_TO_PASS"]["failure"]


def test_patch_with_stale_context_applies_with_fuzz(toy, tmp_path):
    # The gold patch against a docstring that has since changed: git apply refuses, patch --fuzz copes.
    stale = toy[PAGER]["patch"].replace('     """Number of pages needed', '     """How many pages are needed')
    assert stale != toy[PAGER]["patch"]
    g = grade(toy[PAGER], stale, timeout=60, log_dir=tmp_path)
    assert (g.resolved, g.reason) == (True, "graded")
    assert "patch --batch --forward --fuzz=5" in (tmp_path / "eval.log").read_text()


def test_sandbox_environment_keeps_no_secrets_and_names_the_interpreter(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    env = sandbox_env(tmp_path / "home")
    assert "sk-secret" not in env.values() and env["HOME"] == str(tmp_path / "home")
    assert env["PYTHON"] == sys.executable
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)


def test_garbage_patch_fails_to_apply(toy, tmp_path):
    g = grade(toy[PAGER], "this is not a diff\n", timeout=60, log_dir=tmp_path)
    assert (g.reward, g.reason, g.report) == (0.0, "patch_failed", None)
    assert ">>>>> Patch Apply Failed" in (tmp_path / "eval.log").read_text()


def test_hanging_tests_are_killed_at_the_timeout(toy, tmp_path):
    spin = "    while True:\n        pass"
    patch = edited(toy[PAGER], tmp_path, "pager/paging.py", "    return total // per_page", spin)
    start = time.monotonic()
    g = grade(toy[PAGER], patch, timeout=3, log_dir=tmp_path / "logs")
    assert (g.reward, g.reason) == (0.0, "tests_timed_out")
    assert time.monotonic() - start < 30
    assert ">>>>> Tests Timed Out" in (tmp_path / "logs" / "eval.log").read_text()


def test_instance_missing_a_field_is_an_eval_error(toy, tmp_path):
    task = {k: v for k, v in toy[PAGER].items() if k != "eval_script"}
    g = grade(task, toy[PAGER]["patch"], timeout=60, log_dir=tmp_path)
    assert (g.reward, g.reason) == (0.0, "eval_error")
    assert "'eval_script'" in (tmp_path / "eval.log").read_text()


def test_eval_script_without_test_output_is_an_eval_error(toy, tmp_path):
    task = {**toy[PAGER], "eval_script": "#!/bin/bash\necho setting up\nexit 3\n"}
    g = grade(task, toy[PAGER]["patch"], timeout=60, log_dir=tmp_path)
    assert (g.resolved, g.reason) == (False, "eval_error")
    assert g.report["patch_successfully_applied"] is False


def test_run_dir_sessions_are_graded(toy, tmp_path):
    save_tasks([toy[PAGER]], tmp_path / "tasks.jsonl")
    gold, wrong = toy[PAGER]["patch"], toy[PAGER]["test_patch"]
    sessions = [  # session_id, status, patch
        ("s-gold", "ok", gold),
        ("s-noedit", "no_edit", ""),
        ("s-crashed", "crashed", ""),
        ("s-timeout-with-patch", "timeout", gold),
        ("s-wrong", "ok", wrong),
    ]
    write_sessions(
        pl.DataFrame(
            [
                {
                    "session_id": sid,
                    "task_id": PAGER,
                    "sample_id": i,
                    "harness": "pi",
                    "model": "m",
                    "status": status,
                    "exit_code": 0,
                    "started_at": "2025-01-01T00:00:00Z",
                    "setup_s": 0.1,
                    "duration_s": 1.0,
                    "patch_s": 0.1,
                    "patch": patch,
                    "error": None if status == "ok" else "x",
                    "stdout_bytes": 10,
                    "stderr_bytes": 0,
                }
                for i, (sid, status, patch) in enumerate(sessions)
            ]
        ),
        tmp_path,
    )
    assert main(Args(run_dir=tmp_path, concurrency=2, timeout=60)) == 0
    rewards = read_rewards(tmp_path)
    assert rewards["session_id"].to_list() == sorted(sid for sid, _, _ in sessions)
    reasons = dict(zip(rewards["session_id"], zip(rewards["reason"], rewards["reward"], strict=True), strict=True))
    assert reasons == {
        "s-crashed": ("session_failed", 0.0),
        "s-gold": ("graded", 1.0),
        "s-noedit": ("empty_patch", 0.0),
        "s-timeout-with-patch": ("graded", 1.0),
        "s-wrong": ("graded", 0.0),
    }
    assert rewards["harness"].to_list() == ["pi"] * 5
    assert (tmp_path / "logs" / "s-gold" / "report.json").exists()


def test_predictions_file_and_unknown_task(toy, tmp_path):
    predictions = tmp_path / "preds.jsonl"
    predictions.write_text(
        json.dumps({"instance_id": PAGER, "model_name_or_path": "m1", "model_patch": toy[PAGER]["patch"]}) + "\n"
    )
    assert main(Args(predictions=predictions, tasks="toy", out=tmp_path / "out", timeout=60)) == 0
    rewards = read_rewards(tmp_path / "out")
    assert rewards.select("session_id", "resolved", "harness").rows() == [(f"m1/{PAGER}", True, None)]
    predictions.write_text(json.dumps({"instance_id": "nope", "model_name_or_path": "m1", "model_patch": ""}) + "\n")
    assert main(Args(predictions=predictions, tasks="toy", out=tmp_path / "out2")) == 2


def test_args_need_one_source():
    with pytest.raises(ValueError, match="RUN_DIR"):
        Args()
    with pytest.raises(ValueError, match="--tasks"):
        Args(gold=True)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "eval", "score", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "error"},
        timeout=240,
        check=False,
    )


@pytest.mark.slow
def test_gold_patch_resolves_every_task_and_a_rerun_writes_the_same_rewards(toy, tmp_path):
    first = cli("--gold", "--tasks", "toy", "--out", str(tmp_path), "--concurrency", "2")
    assert first.returncode == 0, first.stderr
    rewards = read_rewards(tmp_path)
    assert rewards["task_id"].to_list() == sorted(toy) and rewards["reason"].unique().to_list() == ["graded"]
    assert rewards["resolved"].all() and (rewards["reward"] == 1.0).all()
    assert f"resolved {len(toy)}/{len(toy)}" in first.stdout and "rewards.parquet" in first.stdout
    for iid, report in zip(rewards["task_id"], rewards["report"], strict=True):
        assert json.loads(report)["tests_status"]["FAIL_TO_PASS"]["success"] == toy[iid]["FAIL_TO_PASS"]
        assert json.loads((tmp_path / "logs" / "gold" / iid / "report.json").read_text())[iid]["resolved"]
    # The rerun in-process: the same command, without paying for a second interpreter start.
    assert main(Args(gold=True, tasks="toy", out=tmp_path, concurrency=2)) == 0
    assert_frame_equal(read_rewards(tmp_path), rewards)


@pytest.mark.slow
def test_docker_runner_without_a_daemon_says_so(tmp_path):
    if os.environ.get("DOCKER_HOST") or Path("/var/run/docker.sock").exists():
        pytest.skip("a Docker daemon may answer here")
    done = cli("--gold", "--tasks", "toy", "--out", str(tmp_path), "--runner", "docker")
    assert done.returncode == 1
    assert "--runner docker needs a running Docker daemon" in done.stderr and "--runner local" in done.stderr
    assert "Traceback" not in done.stderr
