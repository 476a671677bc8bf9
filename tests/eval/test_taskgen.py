"""eval/tasks/family.py, the generated task family: deterministic from its seed, split by construction and checked so,
each instance valid under swebench's grading, its teacher's sed the gold fix."""

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from eval.tasks import family as taskgen
from eval.tasks.cli import check_instance, sample
from eval.tasks.instances import TaskError
from eval.tasks.load import checkout, load_tasks

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def family() -> dict[str, list[dict]]:
    return taskgen.generate(0)


def test_the_same_seed_makes_the_same_family_and_another_seed_another(family):
    taskgen.make.cache_clear()  # made again from scratch, not read back from the cache
    again = taskgen.generate(0)
    assert again == family
    other = taskgen.generate(1)
    assert [t["instance_id"] for t in other["train"]] != [t["instance_id"] for t in family["train"]]
    assert {t["instance_id"].rsplit("-", 1)[1] for t in other["heldout"]} == {"1"}


def test_the_family_has_every_kind_and_style_in_both_splits(family):
    assert (len(family["train"]), len(family["heldout"])) == (128, 64)
    for split, tasks in family.items():
        assert len({t["instance_id"] for t in tasks}) == len(tasks)
        assert set(Counter(t["bug_kind"] for t in tasks)) == set(taskgen.KINDS), split
        styles = Counter(t["issue_style"] for t in tasks)  # halves and quarters, within one cycle's shift
        assert abs(styles["diagnosed"] - len(tasks) / 2) <= 2 and abs(styles["symptom"] - len(tasks) / 4) <= 2
        assert abs(sum(not t["names_file"] for t in tasks) - len(tasks) / 4) <= 2
        assert {t["split"] for t in tasks} == {split}
        # every kind meets an issue that does not name the file
        assert {t["bug_kind"] for t in tasks if not t["names_file"]} == set(taskgen.KINDS)


def test_issues_name_the_file_only_when_they_say_so_and_diagnosed_ones_quote_the_teachers_sed(family):
    for task in family["train"] + family["heldout"]:
        edit = taskgen.sed_edit(task)
        assert (f"`{edit.path}`" in task["problem_statement"]) == task["names_file"], task["instance_id"]
        quoted = f"`{edit.old}` should be `{edit.new}`" in task["problem_statement"]
        assert quoted == (task["issue_style"] == "diagnosed"), task["instance_id"]
        assert task["FAIL_TO_PASS"] and task["PASS_TO_PASS"]
        assert not set(task["FAIL_TO_PASS"]) & set(task["PASS_TO_PASS"])


def test_the_splits_share_no_module_identifier_or_value(family):
    words = {s: [taskgen.words_of(t["instance_id"]) for t in family[s]] for s in taskgen.SPLITS}
    taskgen.check_disjoint(words)  # as generate() does
    # One training instance's names and values injected into the held-out split: the check refuses it.
    injected = {"train": words["train"], "heldout": [*words["heldout"], words["train"][5]]}
    with pytest.raises(TaskError, match=r"share modules .*identifiers .*values"):
        taskgen.check_disjoint(injected)


def test_generation_refuses_word_lists_that_overlap(monkeypatch):
    for kind in ("adjective", "noun"):  # the held-out split drawing its names from the training lists
        monkeypatch.setitem(taskgen.WORDS["heldout"], kind, taskgen.WORDS["train"][kind])
    taskgen.make.cache_clear()
    taskgen._modules.cache_clear()
    try:
        with pytest.raises(TaskError, match="share modules"):
            taskgen.generate(7)
    finally:
        taskgen.make.cache_clear()
        taskgen._modules.cache_clear()


def test_load_tasks_reads_each_split_and_checkout_builds_the_stored_commit(family, tmp_path):
    heldout = load_tasks("family:heldout")
    assert [t["instance_id"] for t in heldout] == [t["instance_id"] for t in family["heldout"]]
    assert len(load_tasks("family")) == 192 and len(load_tasks("family:train@1")) == 128
    with pytest.raises(TaskError, match="family:train or family:heldout"):
        load_tasks("family:test")
    task = heldout[3]
    repo = checkout(task, tmp_path / "repo")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True)
    assert head.stdout.strip() == task["base_commit"]
    assert taskgen.instance_split(task["instance_id"]) == "heldout"


def test_the_teachers_session_is_the_sed_then_an_answer(family):
    task = family["train"][0]
    call, answer = taskgen.teacher_messages(task)
    assert call["tool_calls"][0]["arguments"]["command"] == taskgen.sed_edit(task).command()
    assert call["tool_calls"][0]["arguments"]["command"].startswith("sed -i 's/")
    assert answer["tool_calls"] == [] and answer["content"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_sample_of_each_kind_is_valid_under_swebench(family, tmp_path):
    tasks = sample(family, per_kind=1)
    assert len(tasks) == 2 * len(taskgen.KINDS)
    for task in tasks:
        assert check_instance(task, tmp_path / task["instance_id"]) == [], task["instance_id"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_validation_refuses_an_instance_whose_gold_patch_does_not_fix_it(family, tmp_path):
    task = dict(family["train"][1])
    broken = task["patch"].replace("+    return price", "+    return 0 * price")  # a fix that fixes nothing
    problems = check_instance({**task, "patch": broken}, tmp_path)
    assert "the gold patch does not resolve it" in problems
    assert any("with the gold patch: FAIL_TO_PASS" in p for p in problems)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_export_writes_jsonl_and_bare_repos_at_the_base_commit(tmp_path):
    out = tmp_path / "family"
    cmd = [sys.executable, "-m", "eval", "tasks", "export", "--out", str(out), "--train", "2", "--heldout", "1"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    train = load_tasks(out / "family-train.jsonl")
    assert len(train) == 2 and len(load_tasks(out / "family-heldout.jsonl")) == 1
    bare = out / "repos" / f"{train[0]['repo'].replace('/', '__')}.git"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=bare, capture_output=True, text=True, check=True)
    assert head.stdout.strip() == train[0]["base_commit"]
    listing = subprocess.run([sys.executable, "-m", "eval", "tasks", "list"], cwd=ROOT, capture_output=True, text=True)
    assert listing.returncode == 0 and "heldout: 64 instances" in listing.stdout
