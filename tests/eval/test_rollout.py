"""python -m eval rollout end to end on two toy tasks: the `mini` and `shell` harnesses through the real mitmdump +
addon to the scripted reference server, then score, reconstruct and join; and harnesses that crash, hang, edit
nothing or cannot start, each recorded with its status while the run goes on.

The reference server replays one script for every session, so its one tool call picks what to do by the commit
the workspace is at: the gold patch on the first task (resolved), a wrong edit on the second (unresolved).
"""

import contextlib
import datetime
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import polars as pl
import pytest

import eval.join
import eval.score
from eval.errors import EvalError
from eval.harness.presets import MINI
from eval.runs import read_rewards, read_sessions
from eval.sessions import rollout
from eval.sessions.rollout import Args, main, session_id
from eval.sessions.runtime import Limits, take_patch
from eval.tasks.load import checkout, load_tasks
from reconstruct import schema
from tests.captures import read_records, scripted_proxy, tokens_of

FINAL = "Done: the fix is in."
WRONG_EDIT = "printf 'looked at it\\n' > NOTES.txt"


@pytest.fixture(scope="module")
def tasks():
    # The smallest gold patch to apply: the server streams every scripted token, one forward pass each.
    fixed, wrong, crash, hang, idle = sorted(load_tasks("toy"), key=lambda t: len(t["patch"]))[:5]
    return {"fixed": fixed, "wrong": wrong, "crash": crash, "hang": hang, "idle": idle}


def by_commit(cases: dict[str, str], tasks: dict[str, dict], default: str) -> str:
    """A shell `case` that runs ``cases[name]`` in the workspace of task ``name`` (told apart by commit)."""
    arms = "".join(f"{tasks[name]['base_commit']}) {command}\n;;\n" for name, command in cases.items())
    return f'case "$(git rev-parse HEAD)" in\n{arms}*) {default}\n;;\nesac'


@pytest.fixture(scope="module")
def proxy(tasks, tiny_model_dir, tmp_path_factory):
    apply_gold = f"git apply <<'EOF_GOLD'\n{tasks['fixed']['patch']}EOF_GOLD"
    command = by_commit({"fixed": apply_gold}, tasks, default=WRONG_EDIT)
    script = [
        # A tool mini does not have: it answers with an error the model could act on, and goes on.
        {"content": None, "tool_calls": [{"name": "python", "arguments": {"code": "print(1)"}}]},
        {"reasoning": "Fix it.", "content": None, "tool_calls": [{"name": "bash", "arguments": {"command": command}}]},
        {"content": FINAL, "tool_calls": []},
    ]
    with scripted_proxy(tiny_model_dir, script, tmp_path_factory.mktemp("rollout")) as proxy:
        yield proxy


