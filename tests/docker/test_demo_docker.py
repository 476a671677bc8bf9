"""The entry points that start rollouts, with ``--runtime docker`` on a real daemon: the demo's fast loop
(tests/eval/loop/test_demo.py's scripted replies on the tiny model) with every session in its task's container
and every grade in a fresh one, giving the rewards the local runtime gives; and a rollout-service job run in a
container beside the same job run locally, with the same patch and reward.

``family_images`` comes first in both, so the debootstrap base and the env exist before the demo's own
``images build`` (which then adds only its tasks' layers).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import polars as pl

from eval.runs import read_rewards, read_sessions
from eval.sessions.containers import docker
from eval.sessions.procs import Service, free_port, new_secret_file
from tests.captures import scripted_proxy
from tests.eval.loop.test_demo import HELDOUT_SAMPLES, OTHER_HELDOUT_SAMPLES, SAMPLES, STAGES, demo_command

ROOT = Path(__file__).resolve().parents[2]


def live_sessions() -> set[str]:
    """The session ids of every container on the daemon that a runtime started."""
    listed = docker("ps", "-a", "--filter", "label=polar.session", "--format", '{{.Label "polar.session"}}')
    return set(listed.stdout.decode().split())


def test_demo_runs_every_session_in_a_container_with_the_local_rewards(family_images, tiny_model_dir, tmp_path):
    done = subprocess.run(
        [*demo_command(tiny_model_dir, tmp_path), "--set", "runtime=docker"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "sessions run sandboxed: --runtime docker" in done.stdout
    assert "UNSANDBOXED" not in done.stdout and "accepts any session key" not in done.stdout + done.stderr
    run = next(tmp_path.glob("runs/*/summary.json")).parent
    summary = json.loads((run / "summary.json").read_text())
    assert summary["runtime"] | {"why": ""} == {"name": "docker", "asked": "docker", "sandboxed": True, "why": ""}
    assert summary["note"].startswith("Sessions ran sandboxed (--runtime docker")

    # The images first, once; then every rollout in containers and every grade in a fresh one.
    phases = [p["phase"] for p in summary["phases"]]
    assert phases[0] == "images" and phases.count("images") == 1
    commands = [c for p in summary["phases"] for c in p["commands"]]
    rollouts = [c for c in commands if " -m eval rollout " in f" {c} "]
    scores = [c for c in commands if " -m eval score " in f" {c} "]
    assert len(rollouts) == len(scores) == 1 + 2 * len(STAGES)  # teacher, then each stage and its held-out split
    assert all("--runtime docker" in c and "--session-secret" in c for c in rollouts)
    assert all(c.endswith("--runner docker") for c in scores)

    # The same rewards as tests/eval/loop/test_demo.py asserts for the local runtime, graded by swebench.
    teacher = summary["stages"]["teacher"]
    assert (teacher["resolved"], teacher["graded"]) == (1, 1)
    sessions: list[str] = []
    for stage in STAGES:
        rewards = read_rewards(run / stage)
        assert rewards.height == SAMPLES
        assert rewards.filter(pl.col("resolved")).sort("sample_id")["sample_id"].to_list() == [0, 2]
        # the fixes graded by swebench in containers; the give-ups left no patch
        assert rewards.sort("sample_id")["reason"].to_list() == ["graded", "empty_patch"] * 2
        heldout = summary["stages"][stage]["heldout"]
        assert (heldout["graded"], heldout["resolved"]) == (
            OTHER_HELDOUT_SAMPLES if stage == "base" else HELDOUT_SAMPLES,
            0,
        )
        sessions += read_sessions(run / stage)["session_id"].to_list()
    assert summary["train"]["grpo1"]["groups_with_signal"] == 1
    assert not live_sessions() & set(sessions)  # every container removed


def call(url: str, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def test_a_service_job_runs_in_its_container_and_scores_as_the_local_one(family_images, tiny_model_dir, tmp_path):
    task = family_images[0]
    fix = {"name": "bash", "arguments": {"command": f"git apply <<'EOF_GOLD'\n{task['patch']}EOF_GOLD"}}
    script = [{"content": None, "tool_calls": [fix]}, {"content": "Fixed.", "tool_calls": []}]
    secret = new_secret_file(tmp_path / "secret")
    (tmp_path / "proxy").mkdir()
    with scripted_proxy(tiny_model_dir, script, tmp_path / "proxy", secret_file=secret) as proxy:
        port = free_port()
        cmd = [sys.executable, "-m", "eval", "serve-rollouts", "--proxy", proxy.url, "--captures", str(proxy.captures)]
        cmd += ["--root", str(tmp_path / "jobs"), "--runtime", "docker", "--session-secret", str(secret)]
        service = Service([*cmd, "--port", str(port), "--grade-timeout", "120"], port=port, log=tmp_path / "svc.log")
        try:
            body = {"instance": task, "harness": "mini", "timeout": 120}
            ids = {
                runtime: call(service.url, "POST", "/v1/jobs", body | extra)["job_id"]
                for runtime, extra in (("docker", {}), ("local", {"runtime": "local"}))  # docker: the service's
            }
            deadline = time.monotonic() + 600
            while {call(service.url, "GET", f"/v1/jobs/{j}")["status"] for j in ids.values()} - {"done", "failed"}:
                assert time.monotonic() < deadline, "the jobs did not finish"
                time.sleep(1)
            results = {r: call(service.url, "GET", f"/v1/jobs/{j}/results?traces=1") for r, j in ids.items()}
        finally:
            service.stop()
    for runtime, job_id in ids.items():
        job = json.loads((tmp_path / "jobs" / job_id / "job.json").read_text())
        assert (job["status"], job["params"]["runtime"], job["phase_errors"]) == ("done", runtime, {})
        (session,) = results[runtime]["sessions"]
        assert (session["status"], session["reward"], session["reason"]) == ("ok", 1.0, "graded"), session
        assert session["calls"] == 2 and session["incomplete_calls"] == 0
    # The same diff taken inside the container as on this machine: the gold patch, with git's index lines.
    patches = {r: results[r]["sessions"][0]["patch"] for r in ids}
    assert patches["docker"] == patches["local"]
    assert [line for line in patches["docker"].splitlines() if not line.startswith("index ")] == task[
        "patch"
    ].splitlines()
    assert not live_sessions() & {results["docker"]["sessions"][0]["session_id"]}
