"""python -m eval serve-rollouts end to end on CPU: the scripted reference server behind the real mitmdump + addon,
the service in its own process, jobs for `mini`, Pi (a real harness CLI), a crashing harness, a failed grade and a
cancelled hang, and at the same time one NeMo Gym /run (eval/nemo_gym: check_gym.py --service, app.py under Gym
0.7.0's own FastAPI app and models, when its interpreter exists, tests/gym/helpers.py, and always in make test-gym;
else the same polar_gym code in this interpreter); then a restart that still serves the finished results.

The reference server replays one script for every session: a bash tool call that applies the gold patch when the
workspace is at the "fixed" task's commit and writes NOTES.txt elsewhere, then a final answer. The "fixed" task is
the first row of the Gym agent's data/example.jsonl, the row check_gym.py --service sends.
"""

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from eval.sessions.procs import Service, free_port
from eval.tasks.load import load_tasks
from tests.captures import scripted_proxy
from tests.gym.helpers import gym_python

ROOT = Path(__file__).resolve().parents[3]
GYM_AGENT = ROOT / "eval" / "nemo_gym" / "responses_api_agents" / "polar_swe_agent"
sys.path.insert(0, str(GYM_AGENT))
from polar_gym import ServiceClient, contiguity_errors, submission, verify_response  # noqa: E402

sys.path.remove(str(GYM_AGENT))

pytestmark = pytest.mark.slow

TOKEN = "test-token-1234"
HANG_MARKER = "sleep 607"  # a command line this test can find among the machine's processes


def call(url, method, path, body=None, token=TOKEN):
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def start_service(proxy, root, token_file, log) -> Service:
    cmd = [
        sys.executable,
        "-m",
        "eval",
        "serve-rollouts",
        "--proxy",
        proxy.url,
        "--captures",
        str(proxy.captures),
        "--root",
        str(root),
        "--token-file",
        str(token_file),
        "--workers",
        "2",
        "--session-concurrency",
        "2",
        "--grade-timeout",
        "60",
    ]
    port = free_port()
    return Service([*cmd, "--port", str(port)], port=port, log=log)


def gym_run(url, task, token_file):
    """One Gym dataset row through /run: Gym's answer (a dict) and which code produced it."""
    row = {"responses_create_params": {"input": []}, "instance": task}
    if python := gym_python():  # None outside make test-gym when there is none; a failure inside it
        # app.py under Gym's own FastAPI and models, on the first example row: the same task
        cmd = [python, "check_gym.py", "--service", url, "--token-file", str(token_file)]
        done = subprocess.run(cmd, cwd=GYM_AGENT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout.splitlines()[-1])
        assert report["aggregate"]["agent_metrics"]["mean/reward"] == report["run"]["reward"]  # /aggregate_metrics
        return report["run"], "nemo_gym"
    client = ServiceClient(url, token=TOKEN, poll_s=0.5)
    results = client.run(submission(row, harness="mini", model="tiny", timeout=120), deadline_s=240)
    return verify_response(row, results, model="tiny"), "polar_gym"


def wait_finished(url, job_ids, timeout=240.0):
    deadline = time.time() + timeout
    while True:
        jobs = {j: call(url, "GET", f"/v1/jobs/{j}")[1] for j in job_ids}
        if all(job["status"] in ("done", "failed", "cancelled") for job in jobs.values()):
            return jobs
        assert time.time() < deadline, f"jobs still running: {jobs}"
        time.sleep(1)


@pytest.fixture(scope="module")
def tasks():
    first_row = json.loads((GYM_AGENT / "data" / "example.jsonl").read_text().splitlines()[0])
    by_id = {t["instance_id"]: t for t in load_tasks("toy")}
    fixed = by_id.pop(first_row["instance"]["instance_id"])  # what check_gym.py --service sends
    assert fixed == first_row["instance"], "data/example.jsonl is stale: python -m eval.nemo_gym.make_examples"
    wrong, crash, broken = sorted(by_id.values(), key=lambda t: len(t["patch"]))[:3]
    return {"fixed": fixed, "wrong": wrong, "crash": crash, "broken": broken}