@pytest.mark.slow
def test_mini_and_shell_rollouts_line_up_with_captures_rewards_and_traces(proxy, tasks, tmp_path):
    ids = sorted([tasks["fixed"]["instance_id"], tasks["wrong"]["instance_id"]])  # the order rollout runs them in
    mini_run, shell_run = tmp_path / "mini", tmp_path / "shell"
    cli = [sys.executable, "-m", "eval", "rollout", "--harness", "mini", "--samples", "2", "--out", str(mini_run)]
    cli += ["--tasks", "toy", "--instance-ids", *ids, "--proxy", proxy.url, "--concurrency", "2", "--timeout", "120"]
    mini = subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Meanwhile (one proxy, many sessions) the shell harness runs the same agent, finding the proxy and its
    # session in the OpenAI variables.
    agent = f"{shlex.quote(sys.executable)} -P {shlex.quote(str(MINI))} --model tiny --workspace ."
    agent += ' --base-url "$OPENAI_BASE_URL" --api-key "$OPENAI_API_KEY" --prompt-file <(printf %s {instruction})'
    shell = rollout.Args(
        tasks="toy",
        instance_ids=tuple(ids),
        harness="shell",
        command=agent,
        proxy=proxy.url,
        out=shell_run,
        concurrency=2,
        timeout=120,
    )
    assert rollout.main(shell) == 0
    stdout, stderr = mini.communicate(timeout=240)
    assert mini.returncode == 0, stderr
    assert f"python -m eval score {mini_run}" in stdout

    tasks_written = [json.loads(line) for line in (mini_run / "tasks.jsonl").read_text().splitlines()]
    assert [t["instance_id"] for t in tasks_written] == ids
    for run, samples in ((mini_run, 2), (shell_run, 1)):
        sessions = read_sessions(run)
        assert sessions["task_id"].to_list() == [i for i in ids for _ in range(samples)]
        assert sessions["sample_id"].to_list() == list(range(samples)) * 2
        assert sessions["status"].to_list() == ["ok"] * 2 * samples, sessions["error"].to_list()
        assert sessions["session_id"].n_unique() == 2 * samples
        for row in sessions.iter_rows(named=True):
            assert row["exit_code"] == 0 and row["error"] is None
            if row["task_id"] == tasks["fixed"]["instance_id"]:
                assert row["patch"] == tasks["fixed"]["patch"]
            else:
                assert row["patch"].startswith("diff --git a/NOTES.txt b/NOTES.txt\nnew file mode 100644")
            assert (run / "logs" / row["session_id"] / "stdout.txt").read_text().splitlines()[-1] == FINAL
            # Every model call of the session was captured under its id: two tool calls, then the answer.
            records = read_records(proxy.captures, session=row["session_id"], expect=3)
            assert [(r["session_source"], r["status"], r["complete"]) for r in records] == [("api_key", 200, True)] * 3
            # Its phases line up with its calls: setup, then the harness (every call inside it), then the patch.
            start = datetime.datetime.fromisoformat(row["started_at"]).timestamp()
            launched = start + row["setup_s"]
            assert min(row["setup_s"], row["patch_s"], row["duration_s"]) > 0
            assert (
                launched - 0.01 <= records[0]["t_start"] <= records[-1]["t_end"] <= launched + row["duration_s"] + 0.01
            )
            assert [t["function"]["name"] for t in records[0]["request"]["tools"]] == ["bash"]
            results = [m["content"] for m in records[2]["request"]["messages"] if m["role"] == "tool"]
            assert results[0].startswith("error: unknown tool 'python'")
            assert results[1] == "exit code: 0\n"
            # Reasoning goes back with the assistant turn, so the next prompt extends the tokens sampled before.
            prompt, sampled, _ = tokens_of(records[1])
            assert tokens_of(records[2])[0][: len(prompt) + len(sampled)] == prompt + sampled

        assert eval.score.main(eval.score.Args(run)) == 0
        rewards = read_rewards(run).join(sessions.select("session_id", "task_id"), on="session_id", suffix="_s")
        assert rewards.height == 2 * samples
        assert (rewards["task_id"] == rewards["task_id_s"]).all()
        expected = [1.0 if task == tasks["fixed"]["instance_id"] else 0.0 for task in rewards["task_id"]]
        assert rewards["reward"].to_list() == expected
        assert rewards["resolved"].to_list() == [r == 1.0 for r in expected]

    # Traces of the mini run get its tasks and rewards; the shell run's sessions, in the same captures, stay apart.
    traces = tmp_path / "trajectories.parquet"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "reconstruct",
            str(proxy.captures),
            "-o",
            str(traces),
            "--sessions",
            str(mini_run / "sessions.parquet"),
            "--no-progress",
        ],
        check=True,
        capture_output=True,
    )
    assert eval.join.main(eval.join.Args(traces, mini_run, tmp_path / "joined.parquet")) == 0
    joined = schema.read(tmp_path / "joined.parquet")
    sessions = read_sessions(mini_run)
    expect = {
        r["session_id"]: (r["task_id"], r["sample_id"], 1.0 if r["task_id"] == tasks["fixed"]["instance_id"] else 0.0)
        for r in sessions.iter_rows(named=True)
    }
    mine = joined.filter(pl.col("session_id").is_in(list(expect)))
    assert set(mine["session_id"]) == set(expect)
    for row in mine.iter_rows(named=True):
        assert (row["task_id"], row["sample_id"], row["reward"]) == expect[row["session_id"]]
    others = joined.filter(~pl.col("session_id").is_in(list(expect)))
    assert set(others["session_id"]) >= set(read_sessions(shell_run)["session_id"])
    assert others["task_id"].is_null().all() and others["reward"].is_null().all()


