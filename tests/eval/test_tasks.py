"""eval/tasks/load.py: the shipped toy suite, loading through swebench's loader, checkouts with stable hashes."""

import json
import os
import subprocess
import sys

import datasets.config
import polars as pl
import pytest
from swebench.harness.utils import make_test_spec

from eval.tasks.load import REQUIRED_FIELDS, TaskError, checkout, load_tasks, save_tasks, toy_instances


@pytest.fixture(scope="module")
def toy() -> list[dict]:
    return load_tasks("toy")


def test_toy_suite_has_swebench_shaped_instances(toy):
    assert len(toy) >= 8
    assert len({t["instance_id"] for t in toy}) == len(toy)
    for task in toy:
        assert set(REQUIRED_FIELDS) <= set(task)
        assert task["FAIL_TO_PASS"] and task["PASS_TO_PASS"], task["instance_id"]
        assert task["log_parser"] == "parse_log_pytest" and task["environment_setup_commit"] == task["base_commit"]
        spec = make_test_spec(task)
        assert task["FAIL_TO_PASS"] == spec.FAIL_TO_PASS
        assert '"${PYTHON:-python}" -m pytest -rA' in spec.eval_script
        assert spec.eval_script.index(">>>>> Start Test Output") < spec.eval_script.index(">>>>> End Test Output")


def test_problem_statements_do_not_give_the_fix_away(toy):
    for task in toy:
        lines = task["patch"].splitlines()
        added = [line[1:].strip() for line in lines if line.startswith("+") and not line.startswith("+++")]
        leaked = [line for line in added if len(line) > 12 and line in task["problem_statement"]]
        assert not leaked, (task["instance_id"], leaked)


def test_eval_script_removes_test_files_the_test_patch_adds(toy):
    (signals,) = [t for t in toy if t["instance_id"] == "polar-toy__signals-1"]
    script = signals["eval_script"]
    assert f"git checkout {signals['base_commit']} -- tests/test_bus.py" in script
    assert "rm -f tests/test_once.py" in script
    assert "tests/test_bus.py tests/test_once.py" in script  # both run


@pytest.mark.parametrize("instance", toy_instances(), ids=lambda t: t["instance_id"])
def test_checkout_builds_the_stored_base_commit(instance, tmp_path):
    repo = checkout(instance, tmp_path / "repo")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True)
    assert head.stdout.strip() == instance["base_commit"]
    status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, check=True)
    assert status.stdout == ""


def test_checkout_refuses_a_non_empty_destination(toy, tmp_path):
    (tmp_path / "stray").write_text("x")
    with pytest.raises(TaskError, match="not empty"):
        checkout(toy[0], tmp_path)


def test_checkout_clones_from_the_local_mirror_folder(toy, tmp_path, monkeypatch):
    source = checkout(toy[0], tmp_path / "source")
    mirrors = tmp_path / "mirrors"
    subprocess.run(["git", "clone", "-q", "--bare", str(source), str(mirrors / "acme__widgets.git")], check=True)
    task = {**toy[0], "repo": "acme/widgets"}
    monkeypatch.setenv("POLAR_REPOS", str(mirrors))
    repo = checkout(task, tmp_path / "clone")
    assert (repo / "pyproject.toml").exists()
    # No mirror, and GitHub refused without touching the network: the error says where it looked.
    monkeypatch.setenv("GIT_ALLOW_PROTOCOL", "file")
    with pytest.raises(TaskError, match=r"acme__gadgets\.git"):
        checkout({**task, "repo": "acme/gadgets"}, tmp_path / "missing")


def test_subset_and_unknown_ids(toy):
    assert [t["instance_id"] for t in load_tasks("toy", ["polar-toy__pager-1"])] == ["polar-toy__pager-1"]
    with pytest.raises(TaskError, match="polar-toy__nope-1"):
        load_tasks("toy", ["polar-toy__nope-1"])


def test_missing_field_names_the_file_instance_and_field(toy, tmp_path):
    broken = {k: v for k, v in toy[0].items() if k != "eval_script"}
    path = save_tasks([broken], tmp_path / "tasks.jsonl")
    with pytest.raises(TaskError, match=rf"{path}.*{toy[0]['instance_id']}.*'eval_script'"):
        load_tasks(path)
    assert load_tasks(path, check=False)[0]["instance_id"] == toy[0]["instance_id"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("instance_id", "../../../tmp/x"),
        ("instance_id", "-rf"),
        ("instance_id", "a/b"),
        ("repo", "polar-toy/../../../../../tmp/x"),
        ("repo", "/etc/passwd"),
        ("repo", "polar-toy/.hidden"),
        ("base_commit", "HEAD"),
        ("base_commit", "9eaa7574aa43"),
        ("image", "--privileged"),
        ("image", "Polar-Toy/confit:1"),
        ("image", "polar-env:0123456789ab"),
        ("image", "polar-base:bookworm-0123"),
        ("image", "polar-toy/../x:1"),
        ("image", "polar-toy/pager:9eaa7574aa43"),  # another task's image
        ("image", "debian:bookworm"),  # ours are built, under their own name
    ],
)
def test_a_field_outside_its_grammar_is_refused_naming_the_task_and_the_field(toy, tmp_path, field, value):
    path = save_tasks([{**toy[0], field: value}], tmp_path / "tasks.jsonl")
    with pytest.raises(TaskError, match=rf"{toy[0]['instance_id'] if field != 'instance_id' else ''}.*: {field} "):
        load_tasks(path)


def test_images_build_refuses_a_climbing_repo_before_any_daemon_call(toy, tmp_path):
    path = save_tasks([{**toy[0], "repo": "polar-toy/../../../../../tmp/x"}], tmp_path / "tasks.jsonl")
    env = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/no-daemon.sock"}  # nothing answers there
    done = subprocess.run(
        [sys.executable, "-m", "eval", "images", "build", "--tasks", str(path)],
        capture_output=True, text=True, env=env, check=False, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    assert "repo 'polar-toy/../../../../../tmp/x' is not OWNER/NAME" in done.stderr, done.stderr[-2000:]
    assert "no-daemon.sock" not in done.stderr  # refused at load, not by the daemon call


def test_test_lists_as_json_text_become_lists(toy, tmp_path):
    as_text = {**toy[0], "FAIL_TO_PASS": json.dumps(toy[0]["FAIL_TO_PASS"]), "PASS_TO_PASS": "[]"}
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps([as_text]))
    (loaded,) = load_tasks(path)
    assert loaded["FAIL_TO_PASS"] == toy[0]["FAIL_TO_PASS"] and loaded["PASS_TO_PASS"] == []


def test_parquet_goes_through_the_same_loader(toy, tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")  # not the user's cache
    pl.DataFrame(toy).write_parquet(tmp_path / "tasks.parquet")
    assert load_tasks(tmp_path / "tasks.parquet") == toy


def test_unloadable_spec_is_a_clear_error(tmp_path):
    with pytest.raises(TaskError, match=r"no-such\.jsonl.*expected 'toy'"):
        load_tasks(tmp_path / "no-such.jsonl")
