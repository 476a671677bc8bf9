"""SWE-bench-style tasks for ``python -m eval``: the shipped toy suite, the generated family, local instance
files, and checkouts.

    from eval.tasks.load import load_tasks, checkout
    tasks = load_tasks("toy")                                    # the shipped suite, eval/tasks/toy/<name>/
    tasks = load_tasks("family:heldout")                         # generated (eval/tasks/family.py); family:train@1
    tasks = load_tasks("runs/r1/tasks.jsonl", ["polar-toy__pager-1"])  # or .json / .parquet / a hub dataset
    repo = checkout(tasks[0], Path("/tmp/ws"))                   # git working tree at base_commit

Instances have the SWE-bench 5.x shape: the ``SWEbenchInstance`` fields plus what ``make_test_spec`` needs
(``image, log_parser, eval_type, eval_script``). Every spec goes through swebench's own
``load_swebench_dataset``; ``"toy"`` and ``"family..."`` are first written to a temporary JSONL for it. A toy or
generated task's ``image`` is ``<repo>:<base_commit[:12]>``, which ``python -m eval images build`` makes
(eval/sessions/images.py); other instances name their own (SWE-bench's on Docker Hub).

The toy suite: each ``eval/tasks/toy/<name>/`` holds ``repo/`` (the repository at ``base_commit``, as plain files),
``gold.patch`` (the reference fix), ``test.patch`` (the tests that check it) and ``task.json`` (issue text,
hints, ``FAIL_TO_PASS``/``PASS_TO_PASS``, ``base_commit``). ``checkout`` commits ``repo/`` with a fixed author,
committer, dates and no user or system git config, so the commit hash is the same everywhere and equals the
stored ``base_commit``. Its eval script runs pytest with ``"${PYTHON:-python}"``: the caller exports
``PYTHON`` (eval/score.py exports the interpreter it runs under), inside an image plain ``python`` is used.

The generated family (repo ``polar-gen/<module>``) is made from its seed at run time: ``checkout`` writes a
task's files again from its instance id (``taskgen.repo_files``) and commits them the same way.

Other repositories are cloned from ``$POLAR_REPOS/<owner>__<name>.git`` (a bare or normal clone, e.g.
``git clone --mirror https://github.com/astropy/astropy $POLAR_REPOS/astropy__astropy.git``), else from
``https://github.com/<owner>/<name>`` when GitHub is reachable.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from swebench.harness.constants import EvalType
from swebench.harness.log_parsers import PARSER_REGISTRY
from swebench.harness.utils import load_swebench_dataset

from eval.tasks import family as taskgen
from eval.tasks.instances import TaskError, eval_script, git, image_tag, write_repo

__all__ = [
    "FAMILY",
    "OURS",
    "TOY_DIR",
    "TOY_REPO_OWNER",
    "TaskError",
    "checkout",
    "family_instances",
    "load_tasks",
    "save_tasks",
    "toy_instances",
]

TOY_DIR = Path(__file__).resolve().parent / "toy"
TOY_REPO_OWNER = "polar-toy"  # toy instances have repo "polar-toy/<name>", instance_id "polar-toy__<name>-1"
OURS = (taskgen.OWNER, TOY_REPO_OWNER)  # repository owners whose images `python -m eval images build` makes

# SWEbenchInstance's fields, then what swebench 5.x make_test_spec reads.
REQUIRED_FIELDS = (
    "instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement", "hints_text",
    "created_at", "version", "FAIL_TO_PASS", "PASS_TO_PASS", "environment_setup_commit",
    "image", "log_parser", "eval_type", "eval_script",
)  # fmt: skip
TEST_LISTS = ("FAIL_TO_PASS", "PASS_TO_PASS")

# The fields that name host folders, checkouts, containers and images, by strict grammars: none can climb out of a
# folder (no "/" in an id, no component starting with "."), pass for a flag (no leading "-") or take another's name.
_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"  # Docker's reference grammar (distribution/reference)
_DOMAIN = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*(?::[0-9]+)?/)"
GRAMMARS = {
    "instance_id": (re.compile(_NAME), "letters, digits, '_', '.', '-', starting with a letter or digit"),
    "repo": (re.compile(rf"{_NAME}/{_NAME}"), "OWNER/NAME, each letters, digits, '_', '.', '-'"),
    "base_commit": (re.compile(r"[0-9a-f]{40}"), "a full 40-hex-digit commit"),
    "image": (
        re.compile(
            rf"{_DOMAIN}?{_COMPONENT}(?:/{_COMPONENT})*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?(?:@sha256:[0-9a-f]{{64}})?"
        ),
        "a Docker image reference: [REGISTRY/]lowercase/path[:TAG][@sha256:DIGEST]",
    ),
}
RESERVED_IMAGES = ("polar-base", "polar-env")  # eval/sessions/images.py's layers: a task never names (or re-tags) them

FAMILY = "family"  # load_tasks("family[:train|:heldout][@SEED]"): the generated family (eval/tasks/family.py)


def load_tasks(
    spec: str | Path, instance_ids: Sequence[str] | None = None, *, check: bool = True
) -> list[dict[str, Any]]:
    """Instances of ``spec`` (``"toy"``, ``"family[:train|:heldout][@SEED]"``, a .json/.jsonl/.parquet file, or a
    hub dataset name), validated, with
    FAIL_TO_PASS/PASS_TO_PASS as lists; only ``instance_ids`` when given (all of them must exist).
    ``check=False`` returns them as loaded, for callers that check each one alone (``grade`` scores a broken
    instance ``eval_error`` instead of refusing the whole run)."""
    if str(spec) == "toy" or str(spec).startswith(FAMILY):
        instances = toy_instances() if str(spec) == "toy" else family_instances(str(spec))
        with tempfile.TemporaryDirectory(prefix="polar-tasks-") as tmp:
            return _load(save_tasks(instances, Path(tmp) / "tasks.jsonl"), instance_ids, str(spec), check)
    return _load(spec, instance_ids, str(spec), check)


def family_instances(spec: str) -> list[dict[str, Any]]:
    """The generated family's instances named by ``spec``: ``family`` (both splits, training first),
    ``family:train`` or ``family:heldout``, each optionally ``@SEED`` (default 0), at the default sizes."""
    match = re.fullmatch(rf"{FAMILY}(?::(train|heldout))?(?:@(\d+))?", spec)
    if not match:
        raise TaskError(f"{spec}: expected {FAMILY}, {FAMILY}:train or {FAMILY}:heldout, optionally with @SEED")
    split, seed = match.group(1), int(match.group(2) or 0)
    family = taskgen.generate(seed)
    return [t for name in taskgen.SPLITS if split in (None, name) for t in family[name]]


def _load(spec: str | Path, instance_ids: Sequence[str] | None, source: str, check: bool) -> list[dict[str, Any]]:
    try:
        instances = load_swebench_dataset(str(spec), instance_ids=list(instance_ids) if instance_ids else None)
    except Exception as e:  # the loader raises anything from FileNotFoundError to hub connection errors
        raise TaskError(
            f"{source}: cannot load tasks ({type(e).__name__}: {e}); expected 'toy', a .json/.jsonl/.parquet "
            "file of SWE-bench instances, or a dataset name reachable on the Hugging Face hub"
        ) from e
    return [validate(dict(instance), source) if check else dict(instance) for instance in instances]


def validate(instance: dict[str, Any], source: str) -> dict[str, Any]:
    """``instance`` with its test lists as lists; TaskError naming ``source``, the instance and the field."""
    name = f"{source}: instance {instance.get('instance_id', '<no instance_id>')!r}"
    missing = [field for field in REQUIRED_FIELDS if instance.get(field) is None]
    if missing:
        raise TaskError(f"{name}: missing field(s) {missing}; a SWE-bench 5.x instance needs {list(REQUIRED_FIELDS)}")
    for field, (grammar, expected) in GRAMMARS.items():
        value = instance[field]
        if not isinstance(value, str) or not grammar.fullmatch(value) or ".." in value:
            raise TaskError(f"{name}: {field} {value!r} is not {expected}")
    image, repo = instance["image"], instance["repo"]
    if image.split(":")[0].split("@")[0] in RESERVED_IMAGES:
        raise TaskError(f"{name}: image {image!r} is one of our own layers {list(RESERVED_IMAGES)}")
    if (repo.partition("/")[0] in OURS or image.partition("/")[0] in OURS) and image != (
        own := image_tag(repo, instance["base_commit"])
    ):
        # images build tags what it builds for our repositories with the task's image: no other task's name
        raise TaskError(f"{name}: image {image!r} must be {own!r}, the image built for {repo} at its base_commit")
    out = dict(instance)
    for field in TEST_LISTS:
        value = instance[field]
        try:
            value = json.loads(value) if isinstance(value, str) else list(value)
        except (json.JSONDecodeError, TypeError) as e:
            raise TaskError(f"{name}: {field} must be a list of test ids or its JSON text: {e}") from e
        if not all(isinstance(test, str) for test in value):
            raise TaskError(f"{name}: {field} must be a list of test id strings, got {value!r}")
        out[field] = value
    if instance["log_parser"] not in PARSER_REGISTRY:
        raise TaskError(f"{name}: log_parser {instance['log_parser']!r} is not a swebench parser name")
    if instance["eval_type"] not in {t.value for t in EvalType}:
        raise TaskError(f"{name}: eval_type {instance['eval_type']!r}, expected one of {[t.value for t in EvalType]}")
    return out


def save_tasks(tasks: Iterable[dict[str, Any]], path: Path) -> Path:
    """Write instances as JSON lines (the run folder's tasks.jsonl); ``load_tasks(path)`` reads them back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(task, ensure_ascii=False) + "\n" for task in tasks))
    return path


def toy_instances() -> list[dict[str, Any]]:
    """The shipped suite as SWE-bench 5.x instances, sorted by instance_id."""
    instances = [toy_instance(folder) for folder in TOY_DIR.iterdir() if folder.is_dir()]
    return sorted(instances, key=lambda t: t["instance_id"])


def toy_instance(folder: Path) -> dict[str, Any]:
    meta = json.loads((folder / "task.json").read_text())
    test_patch = (folder / "test.patch").read_text()
    instance = {
        "instance_id": meta["instance_id"],
        "repo": f"{TOY_REPO_OWNER}/{folder.name}",
        "base_commit": meta["base_commit"],
        "patch": (folder / "gold.patch").read_text(),
        "test_patch": test_patch,
        "problem_statement": meta["problem_statement"],
        "hints_text": meta["hints_text"],
        "created_at": meta["created_at"],
        "version": meta["version"],
        "FAIL_TO_PASS": meta["FAIL_TO_PASS"],
        "PASS_TO_PASS": meta["PASS_TO_PASS"],
        "environment_setup_commit": meta["base_commit"],
        # Content-named: `python -m eval images build` makes it (eval/sessions/images.py); the local runner needs none.
        "image": image_tag(f"{TOY_REPO_OWNER}/{folder.name}", meta["base_commit"]),
        "log_parser": "parse_log_pytest",
        "eval_type": EvalType.PASS_AND_FAIL.value,
        "eval_script": eval_script(meta["base_commit"], test_patch),
    }
    return validate(instance, str(folder / "task.json"))


def checkout(task: dict[str, Any], dest: Path) -> Path:
    """A git working tree of the task's repository at ``base_commit`` in ``dest`` (absent or empty)."""
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise TaskError(f"{dest}: checkout destination is not empty")
    iid = task.get("instance_id")
    repo, base = task.get("repo"), task.get("base_commit")
    if not repo or not base:
        raise TaskError(f"instance {iid!r}: checkout needs the fields 'repo' and 'base_commit'")
    owner, _, name = repo.partition("/")
    if owner == TOY_REPO_OWNER:
        _build_toy(name, dest, iid)
    elif owner == taskgen.OWNER:
        write_repo(taskgen.repo_files(str(iid)), dest, f"{name}: generated task base")
    else:
        _clone(repo, dest, iid)
        git(["-c", "advice.detachedHead=false", "checkout", "-q", base], dest, f"instance {iid!r}: checkout {base}")
    head = git(["rev-parse", "HEAD"], dest, "rev-parse").strip()
    if head != base:
        raise TaskError(f"instance {iid!r}: checked-out commit {head} differs from base_commit {base}")
    return dest


def _build_toy(name: str, dest: Path, iid: str | None) -> None:
    source = TOY_DIR / name / "repo"
    if not source.is_dir():
        raise TaskError(f"instance {iid!r}: no toy repository at {source}")
    files = {
        str(path.relative_to(source)): path.read_bytes()
        for path in sorted(source.rglob("*"))
        # Byte-compiled leftovers of someone running the toy tests in place are not part of the repository.
        if path.is_file() and not {"__pycache__", ".pytest_cache"} & set(path.relative_to(source).parts)
    }
    write_repo(files, dest, f"{name}: toy task base")


def _clone(repo: str, dest: Path, iid: str | None) -> None:
    mirrors = os.environ.get("POLAR_REPOS")
    local = Path(mirrors) / f"{repo.replace('/', '__')}.git" if mirrors else None
    source = str(local) if local and local.exists() else f"https://github.com/{repo}"
    try:
        git(["clone", "-q", "--no-checkout", source, str(dest)], Path.cwd(), f"clone {source}")
    except TaskError as e:
        where = f"$POLAR_REPOS/{repo.replace('/', '__')}.git" + ("" if mirrors else " (POLAR_REPOS is not set)")
        raise TaskError(f"instance {iid!r}: cannot get repository {repo}: no mirror at {where}, and {e}") from e
