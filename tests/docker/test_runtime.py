"""The docker runtime against a real daemon: family tasks through Pi and mini in their own containers, graded in
fresh ones, against the local runtime on the same scripted replies; and sessions that try to break out.

The reference server replays one script for every session; its tool call picks what to do by the commit the
workspace is at (``by_commit``), so each task of a run gets its own behaviour.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from eval.runs import read_rewards, read_sessions
from eval.sessions import rollout
from eval.sessions.containers import docker
from eval.sessions.procs import new_secret_file
from eval.sessions.runtime import DEADLINE_GRACE_S, SESSION_LABEL, Limits
from eval.tasks.load import load_tasks, save_tasks
from reconstruct import schema
from tests.captures import read_records, scripted_proxy, tokens_of
from tests.eval.test_rollout import WRONG_EDIT, by_commit

FINAL = "Done."


def containers_left(*runs: pl.DataFrame) -> list[str]:
    """Containers of these runs' sessions still on the daemon (other runs may share it)."""
    return [
        cid
        for run in runs
        for sid in run["session_id"]
        for cid in docker("ps", "-aq", "--filter", f"label={SESSION_LABEL}={sid}").stdout.decode().split()
    ]


def health(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/polar/health", timeout=10) as answer:
        body: dict[str, Any] = json.load(answer)
    return body


@pytest.fixture(scope="module")
def teacher(family_images, tiny_model_dir, tmp_path_factory):
    """A proxy that checks signed keys, before a server whose one tool call applies the gold patch on tasks 0 and 2
    and makes a wrong edit on task 1."""
    tasks = {str(i): task for i, task in enumerate(family_images)}
    gold = {k: f"git apply <<'EOF_GOLD'\n{tasks[k]['patch']}EOF_GOLD" for k in ("0", "2")}
    script = [
        {
            "content": None,
            "tool_calls": [{"name": "bash", "arguments": {"command": by_commit(gold, tasks, WRONG_EDIT)}}],
        },
        {"content": FINAL, "tool_calls": []},
    ]
    tmp = tmp_path_factory.mktemp("teacher")
    secret = new_secret_file(tmp / "secret")
    with scripted_proxy(tiny_model_dir, script, tmp, secret_file=secret) as proxy:
        proxy.secret = secret
        yield proxy


def roll(proxy, tasks, harness: str, runtime: str, out: Path, **options: Any) -> pl.DataFrame:
    args = rollout.Args(
        tasks=str(out.parent / "tasks.jsonl"),
        harness=harness,
        proxy=proxy.url,
        out=out,
        runtime=runtime,
        session_secret=proxy.secret,
        concurrency=options.pop("concurrency", 2),
        timeout=options.pop("timeout", 240),
        **options,
    )
    assert rollout.main(args) == 0
    return read_sessions(out)


def first_prompts(captures: Path, sessions: pl.DataFrame) -> list[list[int]]:
    return [tokens_of(read_records(captures, session=sid)[0])[0] for sid in sessions["session_id"]]


def common_prefix(rows: list[list[int]]) -> int:
    n = 0
    while all(len(r) > n for r in rows) and len({r[n] for r in rows}) == 1:
        n += 1
    return n


@pytest.mark.parametrize("harness", ["mini", "pi"])
def test_a_round_in_containers_gives_the_local_runtimes_rewards_and_traces(harness, teacher, family_images, tmp_path):
    save_tasks(family_images, tmp_path / "tasks.jsonl")
    local = roll(teacher, family_images, harness, "local", tmp_path / "local")
    boxed = roll(teacher, family_images, harness, "docker", tmp_path / "docker")
    assert containers_left(boxed) == []
    for sessions in (local, boxed):
        assert sessions["status"].to_list() == ["ok"] * 3, sessions["error"].to_list()
    assert boxed["patch"].to_list() == local["patch"].to_list()
    assert re.sub(r"^index .*\n", "", boxed["patch"][0], flags=re.M) == family_images[0]["patch"]

    # Graded: the local runner on this machine, the docker run in a fresh container of each task's image.
    # A subprocess, as users run it: swebench's run_instance leaves docker SDK sockets open, which this process
    # would report (filterwarnings = error).
    for runtime in ("local", "docker"):
        score = [sys.executable, "-m", "eval", "score", str(tmp_path / runtime), "--runner", runtime]
        subprocess.run(score, check=True, capture_output=True, timeout=600)
    rewards = {
        runtime: read_rewards(tmp_path / runtime).sort("task_id")["reward"].to_list() for runtime in ("local", "docker")
    }
    order = sorted(range(3), key=lambda i: family_images[i]["instance_id"])
    assert rewards["docker"] == rewards["local"] == [1.0 if i in (0, 2) else 0.0 for i in order]

    # Token level: the same sampled ids; the same prompts but for the workspace's path (Pi's system prompt names it).
    for local_sid, boxed_sid in zip(local["session_id"], boxed["session_id"], strict=True):
        ours = read_records(teacher.captures, session=boxed_sid, expect=2)
        theirs = read_records(teacher.captures, session=local_sid, expect=2)
        assert [tokens_of(r)[1] for r in ours] == [tokens_of(r)[1] for r in theirs]
        assert _messages(ours) == LOCAL_WORKSPACE.sub("/testbed", _messages(theirs))
    prefix = {
        runtime: common_prefix(first_prompts(teacher.captures, sessions))
        for runtime, sessions in (("local", local), ("docker", boxed))
    }
    print(
        f"{harness}: the first prompts of 3 tasks share {prefix['local']} tokens (local), {prefix['docker']} (docker)"
    )
    assert prefix["docker"] >= prefix["local"]
    traces = {}
    for runtime, sessions in (("local", local), ("docker", boxed)):
        out = tmp_path / f"{runtime}.parquet"
        cli = [sys.executable, "-m", "reconstruct", str(teacher.captures), "-o", str(out), "--no-progress"]
        subprocess.run(
            [*cli, "--sessions", str(tmp_path / runtime / "sessions.parquet")], check=True, capture_output=True
        )
        traces[runtime] = schema.read(out).filter(pl.col("session_id").is_in(sessions["session_id"].to_list()))
        traces[runtime] = traces[runtime].sort("task_id", "chain_index")
    assert traces["docker"].height == traces["local"].height == 3
    for column in ("response_ids", "loss_mask", "task_id", "n_calls"):
        assert traces["docker"][column].to_list() == traces["local"][column].to_list()
    if harness == "mini":  # its prompt names no path: the prompts are equal too
        assert traces["docker"]["prompt_ids"].to_list() == traces["local"]["prompt_ids"].to_list()


# A local session's checkout: <tmp>/polar-rollout-<random>/<session id>/repo (eval/sessions/rollout.py).
LOCAL_WORKSPACE = re.compile(re.escape(tempfile.gettempdir()) + r"/polar-rollout-[^/\"\\]+/[^/\"\\]+/repo")


def _messages(records: list[dict[str, Any]]) -> str:
    """The requests' messages, tool call ids (the server's random ones) left out."""
    return re.sub(r'"call_[0-9a-f]+"', '"call"', json.dumps([r["request"]["messages"] for r in records]))


def hostile_commands(py: str, host_dir: Path, trap_port: int) -> dict[str, str]:
    """Task 0: escape attempts that each print what happened; task 1 a fork bomb; task 2 sleeps past the timeout."""
    calls = f"""
import json, socket, sys, urllib.request as u
url, key = sys.argv[1:]
own = key.rpartition("~")[0]
victim = own[:-1] + str(1 - int(own[-1]))
for name, k in (("unsigned", victim), ("forged", victim + "~" + "0" * 32)):
    try: print(name, "key:", u.urlopen(u.Request(url + "/models", headers={{"Authorization": "Bearer " + k}})).status)
    except u.HTTPError as e: print(name, "key:", e.code)
for a in (("127.0.0.1", {trap_port}), ("10.255.255.1", 80)):
    try: socket.create_connection(a, timeout=5); print("reached", *a)
    except OSError as e: print("cannot reach", *a, type(e).__name__)
"""
    argv = 'tr "\\0" "\\n" < /proc/$PPID/cmdline'  # mini's own argv: its base URL and key
    escape = f"""
echo "user: $(id -un) $(grep CapEff /proc/self/status)"
{{ echo escaped > /etc/polar-escaped && echo "wrote /etc/polar-escaped"; }} 2>/dev/null || echo "cannot write /etc"
mkdir -p {host_dir} && echo escaped > {host_dir}/escaped && echo "wrote {host_dir}/escaped"
cat {host_dir}/host-secret.txt 2>/dev/null || echo "no host secret file"
echo "host secret in env: $(env | grep -c POLAR_HOST_SECRET)"
echo "homes: $(ls "$(dirname "$(dirname "$HOME")")" | wc -l)"
{py} -c 'bytearray(1536 * 2**20)'; echo "memory hog: exit $?"
url="$({argv} | grep -A1 -x -- --base-url | tail -1)"
key="$({argv} | grep -A1 -x -- --api-key | tail -1)"
{py} -c {shlex.quote(calls)} "$url" "$key"
"""
    return {"0": escape, "1": ":(){ :|:& };:", "2": "sleep 600"}


def test_hostile_sessions_are_contained_and_recorded_as_what_they_were(
    family_images, tiny_model_dir, tmp_path, request
):
    tasks = {str(i): task for i, task in enumerate(family_images)}
    host_dir = tmp_path / "host-side"
    host_dir.mkdir()
    (host_dir / "host-secret.txt").write_text("the host's secret")
    trap = socket.create_server(("127.0.0.1", 0))  # a host port no session may reach
    request.addfinalizer(trap.close)
    trap.settimeout(0.1)
    commands = hostile_commands(sys.executable, host_dir, trap.getsockname()[1])
    script = [
        {
            "content": None,
            "tool_calls": [{"name": "bash", "arguments": {"command": by_commit(commands, tasks, "true")}}],
        },
        {"content": FINAL, "tool_calls": []},
    ]
    save_tasks(family_images, tmp_path / "tasks.jsonl")
    secret = new_secret_file(tmp_path / "secret")
    (tmp_path / "proxy").mkdir()
    os.environ["POLAR_HOST_SECRET"] = "the host's environment"
    try:
        with scripted_proxy(tiny_model_dir, script, tmp_path / "proxy", secret_file=secret) as proxy:
            proxy.secret = secret
            sessions = roll(
                proxy, family_images, "mini", "docker", tmp_path / "run", samples=2, timeout=60, concurrency=3,
                limits=Limits(cpus=1, memory="1g", pids=256),
            )  # fmt: skip
            refused = health(proxy.url)["refused_keys"]
            records = {sid: read_records(proxy.captures, session=sid) for sid in sessions["session_id"]}
    finally:
        del os.environ["POLAR_HOST_SECRET"]
    with contextlib.suppress(TimeoutError):
        trap.accept()
        pytest.fail("a session reached a host port")
    trap_port = trap.getsockname()[1]

    # The host is untouched and no container is left.
    assert not Path("/etc/polar-escaped").exists()
    assert sorted(p.name for p in host_dir.iterdir()) == ["host-secret.txt"]
    assert containers_left(sessions) == []

    kinds = {task["instance_id"]: i for i, task in tasks.items()}
    for (tid,), rows in sessions.group_by("task_id"):
        kind = kinds[str(tid)]
        if kind == "0":  # wrote nothing in /testbed: no edit; every attempt's outcome is what the model read back
            assert rows["status"].to_list() == ["no_edit"] * 2
            for sid in rows["session_id"]:
                assert len(records[sid]) == 2  # its own two calls: the forged ones were filed nowhere
                [result] = [m["content"] for m in records[sid][1]["request"]["messages"] if m["role"] == "tool"]
                for seen in (
                    "user: polar CapEff:\t0000000000000000", "cannot write /etc", f"wrote {host_dir}/escaped",
                    "no host secret file",
                    "host secret in env: 0", "homes: 1", "memory hog: exit 137", "unsigned key: 403",
                    "forged key: 403", f"cannot reach 127.0.0.1 {trap_port}", "cannot reach 10.255.255.1 80",
                ):  # fmt: skip
                    assert seen in result, result
        elif kind == "1":
            assert rows["status"].to_list() == ["timeout"] * 2
            assert all("forks refused at --pids-limit 256" in e for e in rows["error"]), rows["error"].to_list()
        else:
            assert rows["status"].to_list() == ["timeout"] * 2
            assert all(e.startswith("killed after 60 s") for e in rows["error"])
    assert refused == 4  # two forged calls from each of task 0's sessions, refused and counted


def test_connections_past_the_relay_cap_are_refused_and_named_in_the_session_error(teacher, family_images, tmp_path):
    # 40 connections held at once to the proxy from inside the container, at a cap of 16: the host relay (two threads
    # a connection, in the rollout's process) takes 16 and closes the other 24 at once.
    hold = (
        "import os, socket, time, urllib.parse as u; port = u.urlsplit(os.environ['OPENAI_BASE_URL']).port; "
        "held = [socket.create_connection(('127.0.0.1', port)) for _ in range(40)]; time.sleep(3); raise SystemExit(1)"
    )
    save_tasks(family_images[:1], tmp_path / "tasks.jsonl")
    sessions = roll(
        teacher, family_images[:1], "shell", "docker", tmp_path / "run", timeout=60,
        command=f"{shlex.quote(sys.executable)} -c {shlex.quote(hold)} {{instruction}}", limits=Limits(connections=16),
    )  # fmt: skip
    (row,) = sessions.iter_rows(named=True)
    assert row["status"] == "crashed", row
    assert "24 connections refused at --limits.connections 16" in row["error"], row["error"]
    assert containers_left(sessions) == []


def test_a_session_whose_image_is_missing_fails_naming_it_and_never_runs_on_the_host(teacher, family_images, tmp_path):
    theirs = {**family_images[0], "instance_id": "astropy__astropy-1", "repo": "astropy/astropy"}
    theirs["image"] = "registry.invalid/nope:1"  # not ours: pulled, which fails here
    ours = load_tasks("family:heldout@9")[0]  # ours, its image never built: no test builds seed 9's
    save_tasks([theirs, ours], tmp_path / "tasks.jsonl")
    sessions = roll(teacher, [theirs, ours], "mini", "docker", tmp_path / "run")
    assert sessions["status"].to_list() == ["setup_failed"] * 2
    missing, unbuilt = sessions["error"].to_list()
    assert "registry.invalid/nope:1" in missing and "docker pull registry.invalid/nope:1" in missing
    assert ours["image"] in unbuilt and "python -m eval images build" in unbuilt
    assert sessions["patch"].to_list() == ["", ""]
    assert all(not read_records(teacher.captures, session=sid) for sid in sessions["session_id"])
    assert containers_left(sessions) == []


def test_kept_workspaces_under_a_long_run_folder(teacher, family_images, tmp_path):
    """The relay's socket lives in a short folder of its own: a run folder's path may pass a socket path's 108
    bytes. The kept workspace comes out as the caller's files."""
    out = tmp_path / ("a-run-folder-with-a-long-name-" * 4) / "run"
    save_tasks(family_images[:1], out.parent / "tasks.jsonl")
    sessions = roll(teacher, family_images[:1], "mini", "docker", out, keep_workspaces=True)
    assert sessions["status"].to_list() == ["ok"], sessions["error"].to_list()
    repo = out / "workspaces" / sessions["session_id"][0] / "repo"
    assert (repo / ".git").is_dir() and not (repo / "home").exists()
    changed = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True)
    assert changed.stdout.strip(), "the kept workspace holds the agent's edit"
    assert {p.stat().st_uid for p in repo.rglob("*")} == {os.getuid()}
    assert containers_left(sessions) == []


