"""The docker runtime against a real daemon: family tasks through Pi and mini in their own containers, graded in
fresh ones, against the local runtime on the same scripted replies; and sessions that try to break out.

The reference server replays one script for every session; its tool call picks what to do by the commit the
workspace is at (``by_commit``), so each task of a run gets its own behaviour.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from eval import rollout
from eval.containers import docker
from eval.procs import new_secret_file
from eval.runs import read_rewards, read_sessions
from eval.runtime import RUN_LABEL
from eval.tasks import save_tasks
from reconstruct import schema
from tests.captures import read_records, scripted_proxy, tokens_of
from tests.eval.test_rollout import WRONG_EDIT, by_commit

FINAL = "Done."


def containers_left() -> list[str]:
    return docker("ps", "-aq", "--filter", f"label={RUN_LABEL}").stdout.decode().split()


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
        concurrency=2,
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
    assert containers_left() == []
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


# A local session's checkout: <tmp>/polar-rollout-<random>/<session id>/repo (eval/rollout.py).
LOCAL_WORKSPACE = re.compile(re.escape(tempfile.gettempdir()) + r"/polar-rollout-[^/\"\\]+/[^/\"\\]+/repo")


def _messages(records: list[dict[str, Any]]) -> str:
    """The requests' messages, tool call ids (the server's random ones) left out."""
    return re.sub(r'"call_[0-9a-f]+"', '"call"', json.dumps([r["request"]["messages"] for r in records]))