@pytest.fixture(scope="module")
def proxy(tasks, tiny_model_dir, tmp_path_factory):
    gold = f"git apply <<'EOF_GOLD'\n{tasks['fixed']['patch']}EOF_GOLD"
    fixed = tasks["fixed"]["base_commit"]
    command = f'case "$(git rev-parse HEAD)" in\n{fixed}) {gold}\n;;\n*) printf x > NOTES.txt\n;;\nesac'
    script = [
        {
            "reasoning": "Fix it in place.",
            "content": None,
            "tool_calls": [{"name": "bash", "arguments": {"command": command}}],
        },
        {"content": "Done: the fix is in.", "tool_calls": []},
    ]
    with scripted_proxy(tiny_model_dir, script, tmp_path_factory.mktemp("service")) as proxy:
        yield proxy


def test_service_runs_grades_reconstructs_cancels_and_survives_a_restart(proxy, tasks, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    root = tmp_path / "jobs"
    service = start_service(proxy, root, token_file, tmp_path / "service.log")
    url = service.url
    try:
        status, health = call(url, "GET", "/health", token=None)
        assert status == 200 and health["status"] == "ok"
        assert call(url, "GET", "/v1/jobs", token=None)[0] == 401
        assert call(url, "GET", "/v1/jobs", token="wrong")[0] == 401
        status, refused = call(
            url, "POST", "/v1/jobs", {"instance_id": tasks["fixed"]["instance_id"], "harness": "vim"}
        )
        assert status == 400 and refused["error"].startswith("harness:")
        status, refused = call(url, "POST", "/v1/jobs", {"instance_id": "nope", "harness": "mini"})
        assert status == 400 and refused["error"].startswith("instance:")

        # Cancel a running job: its harness (own process group, under the rollout process) is killed too.
        hang = {
            "instance_id": tasks["crash"]["instance_id"],
            "harness": "shell",
            "command": f"{HANG_MARKER}; : {{instruction}}",
        }
        hang_id = call(url, "POST", "/v1/jobs", hang)[1]["job_id"]
        deadline = time.time() + 60
        while not any(HANG_MARKER in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])):
            assert time.time() < deadline, "the hanging harness never started"
            time.sleep(0.2)
        assert call(url, "POST", f"/v1/jobs/{hang_id}/cancel")[1]["status"] == "cancelled"
        assert not any(HANG_MARKER in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))
        assert call(url, "POST", f"/v1/jobs/{hang_id}/cancel")[0] == 409

        broken = tasks["broken"] | {"instance_id": "polar-toy__broken-grader-1", "eval_script": "#!/bin/bash\nexit 7\n"}
        submitted = {
            "mini": {
                "instance_id": tasks["fixed"]["instance_id"],
                "tasks": "toy",
                "harness": "mini",
                "samples": 2,
                "timeout": 120,
            },
            "pi": {"instance": tasks["fixed"], "harness": "pi", "timeout": 240, "metadata": {"who": "test"}},
            "crash": {
                "instance_id": tasks["crash"]["instance_id"],
                "harness": "shell",
                "command": "exit 3; : {instruction}",
            },
            "grade": {"instance": broken, "harness": "shell", "command": "printf x > NOTES.txt; : {instruction}"},
        }
        with ThreadPoolExecutor(1) as pool:
            gym = pool.submit(gym_run, url, tasks["fixed"], token_file)
            ids = {name: call(url, "POST", "/v1/jobs", body)[1]["job_id"] for name, body in submitted.items()}
            jobs = wait_finished(url, list(ids.values()))
            answer, produced_by = gym.result()
        assert {name: jobs[j]["status"] for name, j in ids.items()} == dict.fromkeys(ids, "done"), jobs
        results = {name: call(url, "GET", f"/v1/jobs/{j}/results?traces=1")[1] for name, j in ids.items()}
        assert jobs[ids["pi"]]["params"]["metadata"] == {"who": "test"}

        for name, samples in (("mini", 2), ("pi", 1)):
            sessions = results[name]["sessions"]
            assert [s["sample_id"] for s in sessions] == list(range(samples))
            for s in sessions:
                assert (s["status"], s["reward"], s["resolved"], s["reason"]) == ("ok", 1.0, True, "graded"), s
                assert s["patch"] == tasks["fixed"]["patch"]
                assert s["incomplete_calls"] == 0 and s["calls"] >= 2
                main = max(s["traces"], key=lambda t: t["n_calls"])
                assert main["n_calls"] >= 2 and main["token_source"] == "captured"
                assert len(main["response_ids"]) == len(main["loss_mask"]) == len(main["logprobs"])
                assert sum(t["n_calls"] for t in s["traces"]) == s["calls"]
        # Without ?traces the results stay small; the Parquet path is there for trainers that read files.
        plain = call(url, "GET", f"/v1/jobs/{ids['mini']}/results")[1]
        assert "traces" not in plain["sessions"][0] and Path(plain["trajectories"]).is_file()

        crash = results["crash"]["sessions"][0]
        assert (crash["status"], crash["reward"], crash["reason"]) == ("crashed", 0.0, "session_failed")
        graded = results["grade"]["sessions"][0]
        assert (graded["status"], graded["reward"], graded["reason"]) == ("ok", 0.0, "eval_error")
        assert results["grade"]["phase_errors"] == {}

        # Gym's answer: the swebench reward, the main chain's token triple on the last item of each call.
        assert (answer["reward"], answer["resolved"], answer["mask_sample"], answer["instance_config"]) == (
            1.0,
            True,
            False,
            {"mask_sample": False},
        ), produced_by
        assert produced_by == "nemo_gym" or gym_python() is None
        assert contiguity_errors(answer["response"]["output"]) == []
        carriers = [item for item in answer["response"]["output"] if item.get("generation_token_ids")]
        assert [item["type"] for item in carriers] == ["function_call", "message"]
    finally:
        service.stop()

    # A restart lists every job from disk and serves the same results.
    service = start_service(proxy, root, token_file, tmp_path / "service2.log")
    try:
        listed = {j["job_id"]: j["status"] for j in call(service.url, "GET", "/v1/jobs")[1]["jobs"]}
        finished = [*ids.values(), answer["polar"]["job_id"]]  # the Gym row's job too
        assert listed == {**dict.fromkeys(finished, "done"), hang_id: "cancelled"}
        again = call(service.url, "GET", f"/v1/jobs/{ids['mini']}/results?traces=1")[1]
        assert again == results["mini"]

    finally:
        service.stop()