@pytest.mark.slow
def test_crashing_hanging_idle_and_unstartable_harnesses_are_recorded_and_the_run_goes_on(tasks, tmp_path):
    image = f"polar-toy/missing:{tasks['idle']['base_commit'][:12]}"  # the image of our own repo at that commit
    broken = {**tasks["idle"], "instance_id": "polar-toy__missing-1", "repo": "polar-toy/missing", "image": image}
    task_file = tmp_path / "tasks.jsonl"
    task_file.write_text("".join(json.dumps(t) + "\n" for t in [tasks["crash"], tasks["hang"], tasks["idle"], broken]))
    # One command line for the run; the commit tells it which failure to act out.
    failures = {"crash": "echo 'agent exploded' >&2; exit 3", "hang": "sleep 120 & wait"}
    command = by_commit(failures, tasks, default="echo {instruction} > /dev/null")
    run = tmp_path / "run"
    nowhere = "http://127.0.0.1:9/v1"  # nothing listens: no model call is made
    main(
        Args(
            tasks=str(task_file),
            harness="shell",
            command=command,
            proxy=nowhere,
            out=run,
            timeout=3,
            concurrency=2,
            proxy_check=False,
        )
    )

    sessions = read_sessions(run)
    statuses = dict(zip(sessions["task_id"], sessions.select("status", "exit_code", "error").iter_rows(), strict=True))
    assert statuses[tasks["crash"]["instance_id"]] == ("crashed", 3, "exit 3; stderr: agent exploded")
    status, code, error = statuses[tasks["hang"]["instance_id"]]
    assert (status, code) == ("timeout", None) and error.startswith("killed after 3 s")
    assert statuses[tasks["idle"]["instance_id"]] == ("no_edit", 0, "the harness exited 0 and left no change")
    status, code, error = statuses["polar-toy__missing-1"]
    assert (status, code) == ("setup_failed", None) and "no toy repository" in error
    assert (sessions["patch"] == "").all()
    assert (run / "logs" / sessions["session_id"][0] / "stderr.txt").read_text() == "agent exploded\n"
    assert not list(tmp_path.glob("run/workspaces"))  # removed without --keep-workspaces


def test_patch_leaves_out_harness_folders_but_keeps_new_files_and_commits(tasks, tmp_path):
    repo = checkout(tasks["fixed"], tmp_path / "repo")
    for folder in (".claude", "node_modules/pkg", "src/__pycache__", ".pi/agent"):
        (repo / folder).mkdir(parents=True)
        (repo / folder / "state.json").write_text("{}")
    (repo / "new_module.py").write_text("X = 1\n")
    subprocess.run(["git", "-C", str(repo), "add", "new_module.py"], check=True)
    git = ["git", "-C", str(repo), "-c", "user.name=agent", "-c", "user.email=agent@example.invalid"]
    subprocess.run([*git, "commit", "-qm", "the agent commits"], check=True)
    (repo / "binary.bin").write_bytes(bytes(range(256)))
    patch = take_patch(repo, tasks["fixed"]["base_commit"], 1 << 20)
    files = [line.split(" b/")[-1] for line in patch.splitlines() if line.startswith("diff --git")]
    assert files == ["binary.bin", "new_module.py"]
    assert "GIT binary patch" in patch
    # The user's files are untouched: only the index left the folders out.
    assert (repo / ".claude" / "state.json").exists()


def test_session_ids_are_valid_api_keys_and_unique():
    assert session_id("r1-abc123", "astropy__astropy-12907", 3) == "r1-abc123-astropy__astropy-12907-3"
    assert session_id("my run", "a/b", 0) == "my-run-a-b-c14cddc033f64b9d-0"
    assert session_id("my run", "a-b", 0) == "my-run-a-b-0"  # told apart from a/b
    assert session_id("sk-live", "x", 0) == "run-sk-live-x-0"  # never mistaken for a provider secret
    long_a, long_b = session_id("r", "x" * 200 + "a", 0), session_id("r", "x" * 200 + "b", 0)
    assert len(long_a) == 128 and long_a != long_b


def test_args_refuse_contradictions(tmp_path):
    with pytest.raises(ValueError, match="--harness shell needs --command"):
        Args(tasks="toy", harness="shell", proxy="http://x", out=tmp_path)
    with pytest.raises(ValueError, match="must contain"):
        Args(tasks="toy", harness="shell", command="run-agent", proxy="http://x", out=tmp_path)
    (tmp_path / "sessions.parquet").write_text("")
    with pytest.raises(ValueError, match="give --out a new run folder"):
        Args(tasks="toy", harness="mini", proxy="http://x", out=tmp_path)


def test_a_run_folder_with_another_runs_tasks_is_refused_and_left_as_it_was(tasks, tmp_path):
    """A folder a killed run left (its tasks.jsonl, no sessions table) is reused only for the same tasks."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "tasks.jsonl").write_text('{"instance_id": "another run"}\n')
    args = Args(
        tasks="toy",
        instance_ids=(tasks["fixed"]["instance_id"],),
        harness="shell",
        command="true {instruction}",
        proxy="http://127.0.0.1:9",
        out=out,
        proxy_check=False,
    )
    with pytest.raises(EvalError, match="holds other tasks"):
        main(args)
    assert (out / "tasks.jsonl").read_text() == '{"instance_id": "another run"}\n'
    (out / "tasks.jsonl").unlink()
    assert main(args) == 0  # writes it, then a rerun into the same folder with the same tasks may go on
    (out / "sessions.parquet").unlink()
    assert main(args) == 0


def peak_rss(proc: subprocess.Popen) -> int:
    """``proc``'s peak resident memory in bytes (VmHWM), read until it exits."""
    peak = 0
    while proc.poll() is None:
        with contextlib.suppress(OSError):
            if match := re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{proc.pid}/status").read_text()):
                peak = max(peak, int(match[1]) * 1024)  # none once it is a zombie
        time.sleep(0.05)
    return peak


