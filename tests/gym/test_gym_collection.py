"""NeMo Gym 0.7.0 collects rollouts from Polar with its own code. ``gym env start`` (strict: an agent without an
environment server is an error) makes its servers' venvs from their requirements.txt and serves the agent (app.py)
behind the ``legacy_agent`` environment server the config declares; ``gym eval run`` sends it the example rows and
one row whose grading fails. The agent hands each to the real rollout service, which runs the ``mini`` harness
through the real mitmdump + addon against the scripted reference server (make_examples' script: the gold patch on
the first three tasks, a stray file on the others), grades it with swebench and rebuilds its tokens.

Asserted on Gym's own output file: exit status 0; the swebench rewards (1, 1, 1, 0, 0); the token fields (whole
triples, one log-prob per id, each prompt starting with everything before it, and the same ids as the committed
example rollouts, so those are what the pipeline makes today); Gym's aggregate metrics; and the row whose grading
failed arriving with Gym's own ``mask_sample: true`` (failure_kind ``verifier_error``).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from eval.nemo_gym.gym_root import GYM_BIN
from eval.nemo_gym.make_examples import script
from eval.sessions.procs import ROOT, Service, free_port
from tests.captures import scripted_proxy
from tests.gym.helpers import require_gym_python

AGENT = ROOT / "eval" / "nemo_gym" / "responses_api_agents" / "polar_swe_agent"
CONFIG = "responses_api_agents/polar_swe_agent/configs/polar_swe_agent.yaml"
AGENT_KEY = "polar_swe_agent.responses_api_agents.polar_swe_agent"
BROKEN = "polar-toy__broken-grader-1"

sys.path.insert(0, str(AGENT))
from polar_gym import TRIPLE, contiguity_errors  # noqa: E402

sys.path.remove(str(AGENT))


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


ROWS, ROLLOUTS = jsonl(AGENT / "data" / "example.jsonl"), jsonl(AGENT / "data" / "example_rollouts.jsonl")


def instance_id(row: dict) -> str:
    return row["responses_create_params"]["metadata"]["instance_id"]


def carriers(rollout: dict) -> list[dict]:
    return [item for item in rollout["response"]["output"] if item.get("generation_token_ids")]


def wait_for(log: Path, text: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        tail = log.read_text(errors="replace")[-6000:]
        assert proc.poll() is None, f"gym env start exited with {proc.returncode}:\n{tail}"
        assert time.monotonic() < deadline, f"no {text!r} from gym env start after {timeout:.0f} s:\n{tail}"
        time.sleep(1)


def stop_gym(proc: subprocess.Popen) -> None:
    """SIGINT, as Ctrl-C: Gym stops its servers and its Ray cluster (the wrapper execs, so this is gym's pid)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def service(tiny_model_dir, tmp_path):
    tasks = [row["instance"] for row in ROWS]
    (tmp_path / "proxy").mkdir()
    with scripted_proxy(tiny_model_dir, script(tasks), tmp_path / "proxy") as proxy:
        port = free_port()
        cmd = [sys.executable, "-m", "eval", "serve-rollouts", "--proxy", proxy.url, "--captures", str(proxy.captures)]
        cmd += ["--root", str(tmp_path / "jobs"), "--workers", "3", "--grade-timeout", "120", "--port", str(port)]
        service = Service(cmd, port=port, log=tmp_path / "service.log")
        try:
            yield service
        finally:
            service.stop()


def test_gym_collects_the_example_rollouts_through_polar(service, tmp_path):
    require_gym_python()
    broken = ROWS[3]["instance"] | {"instance_id": BROKEN, "eval_script": "#!/bin/bash\nexit 7\n"}
    masked_row = ROWS[3] | {"instance": broken}
    masked_row["responses_create_params"] = ROWS[3]["responses_create_params"] | {
        "metadata": {"instance_id": BROKEN, "harness": "mini"}
    }
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in [*ROWS, masked_row]))
    scratch = tmp_path / "gym"  # Gym makes its servers' venvs in the current directory
    scratch.mkdir()
    ray_tmp = tempfile.mkdtemp(prefix="gymray-", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    env = os.environ | {"NEMO_GYM_EXTRA_ROOTS": str(ROOT / "eval" / "nemo_gym"), "RAY_TMPDIR": ray_tmp}
    start_cmd = [
        str(GYM_BIN / "gym"),
        "env",
        "start",
        f"+config_paths=[{CONFIG}]",
        f"++{AGENT_KEY}.service_url={service.url}",
        f"++{AGENT_KEY}.poll_s=0.5",
        "++policy_model_name=tiny",
        "+error_on_agent_without_environment_server=true",
    ]
    log = tmp_path / "gym-env-start.log"
    started = time.monotonic()
    with log.open("wb") as out:
        gym = subprocess.Popen(
            start_cmd, cwd=scratch, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_for(log, "servers ready!", gym, timeout=420)
        ready_s = time.monotonic() - started
        output = tmp_path / "out.jsonl"
        run = [str(GYM_BIN / "gym"), "eval", "run", "--no-serve", "--agent", "polar_swe_agent"]
        run += ["--input", str(rows), "--output", str(output)]
        collected = time.monotonic()
        done = subprocess.run(run, cwd=scratch, env=env, capture_output=True, text=True, timeout=600)
        collect_s = time.monotonic() - collected
        assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    finally:
        stop_gym(gym)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print(f"gym env start: servers ready in {ready_s:.0f} s; gym eval run: {collect_s:.0f} s")
    started_log = log.read_text(errors="replace")
    assert "DEPRECATED" not in started_log and "legacy_agent relay" not in started_log

    answers = {instance_id(a): a for a in jsonl(output)}
    assert sorted(answers) == sorted([*map(instance_id, ROWS), BROKEN])
    expected = {instance_id(r): r for r in ROLLOUTS}
    assert [answers[instance_id(r)]["reward"] for r in ROWS] == [1.0, 1.0, 1.0, 0.0, 0.0]
    for name, pinned in expected.items():
        answer = answers[name]
        assert (answer["mask_sample"], answer["failure_kind"], answer["failure_reason"]) == (False, None, None)
        assert answer["instance_config"] == {"mask_sample": False}
        assert answer["reward"] == pinned["reward"] and answer["resolved"] == pinned["resolved"]
        output_items = answer["response"]["output"]
        assert contiguity_errors(output_items) == []
        for item in output_items:  # whole triples only
            assert all(item.get(k) is not None for k in TRIPLE) or not any(item.get(k) is not None for k in TRIPLE)
        got, want = carriers(answer), carriers(pinned)
        assert [[c[k] for k in TRIPLE[:2]] for c in got] == [[c[k] for k in TRIPLE[:2]] for c in want], name
        for g, w in zip(got, want, strict=True):
            assert g["generation_log_probs"] == pytest.approx(w["generation_log_probs"], abs=1e-3)
    masked = answers[BROKEN]
    assert masked["mask_sample"] is True and masked["instance_config"] == {"mask_sample": True}
    assert masked["failure_kind"] == "verifier_error" and masked["polar"]["mask_reasons"] == ["grade_failed"]
    assert masked["failure_reason"].startswith("grade_failed: ") and masked["reward"] == 0.0

    # Gym's aggregate (the agent's /aggregate_metrics, through the environment server) leaves the masked row out.
    (metrics,) = json.loads((tmp_path / "out_aggregate_metrics.json").read_text())
    key = metrics["key_metrics"]
    assert metrics["_ng_environment_server"] == "polar_swe_agent_environment_server"
    assert (key["mean/reward"], key["coverage/measured_rollouts"], key["coverage/masked_rollouts"]) == (0.6, 5, 1)
