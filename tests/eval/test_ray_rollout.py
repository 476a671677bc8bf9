"""``python -m eval rollout --ray`` on a two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``): a round
gives what one machine gives (statuses, rewards, reconstructed token ids), and a round that loses a worker and a
node mid-session loses nothing and counts nothing twice.

Both nodes share one scripted reference server (each node's proxy forwards to its URL); the cluster is small (one
CPU a node, no dashboard, a small object store) because CI has two cores.
"""

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import polars as pl
import psutil
import pytest
from ray.cluster_utils import Cluster

import eval.score
from eval.harness.presets import MINI
from eval.runs import read_rewards, read_sessions
from eval.sessions import rollout
from eval.sessions.procs import Mitmdump, ReferenceServer
from eval.sessions.ray_rollout import CAPTURES, LOST, LOST_SCHEMA, read_lost
from eval.tasks.load import load_tasks
from reconstruct import reconstruct, schema
from tests.eval.test_rollout import FINAL, WRONG_EDIT, by_commit

pytestmark = pytest.mark.slow
SMALL_NODE = {"num_cpus": 1, "object_store_memory": 80 << 20}
ROUND_TIMEOUT = 600  # a bound, not a measure: a busy 2-core box may be several times slower than a quiet one


@pytest.fixture(scope="module")
def tasks():
    fixed, wrong = sorted(load_tasks("toy"), key=lambda t: len(t["patch"]))[:2]
    return {"fixed": fixed, "wrong": wrong}


@pytest.fixture(scope="module")
def server(tasks, tiny_model_dir, tmp_path_factory):
    """The scripted reference server: the gold patch on the "fixed" task, a wrong edit on the other, then FINAL."""
    tmp = tmp_path_factory.mktemp("ray-server")
    apply_gold = f"git apply <<'EOF_GOLD'\n{tasks['fixed']['patch']}EOF_GOLD"
    command = by_commit({"fixed": apply_gold}, tasks, default=WRONG_EDIT)
    script = [
        {"content": None, "tool_calls": [{"name": "bash", "arguments": {"command": command}}]},
        {"content": FINAL, "tool_calls": []},
    ]
    (tmp / "script.json").write_text(json.dumps(script))
    with ReferenceServer(tiny_model_dir, script=tmp / "script.json", log=tmp / "server.log") as reference:
        yield reference


@pytest.fixture(scope="module")
def cluster():
    """Two nodes (the head and one more), one CPU each; the test process is not a Ray driver."""
    nodes = Cluster(initialize_head=True, head_node_args={**SMALL_NODE, "include_dashboard": False})
    nodes.add_node(wait=False, **SMALL_NODE)
    nodes.wait_for_nodes(timeout=ROUND_TIMEOUT)  # polled; Ray's default of 30 s is short for a busy 2-core box
    yield nodes
    nodes.shutdown()