@pytest.mark.slow
def test_output_and_patches_past_their_limits_cost_no_memory_and_leave_no_data(tasks, tmp_path):
    """A session printing 500 MB and one leaving a 3 MB patch, at --limits.output 64k and --limits.patch 1m: the
    logs keep the tails and the sizes, the patch is not taken, and the rollout's memory never holds the output."""
    printed = 500_000_000  # the rollout itself is about 220 MB
    loud = f"head -c {printed} /dev/zero | tr '\\0' x; head -c 1000000 /dev/zero | tr '\\0' y >&2"
    big = "head -c 2300000 /dev/urandom | base64 > big.txt"
    save = tmp_path / "tasks.jsonl"
    save.write_text("".join(json.dumps(tasks[name]) + "\n" for name in ("fixed", "wrong")))
    command = by_commit({"fixed": loud, "wrong": big}, tasks, "true") + "; : {instruction}"
    cli = [sys.executable, "-m", "eval", "rollout", "--tasks", str(save), "--harness", "shell", "--command", command]
    cli += ["--proxy", "http://127.0.0.1:9", "--no-proxy-check", "--out", str(tmp_path / "run")]
    cli += ["--limits.output", "64k", "--limits.patch", "1m"]
    with open(tmp_path / "rollout.log", "wb") as log:
        proc = subprocess.Popen(cli, stdout=log, stderr=subprocess.STDOUT)
        peak = peak_rss(proc)
    assert proc.wait() == 0, (tmp_path / "rollout.log").read_text()
    assert 0 < peak < printed * 0.7, f"the rollout peaked at {peak / 2**20:.0f} MiB"

    sessions = read_sessions(tmp_path / "run").sort("task_id")
    rows = {row["task_id"]: row for row in sessions.iter_rows(named=True)}
    loud_row, big_row = rows[tasks["fixed"]["instance_id"]], rows[tasks["wrong"]["instance_id"]]
    assert (loud_row["status"], loud_row["stdout_bytes"], loud_row["stderr_bytes"]) == ("no_edit", printed, 1_000_000)
    logs = tmp_path / "run" / "logs" / loud_row["session_id"]
    stdout = (logs / "stdout.txt").read_text()
    assert stdout.startswith(f"[polar: {printed} bytes of output, the last 65536 kept]\n")
    assert stdout.endswith("x" * 65536) and len(stdout) < 65536 + 100
    assert (logs / "stderr.txt").read_text().endswith("y" * 65536)
    assert big_row["status"] == "patch_too_large" and big_row["patch"] == ""
    assert big_row["error"] == "the patch is past --limits.patch (1048576 bytes); not taken"


def test_a_rerun_removes_what_a_killed_run_left_in_its_folder_and_only_that(tasks, tmp_path):
    """Workspace folders a ``kill -9`` left: a rerun into the same run folder removes its own, never another run
    folder's; two rollouts never write one folder at once."""
    out, other = tmp_path / "run", tmp_path / "other"
    out.mkdir()
    left = [Path(tempfile.mkdtemp(prefix=f"{rollout.WORK_PREFIX}{rollout.folder_label(run)}-")) for run in (out, other)]
    args = Args(
        tasks="toy", instance_ids=(tasks["fixed"]["instance_id"],), harness="shell", command="true {instruction}",
        proxy="http://127.0.0.1:9", out=out, proxy_check=False,
    )  # fmt: skip
    with rollout.folder_lock(out), pytest.raises(EvalError, match="another rollout is writing this run folder"):
        main(args)
    assert all(folder.is_dir() for folder in left)
    assert main(args) == 0
    assert not left[0].exists() and left[1].is_dir()
    left[1].rmdir()


def test_limits_name_the_flag_and_what_was_expected():
    with pytest.raises(ValueError, match=r"--limits.disk: expected a size such as 512k, 16m or 10g, got 'lots'"):
        Limits(disk="lots")
    with pytest.raises(ValueError, match=r"--limits.patch: expected a positive size, got '0'"):
        Limits(patch="0")
    assert Limits(output="64k").size("output") == 65536 and Limits().size("disk") == 10 * 2**30
    assert Limits(memory="1.5g").size("memory") == 3 * 2**29 and Limits(patch="512").size("patch") == 512