def test_args_and_submissions_are_checked_before_anything_runs(tmp_path):
    from eval.service.app import Args, JobError, parse_submission

    with pytest.raises(ValueError, match="not loopback"):
        Args(proxy="http://127.0.0.1:8080", captures=tmp_path, host="0.0.0.0")
    (tmp_path / "token").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        Args(proxy="http://127.0.0.1:8080", captures=tmp_path, token_file=tmp_path / "token")
    task = load_tasks("toy")[0]
    for body, field in [
        ({"instance": task, "harness": "mini", "samples": 0}, "samples:"),
        ({"instance": task, "harness": "mini", "timeout": -1}, "timeout:"),
        ({"instance": task, "harness": "shell"}, "command:"),
        ({"instance": task, "harness": "mini", "colour": "red"}, "unknown fields ['colour']"),
        ({"instance": task | {"FAIL_TO_PASS": 3}, "harness": "mini"}, "instance:"),
        ({"instance": task, "instance_id": "x", "harness": "mini"}, 'give "instance"'),
    ]:
        with pytest.raises(JobError, match=re.escape(field)):
            parse_submission(body)
    instance, params = parse_submission({"instance_id": task["instance_id"], "harness": "pi", "samples": 3})
    assert instance["instance_id"] == task["instance_id"] and (params["samples"], params["timeout"]) == (3, 1800.0)