def test_a_container_ends_by_itself_after_its_rollout_is_killed_with_sigkill(family_images, tiny_model_dir, tmp_path):
    """kill -9 of the rollout while its session sleeps: nothing of the rollout is left to stop the container, so its
    relay's deadline (the session's --timeout plus DEADLINE_GRACE_S) ends it."""
    script = [{"content": None, "tool_calls": [{"name": "bash", "arguments": {"command": "sleep 600"}}]}]
    save_tasks(family_images[:1], tmp_path / "tasks.jsonl")
    secret = new_secret_file(tmp_path / "secret")
    (tmp_path / "proxy").mkdir()
    out = tmp_path / "killed-run"

    def running() -> list[str]:  # this run's running containers
        listed = docker("ps", "--filter", "label=polar.run", "--format", '{{.ID}} {{.Label "polar.run"}}')
        return [line.split()[0] for line in listed.stdout.decode().splitlines() if f" {out.name}-" in line]

    with scripted_proxy(tiny_model_dir, script, tmp_path / "proxy", secret_file=secret) as proxy:
        cmd = [sys.executable, "-m", "eval", "rollout", "--tasks", str(tmp_path / "tasks.jsonl"), "--harness", "mini"]
        cmd += ["--proxy", proxy.url, "--out", str(out), "--runtime", "docker", "--session-secret", str(secret)]
        cmd += ["--timeout", "20"]  # the kill comes before it: the session is still in its sleep
        log = open(tmp_path / "rollout.log", "wb")  # noqa: SIM115 (closed below)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while not read_records(proxy.captures):  # the session has asked for its sleep
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "rollout.log").read_text()
                time.sleep(0.2)
            proc.kill()
            proc.wait()
        finally:
            log.close()
        killed_at = time.monotonic()
        (container,) = running()  # SIGKILL left it running: nothing removed it
        while running():
            assert time.monotonic() - killed_at < 20 + DEADLINE_GRACE_S + 60, "the container outlived its deadline"
            time.sleep(1)
    docker("rm", "-f", container, check=False)