@pytest.fixture
def ray_rollout(cluster, server, tasks):
    """Factory: ``ray_rollout(out, *flags)`` starts ``python -m eval rollout --ray`` on the cluster (the driver, as a
    user runs it); a driver still running when the test ends is killed."""
    drivers = []

    def start(out, *extra):
        ids = sorted(t["instance_id"] for t in tasks.values())
        cli = [sys.executable, "-m", "eval", "rollout", "--ray", cluster.address, "--upstream", server.url]
        cli += ["--tasks", "toy", "--instance-ids", *ids, "--out", str(out), *extra]
        drivers.append(subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return drivers[-1]

    yield start
    for driver in drivers:
        if driver.poll() is None:
            driver.kill()
        driver.communicate()


def traces_by_sample(captures, sessions):
    """(task_id, sample_id) -> the token ids of its traces, in chain order."""
    mapping = {r["session_id"]: (r["task_id"], r["sample_id"]) for r in sessions.iter_rows(named=True)}
    df, stats = reconstruct(captures, sessions=mapping)
    assert stats.duplicate_records == 0  # record ids are unique across the nodes' proxies
    out = {}
    for row in df.sort("session_id", "chain_index").iter_rows(named=True):
        out.setdefault((row["task_id"], row["sample_id"]), []).append((row["prompt_ids"], row["response_ids"]))
    return df, out


def node_folders_of(captures):
    """session_id -> the node folders under ``captures`` holding its records."""
    found = {}
    for node in captures.iterdir():
        for path in node.rglob("*.jsonl"):
            for line in path.read_bytes().splitlines():
                session = json.loads(line)["session_id"]
                found.setdefault(session, set()).add(node.name)
    return found


def test_a_round_over_two_nodes_gives_what_one_machine_gives(ray_rollout, server, tasks, tmp_path):
    one, spread = tmp_path / "one", tmp_path / "ray"
    driver = ray_rollout(spread, "--harness", "mini", "--concurrency", "2", "--timeout", "120")
    with Mitmdump(server.url, tmp_path / "captures", log=tmp_path / "mitmdump.log") as proxy:
        args = rollout.Args(
            tasks="toy",
            instance_ids=tuple(sorted(t["instance_id"] for t in tasks.values())),
            harness="mini",
            proxy=proxy.url,
            out=one,
            concurrency=2,
            timeout=120,
        )
        assert rollout.main(args) == 0
    assert eval.score.main(eval.score.Args(one)) == 0
    stdout, stderr = driver.communicate(timeout=ROUND_TIMEOUT)
    assert driver.returncode == 0, stderr[-3000:]
    assert "python -m reconstruct" in stdout

    key = ["task_id", "sample_id"]
    sessions = {run: read_sessions(run).sort(key) for run in (one, spread)}
    rewards = {run: read_rewards(run).sort(key) for run in (one, spread)}
    columns = ["task_id", "sample_id", "status", "exit_code", "patch", "error"]
    assert sessions[spread].select(columns).equals(sessions[one].select(columns))
    assert sessions[one]["status"].to_list() == ["ok"] * 2
    columns = ["task_id", "sample_id", "reward", "resolved", "reason"]
    assert rewards[spread].select(columns).equals(rewards[one].select(columns))
    assert rewards[one]["reward"].to_list() == [
        1.0 if t == tasks["fixed"]["instance_id"] else 0.0 for t in rewards[one]["task_id"]
    ]
    assert set(rewards[spread]["session_id"]) == set(sessions[spread]["session_id"])
    for sid in sessions[spread]["session_id"]:  # logs of the harness and of grading, gathered from the nodes
        assert (spread / "logs" / sid / "stdout.txt").read_text().splitlines()[-1] == FINAL
        assert (spread / "logs" / sid / "eval.log").is_file()
    assert read_lost(spread).is_empty()

    # Each session's records lie in the folder of the one node it ran on; both nodes ran some.
    folders = node_folders_of(spread / CAPTURES)
    assert set(folders) == set(sessions[spread]["session_id"])
    assert all(len(nodes) == 1 for nodes in folders.values())
    assert len(set.union(*folders.values())) == 2
    # Reconstructed per node folder (a shard) or all at once: the same traces, the same token ids as one machine.
    whole, spread_traces = traces_by_sample([spread / CAPTURES], sessions[spread])
    shards = [traces_by_sample([node], sessions[spread])[0] for node in sorted((spread / CAPTURES).iterdir())]
    assert pl.concat(shards).sort("trace_id").equals(whole.sort("trace_id"))
    _, one_traces = traces_by_sample([tmp_path / "captures"], sessions[one])
    assert spread_traces == one_traces and len(one_traces) == 2


def test_a_worker_and_a_node_killed_mid_round_lose_nothing_and_count_nothing_twice(
    cluster, ray_rollout, tasks, tmp_path
):
    # Each session runs the mini agent, then parks until the test releases it; an attempt that reaches that point
    # after the release goes on. With a CPU a node, one session parks on each node.
    release = tmp_path / "release"
    agent = f"{shlex.quote(sys.executable)} -P {shlex.quote(str(MINI))} --model tiny --workspace ."
    agent += ' --base-url "$OPENAI_BASE_URL" --api-key "$OPENAI_API_KEY" --prompt-file <(printf %s {instruction})'
    wait = f"while [ ! -e {shlex.quote(str(release))} ]; do sleep 0.2; done"
    park = (
        f"{{ [ -e {shlex.quote(str(release))} ] || {{ echo $$ > {shlex.quote(str(tmp_path))}/parked-$$; {wait}; }}; }}"
    )
    run = tmp_path / "run"
    command = f"{agent} && {park}"
    driver = ray_rollout(run, "--harness", "shell", "--command", command, "--concurrency", "2", "--timeout", "600")

    deadline = time.monotonic() + ROUND_TIMEOUT
    while len(parked := list(tmp_path.glob("parked-*"))) < 2:
        assert driver.poll() is None, driver.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{len(parked)} of 2 sessions parked"
        time.sleep(0.5)
    [node] = cluster.worker_nodes
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    harnesses = [psutil.Process(int(p.name.split("-")[1])) for p in parked]  # each one's parent: its Ray worker
    [on_head] = [h for h in harnesses if h.parent().parent() != raylet]
    assert on_head.parent().cmdline()[0].startswith("ray::"), on_head.parent().cmdline()  # titled after the task
    os.kill(on_head.parent().pid, signal.SIGKILL)  # the worker of the head's session...
    os.killpg(on_head.pid, signal.SIGKILL)  # ...and its harness: its own process group, which the worker left behind
    on_node = raylet.children(recursive=True)  # its workers, its proxy's mitmdump, the harness parked there
    cluster.remove_node(node, allow_graceful=False)  # ...and the other node, with all it ran
    for process in on_node:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    release.touch()
    _, stderr = driver.communicate(timeout=ROUND_TIMEOUT)
    cluster.add_node(wait=False, **SMALL_NODE)  # two nodes again, for any test after this one
    cluster.wait_for_nodes(timeout=ROUND_TIMEOUT)
    assert driver.returncode == 0, stderr[-3000:]

    sessions, rewards, lost = read_sessions(run), read_rewards(run), read_lost(run)
    assert lost.schema == LOST_SCHEMA and lost.height == 2, lost
    # Every task once, finished, graded once; the lost attempts in neither table, their reruns in both.
    assert sorted(sessions["task_id"]) == sorted(t["instance_id"] for t in tasks.values())
    assert sessions["status"].to_list() == ["ok", "ok"], sessions["error"].to_list()
    assert sorted(rewards["session_id"]) == sorted(sessions["session_id"])
    assert not set(lost["session_id"]) & set(sessions["session_id"])
    expected = {tasks["fixed"]["instance_id"]: 1.0, tasks["wrong"]["instance_id"]: 0.0}
    assert dict(zip(rewards["task_id"], rewards["reward"], strict=True)) == expected

    # Only the surviving node's captures came back. They hold the head's lost attempt (its calls were recorded
    # before the kill), which --skip-sessions lost.parquet leaves out of the trajectories.
    assert [folder.name for folder in (run / CAPTURES).iterdir()] == [cluster.head_node.node_id[:16]]
    recorded = set(node_folders_of(run / CAPTURES))
    assert len(recorded & set(lost["session_id"])) == 1 and recorded >= set(sessions["session_id"])
    traces = run / "trajectories.parquet"
    cli = [sys.executable, "-m", "reconstruct", str(run / CAPTURES), "-o", str(traces), "--no-progress"]
    cli += ["--sessions", str(run / "sessions.parquet"), "--skip-sessions", str(run / LOST)]
    subprocess.run(cli, check=True, capture_output=True)
    assert set(schema.read(traces)["session_id"]) == set(sessions["session_id"])
