"""What eval/tasks/load.py (loading, checkouts) and eval/tasks/family.py (the generated family) share: the fixed git
identity that makes a repository's commit hash the same everywhere, that hash computed without git, the eval
script every local instance runs, and a repository written from files and committed.

Kept apart from both so that tasks.py can build a generated task's repository with taskgen.py, and taskgen.py can
make instances the way tasks.py checks them, without either importing the other.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from swebench.harness.constants import END_TEST_OUTPUT, START_TEST_OUTPUT
from unidiff.patch import PatchSet

from eval.errors import EvalError

__all__ = ["GIT_ENV", "TaskError", "base_commit", "eval_script", "git", "image_tag", "write_repo"]

# A fixed identity and clock and no user/system config: the same files always give the same commit hash.
GIT_ENV = {
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "polar-rl toy suite",
    "GIT_AUTHOR_EMAIL": "toy@polar-rl.invalid",
    "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+00:00",
    "GIT_COMMITTER_NAME": "polar-rl toy suite",
    "GIT_COMMITTER_EMAIL": "toy@polar-rl.invalid",
    "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+00:00",
}
GIT_EPOCH = "1704067200 +0000"  # GIT_*_DATE as git stores it
HEREDOC = "EOF_POLAR_TEST_PATCH"


class TaskError(EvalError):
    """A task that cannot be loaded or checked out; the message names the file or instance and the field."""


def image_tag(repo: str, commit: str) -> str:
    """The ``image`` of a task we build ourselves (``python -m eval images build``, eval/sessions/images.py): the
    repository at its base commit, so the name changes whenever the checkout would."""
    return f"{repo}:{commit[:12]}"


def eval_script(base_commit: str, test_patch: str) -> str:
    """The swebench-style eval script, run from the repository root: reset the test files, apply the test
    patch, run pytest on them between the start/end markers (``-rA``: one status line per test for
    ``parse_log_pytest``), reset them again."""
    files = PatchSet(test_patch)
    existing = [f.path for f in files if not f.is_added_file]
    added = [f.path for f in files if f.is_added_file]
    reset = [f"git checkout {base_commit} -- {shlex.join(existing)}"] if existing else []
    reset += [f"rm -f {shlex.join(added)}"] if added else []
    test_files = [f.path for f in files if f.path.endswith(".py") and not f.is_removed_file]
    return "\n".join([
        "#!/bin/bash",
        "set -uxo pipefail",
        *reset,
        f"git apply -v - <<'{HEREDOC}'\n{test_patch.rstrip(chr(10))}\n{HEREDOC}",
        f": '{START_TEST_OUTPUT}'",
        f'"${{PYTHON:-python}}" -m pytest -rA -p no:cacheprovider {shlex.join(test_files)}',
        f": '{END_TEST_OUTPUT}'",
        *reset,
    ]) + "\n"  # fmt: skip


def _object(kind: str, body: bytes) -> bytes:
    return hashlib.sha1(f"{kind} {len(body)}\0".encode() + body).digest()


def _tree(files: Mapping[str, bytes]) -> bytes:
    """The tree object id of ``files`` (relative path -> content, mode 100644), as git computes it."""
    entries: dict[str, tuple[str, bytes]] = {}
    folders: dict[str, dict[str, bytes]] = {}
    for path, content in files.items():
        head, _, rest = path.partition("/")
        if rest:
            folders.setdefault(head, {})[rest] = content
        else:
            entries[head] = ("100644", _object("blob", content))
    for name, inner in folders.items():
        entries[name] = ("40000", _tree(inner))
    # git orders a tree's entries by name, a folder's name compared as if it ended in "/".
    order = sorted(entries, key=lambda n: n + "/" if entries[n][0] == "40000" else n)
    return _object("tree", b"".join(f"{entries[n][0]} {n}\0".encode() + entries[n][1] for n in order))


def base_commit(files: Mapping[str, str], message: str) -> str:
    """The hash ``write_repo(files, dest, message)`` commits, computed without git (pure, fast)."""
    tree = _tree({path: text.encode() for path, text in files.items()}).hex()
    author = f"{GIT_ENV['GIT_AUTHOR_NAME']} <{GIT_ENV['GIT_AUTHOR_EMAIL']}> {GIT_EPOCH}"
    committer = f"{GIT_ENV['GIT_COMMITTER_NAME']} <{GIT_ENV['GIT_COMMITTER_EMAIL']}> {GIT_EPOCH}"
    return _object("commit", f"tree {tree}\nauthor {author}\ncommitter {committer}\n\n{message}\n".encode()).hex()


def write_repo(files: Mapping[str, str | bytes], dest: Path, message: str) -> None:
    """``files`` (relative path -> content) written into ``dest`` and committed as one commit on ``main``."""
    dest.mkdir(parents=True, exist_ok=True)
    for relative, content in sorted(files.items()):
        path = dest / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        # Fresh files: mode 100644 in git whatever a source file's mode was.
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    git(["init", "-q", "-b", "main"], dest, "git init")
    git(["add", "-A"], dest, "git add")
    git(["commit", "-q", "--no-gpg-sign", "--no-verify", "-m", message], dest, "git commit")


def git(args: list[str], cwd: Path, what: str) -> str:
    """``git args`` in ``cwd`` with the fixed identity; TaskError saying ``what`` failed, with git's message."""
    if shutil.which("git") is None:
        raise TaskError("git is not on PATH; tasks are checked out with git")
    done = subprocess.run(
        ["git", *args], cwd=cwd, env={**os.environ, **GIT_ENV}, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise TaskError(f"{what} failed in {cwd} (git exit {done.returncode}): {done.stderr.strip()[-500:]}")
    return done.stdout