def test_the_runtime_reaches_the_rollout_and_the_grade_and_a_bad_one_is_refused(tmp_path):
    """A job's ``runtime`` (default: the service's --runtime) is the rollout's --runtime; a docker job is graded in a
    fresh container (score --runner docker). An unknown runtime is refused with the field named, at submission and
    at the command line."""
    import tyro

    from eval.service.app import Args, JobError, parse_submission, rollout_command, score_command

    def flag(cmd, name):
        return cmd[cmd.index(name) + 1]

    task = load_tasks("toy")[0]
    body = {"instance": task, "harness": "mini"}
    assert Args(proxy="http://127.0.0.1:8080", captures=tmp_path).runtime == "local"  # the default keeps behaviour
    with pytest.raises(ValueError, match=r"--runtime 'podman': not one of local, docker"):
        Args(proxy="http://127.0.0.1:8080", captures=tmp_path, runtime="podman")
    cli = ["--proxy", "http://127.0.0.1:8080", "--captures", str(tmp_path)]
    with pytest.raises(SystemExit):
        tyro.cli(Args, args=[*cli, "--runtime", "podman"])
    assert tyro.cli(Args, args=[*cli, "--runtime", "docker"]).runtime == "docker"
    for bad in ("podman", 3, None):
        with pytest.raises(JobError, match=re.escape(f"runtime: {bad!r} is not one of ['local', 'docker']")):
            parse_submission(body | {"runtime": bad})

    for service, submitted, runtime, runner in [
        ("local", {}, "local", "local"),
        ("docker", {}, "docker", "docker"),
        ("local", {"runtime": "docker"}, "docker", "docker"),
        ("docker", {"runtime": "local"}, "local", "local"),
    ]:
        args = Args(proxy="http://127.0.0.1:8080", captures=tmp_path, runtime=service)
        _, params = parse_submission(body | submitted, args.runtime)
        assert params["runtime"] == runtime
        rollout, score = rollout_command(args, tmp_path / "job", params), score_command(args, tmp_path / "job", params)
        assert rollout[2:4] == ["eval", "rollout"] and flag(rollout, "--runtime") == runtime
        assert score[2:5] == ["eval", "score", str(tmp_path / "job" / "run")] and flag(score, "--runner") == runner
    # A job.json from before jobs had a runtime runs as it did then.
    legacy = {k: v for k, v in params.items() if k != "runtime"}
    assert flag(rollout_command(args, tmp_path / "job", legacy), "--runtime") == "local"
    assert "--session-secret" not in rollout_command(args, tmp_path / "job", params)
    # A proxy that checks keys: each harness gets its session's signed key.
    (tmp_path / "secret").write_text("ab" * 32 + "\n")
    signed = Args(proxy="http://127.0.0.1:8080", captures=tmp_path, session_secret=tmp_path / "secret")
    assert flag(rollout_command(signed, tmp_path / "job", params), "--session-secret") == str(tmp_path / "secret")
    with pytest.raises(ValueError, match=r"--session-secret .*missing"):
        Args(proxy="http://127.0.0.1:8080", captures=tmp_path, session_secret=tmp_path / "missing")


def test_a_docker_job_is_refused_where_no_daemon_answers(tmp_path, monkeypatch):
    from eval.service.app import Args, JobError, Service
    from eval.sessions.containers import require_daemon

    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/polar-test.sock")
    require_daemon.cache_clear()
    service = Service(Args(proxy="http://127.0.0.1:8080", captures=tmp_path, root=tmp_path / "jobs", workers=1))
    body = {"instance_id": load_tasks("toy")[0]["instance_id"], "harness": "mini", "runtime": "docker"}
    try:
        with pytest.raises(
            JobError, match=r"^runtime: docker: (no Docker daemon answered at unix:///nonexistent|the docker CLI)"
        ):
            service.submit(body)
    finally:
        require_daemon.cache_clear()
    assert service.jobs() == [] and list((tmp_path / "jobs").iterdir()) == []
