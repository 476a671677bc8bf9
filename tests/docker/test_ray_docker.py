"""``python -m eval rollout --ray ... --runtime docker`` on a two-node Ray cluster on this machine: every session in
its task's container on the node it landed on, its key signed for that node's proxy, graded there in a fresh
container; the round gives the rewards the scripted replies earn, and leaves no container behind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from ray.cluster_utils import Cluster

from eval.runs import read_rewards, read_sessions
from eval.sessions.containers import docker
from eval.sessions.procs import ReferenceServer
from eval.sessions.runtime import SESSION_LABEL
from eval.tasks.load import save_tasks
from tests.captures import v1_lines
from tests.eval.test_rollout import FINAL, WRONG_EDIT, by_commit

SMALL_NODE = {"num_cpus": 1, "object_store_memory": 80 << 20}


@pytest.fixture(scope="module")
def cluster():
    nodes = Cluster(initialize_head=True, head_node_args={**SMALL_NODE, "include_dashboard": False})
    nodes.add_node(wait=False, **SMALL_NODE)
    nodes.wait_for_nodes(timeout=600)
    yield nodes
    nodes.shutdown()


def test_a_ray_round_in_containers(cluster, family_images, tiny_model_dir, tmp_path):
    tasks = {"fixed": family_images[0], "wrong": family_images[1]}
    gold = f"git apply <<'EOF_GOLD'\n{tasks['fixed']['patch']}EOF_GOLD"
    call = {"name": "bash", "arguments": {"command": by_commit({"fixed": gold}, tasks, WRONG_EDIT)}}
    script = [{"content": None, "tool_calls": [call]}, {"content": FINAL, "tool_calls": []}]
    (tmp_path / "script.json").write_text(json.dumps(script))
    save_tasks(tasks.values(), tmp_path / "tasks.jsonl")
    out = tmp_path / "run"
    with ReferenceServer(tiny_model_dir, script=tmp_path / "script.json", log=tmp_path / "server.log") as server:
        cli = [sys.executable, "-m", "eval", "rollout", "--ray", cluster.address, "--upstream", server.url]
        cli += ["--tasks", str(tmp_path / "tasks.jsonl"), "--harness", "mini", "--samples", "2", "--out", str(out)]
        cli += ["--runtime", "docker", "--concurrency", "2", "--timeout", "300"]
        done = subprocess.run(cli, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    sessions = read_sessions(out)
    assert sessions["status"].to_list() == ["ok"] * 4, sessions["error"].to_list()
    rewards = read_rewards(out).join(sessions.select("session_id", "task_id"), on="session_id", suffix="_s")
    expected = {tasks["fixed"]["instance_id"]: 1.0, tasks["wrong"]["instance_id"]: 0.0}
    assert {(r["task_id"], r["reward"]) for r in rewards.iter_rows(named=True)} == set(expected.items())
    assert set(rewards["reason"]) == {"graded"}
    # Graded by swebench's run_instance, whose log the node copied back.
    for sid in sessions["session_id"]:
        assert (out / "logs" / sid / "run_instance.log").is_file()
        assert not docker("ps", "-aq", "--filter", f"label={SESSION_LABEL}={sid}").stdout.strip()
    # Every session's two calls were recorded by its node's proxy, under its id (the signed key's id part).
    lines = [line for node in (out / "captures").iterdir() for line in v1_lines(node)]
    recorded = [json.loads(line)["session_id"] for line in lines]
    assert sorted(recorded) == sorted([*sessions["session_id"]] * 2)
    assert not any("~" in sid for sid in recorded)