def test_a_rollout_stopped_with_sigterm_removes_its_containers_and_starts_no_more(
    family_images, tiny_model_dir, tmp_path
):
    """SIGTERM (how the demo stops a phase, and what `kill` and `timeout` send) to the rollout process alone, while
    every session sleeps in its container: the containers go, the queued sessions never start, and it exits 143
    without waiting for the sleeps."""
    script = [{"content": None, "tool_calls": [{"name": "bash", "arguments": {"command": "sleep 600"}}]}]
    save_tasks(family_images, tmp_path / "tasks.jsonl")
    secret = new_secret_file(tmp_path / "secret")
    (tmp_path / "proxy").mkdir()
    out = tmp_path / "stopped-run"

    def ours() -> list[str]:  # this run's containers: its label is the run folder's name and a nonce
        listed = docker("ps", "-a", "--filter", "label=polar.run", "--format", '{{.Label "polar.run"}}')
        return [tag for tag in listed.stdout.decode().split() if tag.startswith(f"{out.name}-")]

    with scripted_proxy(tiny_model_dir, script, tmp_path / "proxy", secret_file=secret) as proxy:
        cmd = [sys.executable, "-m", "eval", "rollout", "--tasks", str(tmp_path / "tasks.jsonl"), "--harness", "mini"]
        cmd += ["--proxy", proxy.url, "--out", str(out), "--runtime", "docker", "--session-secret", str(secret)]
        cmd += ["--samples", "4", "--concurrency", "3", "--timeout", "600"]  # 12 sessions, 3 at a time
        log = open(tmp_path / "rollout.log", "wb")  # noqa: SIM115 (closed below)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while len(read_records(proxy.captures)) < 3:  # every running session has asked for its sleep
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "rollout.log").read_text()
                time.sleep(0.2)
            assert len(ours()) == 3
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == 128 + signal.SIGTERM, (tmp_path / "rollout.log").read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
        assert ours() == []
        assert len(read_records(proxy.captures)) == 3  # no queued session started after the stop
