"""``python -m eval tasks``: list, validate and export the generated task family (eval/tasks/family.py).

    python -m eval tasks list [--seed 0]                      # one line per instance, then counts per split
    python -m eval tasks validate [--per-kind 2] [--seed 0]   # swebench-graded before/after check of a sample
    python -m eval tasks export --out runs/family [--seed 0]  # SWE-bench JSONL per split + bare git repos

``validate`` grades each instance twice with eval/score.py's ``grade`` (swebench's own report): the test patch
alone (the base code) must leave every FAIL_TO_PASS test failing and every PASS_TO_PASS test passing, the gold
patch must resolve it; and the teacher's sed, run by the real ``sed`` on a checkout, must change the file exactly
as the gold patch does. ``--per-kind 0`` validates the whole family (192 instances: a few minutes on 2 cores).

``export`` writes ``family-train.jsonl`` and ``family-heldout.jsonl`` (``load_tasks`` and swebench read them), and
``repos/polar-gen__<module>.git``, a bare repository per instance at its ``base_commit``: point
``$POLAR_REPOS`` at it for tools that clone, e.g. on a GPU machine without this package's generator.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from eval.score import grade
from eval.tasks import family as taskgen
from eval.tasks.instances import git
from eval.tasks.load import checkout, save_tasks, validate

__all__ = ["Args", "Export", "List", "Validate", "check_instance", "main", "sample"]


@dataclasses.dataclass
class List:
    """One line per instance of the family: id, split, bug kind, issue style, whether the issue names the file."""

    seed: int = 0
    """The family's seed."""
    train: int = taskgen.SIZES["train"]
    """Training instances."""
    heldout: int = taskgen.SIZES["heldout"]
    """Held-out instances."""


@dataclasses.dataclass
class Validate(List):
    """Grade a sample of the family before and after its gold patch, and run its teacher's sed."""

    per_kind: int = 2
    """Instances of each bug kind in each split to check; 0: every instance."""
    concurrency: int = 2
    """Instances checked at once."""
    timeout: float = 120.0
    """Seconds one eval script may run."""


@dataclasses.dataclass
class Export(List):
    """Write the family as SWE-bench JSONL, one file per split, and a bare git repository per instance."""

    out: Path = Path("runs/family")
    """Folder to write into."""
    repos: bool = True
    """Also write repos/<owner>__<name>.git for $POLAR_REPOS."""


Args = List | Validate | Export


def sample(family: dict[str, list[dict[str, Any]]], per_kind: int) -> list[dict[str, Any]]:
    """The first ``per_kind`` instances of each bug kind in each split (all of them at 0), in family order."""
    taken: Counter[tuple[str, str]] = Counter()
    chosen = []
    for split in taskgen.SPLITS:
        for task in family[split]:
            key = (split, task["bug_kind"])
            if per_kind == 0 or taken[key] < per_kind:
                taken[key] += 1
                chosen.append(task)
    return chosen


def check_instance(task: dict[str, Any], work: Path, timeout: float = 120.0) -> list[str]:
    """What is wrong with one instance (empty when valid): FAIL_TO_PASS must fail before the gold patch and
    pass after it, PASS_TO_PASS pass both times, as swebench grades them; the teacher's sed must make the gold fix."""
    task = validate(task, "family")
    problems = []
    before = grade(task, task["test_patch"], timeout=timeout, log_dir=work / "before")
    after = grade(task, task["patch"], timeout=timeout, log_dir=work / "gold")
    checks = (("before the gold patch", before, "failure"), ("with the gold patch", after, "success"))
    for name, result, f2p in checks:
        status = (result.report or {}).get("tests_status")
        if result.reason != "graded" or status is None:
            problems.append(f"{name}: not graded ({result.reason}; see {work})")
            continue
        if status["FAIL_TO_PASS"][f2p] != task["FAIL_TO_PASS"]:
            problems.append(f"{name}: FAIL_TO_PASS {f2p} is {status['FAIL_TO_PASS'][f2p]}, expected all of them")
        if status["PASS_TO_PASS"]["success"] != task["PASS_TO_PASS"]:
            problems.append(f"{name}: PASS_TO_PASS passing is {status['PASS_TO_PASS']['success']}, expected all")
    if not after.resolved:
        problems.append("the gold patch does not resolve it")
    edit = taskgen.sed_edit(task)
    repo = checkout(task, work / "teacher")
    original = (repo / edit.path).read_text()
    done = subprocess.run(edit.command(), shell=True, cwd=repo, capture_output=True, text=True, check=False)
    if done.returncode != 0 or (repo / edit.path).read_text() != edit.apply(original):
        problems.append(f"the teacher's sed ({edit.command()}) does not make the gold fix: {done.stderr.strip()}")
    return problems


def validate_family(tasks: list[dict[str, Any]], concurrency: int, timeout: float) -> dict[str, list[str]]:
    """Each task's problems (check_instance), by instance id; prints one line per invalid instance."""
    with tempfile.TemporaryDirectory(prefix="polar-family-") as tmp:

        def one(task: dict[str, Any]) -> tuple[str, list[str]]:
            return task["instance_id"], check_instance(task, Path(tmp) / task["instance_id"], timeout)

        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            return dict(pool.map(one, tasks))


def export(family: dict[str, list[dict[str, Any]]], out: Path, repos: bool) -> list[Path]:
    """Write the family's JSONL files (and bare repositories); the paths written."""
    written = [save_tasks(family[split], out / f"family-{split}.jsonl") for split in taskgen.SPLITS]
    if repos:
        with tempfile.TemporaryDirectory(prefix="polar-export-") as tmp:
            for task in (t for split in taskgen.SPLITS for t in family[split]):
                work = checkout(task, Path(tmp) / task["instance_id"])
                bare = out / "repos" / f"{task['repo'].replace('/', '__')}.git"
                if bare.exists():
                    raise FileExistsError(f"{bare}: already exported; give an empty --out")
                git(["clone", "-q", "--bare", str(work), str(bare)], Path(tmp), f"bare clone of {task['repo']}")
        written.append(out / "repos")
    return written


def main(command: Args) -> int:
    family = taskgen.generate(command.seed, {"train": command.train, "heldout": command.heldout})
    if isinstance(command, Validate):
        tasks = sample(family, command.per_kind)
        problems = validate_family(tasks, command.concurrency, command.timeout)
        bad = {iid: p for iid, p in problems.items() if p}
        for iid, found in bad.items():
            print(f"{iid}: " + "; ".join(found), file=sys.stderr)
        print(f"valid {len(tasks) - len(bad)}/{len(tasks)} (splits checked disjoint)")
        return 1 if bad else 0
    if isinstance(command, Export):
        for path in export(family, command.out, command.repos):
            print(f"wrote {path}")
        return 0
    for split in taskgen.SPLITS:
        for task in family[split]:
            named = "names the file" if task["names_file"] else "file not named"
            print(f"{task['instance_id']:<40} {split:<8} {task['bug_kind']:<15} {task['issue_style']:<10} {named}")
    for split in taskgen.SPLITS:
        kinds = Counter(t["bug_kind"] for t in family[split])
        styles = Counter(t["issue_style"] for t in family[split])
        print(f"{split}: {len(family[split])} instances; kinds {dict(kinds)}; styles {dict(styles)}")
    return 0
