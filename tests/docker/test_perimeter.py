"""The perimeter around a docker session (docs/runtimes.md, "What holds"): what a session writes, prints and leaves
in its patch is bounded; it runs without privilege, and what a kept workspace gives back cannot be one; and a
rerun into a run folder removes what a ``kill -9`` of the rollout left there, and nothing of another run's.

Each session is the ``shell`` harness: its command line runs in the container, no model call made (the relay
carries to a port where nothing listens).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from eval.runs import read_sessions
from eval.sessions import rollout
from eval.sessions.containers import docker
from eval.sessions.runtime import FOLDER_LABEL, SESSION_LABEL, SOCKET_PREFIX
from eval.tasks.load import save_tasks
from tests.eval.test_rollout import by_commit, peak_rss

NOWHERE = "http://127.0.0.1:9"


def shell_rollout(tasks: list[dict[str, Any]], command: str, out: Path, **options: Any) -> pl.DataFrame:
    save_tasks(tasks, out.parent / f"{out.name}-tasks.jsonl")
    args = rollout.Args(
        tasks=str(out.parent / f"{out.name}-tasks.jsonl"), harness="shell", command=command, proxy=NOWHERE, out=out,
        runtime="docker", proxy_check=False, timeout=options.pop("timeout", 120), **options,
    )  # fmt: skip
    assert rollout.main(args) == 0
    return read_sessions(out)


@pytest.fixture(scope="module")
def rooted(family_images):
    """The first family task in an image whose user is root, as SWE-bench's images are."""
    tag = "polar-test/rooted:1"
    dockerfile = f"FROM {family_images[0]['image']}\nUSER root\n"
    docker("build", "-q", "-t", tag, "-", input=dockerfile.encode())
    yield {**family_images[0], "instance_id": "rooted__rooted-1", "repo": "rooted/rooted", "image": tag}
    docker("rmi", "-f", tag, check=False)


PLANT = """
echo "user: $(id -un) $(grep CapEff /proc/self/status)"
for d in "$HOME" /testbed; do
    cp /bin/bash "$d/suid-bash" && chmod 6755 "$d/suid-bash"
    mkfifo "$d/fifo"
    ln -s /etc/shadow "$d/shadow"
    ln -s ../.. "$d/up"
    ln -s suid-bash "$d/inside"
    mknod "$d/disk" b 8 0 2>/dev/null && echo "made a device node" || echo "mknod refused"
done
: {instruction}
"""


@pytest.mark.parametrize("user", ["polar", "root"])
def test_a_kept_workspace_gives_back_no_privilege_and_the_session_holds_none(user, family_images, rooted, tmp_path):
    """A session plants a setuid/setgid copy of bash, a FIFO, links out of its folder and a device node in HOME and
    /testbed, kept with --keep-workspaces: in our images it runs as an unprivileged user with no capability; as root
    (an image that asks for it) with only CHOWN, DAC_OVERRIDE and FOWNER, so no device node. What comes back is the
    caller's plain files: no setuid or setgid bit, no FIFO or device, no link that leaves its folder."""
    task = family_images[0] if user == "polar" else rooted
    out = tmp_path / "run"
    sessions = shell_rollout([task], PLANT, out, keep_workspaces=True)
    (row,) = sessions.iter_rows(named=True)
    assert row["status"] == "ok", row["error"]
    kept = out / "workspaces" / row["session_id"]
    said = (out / "logs" / row["session_id"] / "stdout.txt").read_text()
    capabilities = "0000000000000000" if user == "polar" else "000000000000000b"  # CHOWN | DAC_OVERRIDE | FOWNER
    assert f"user: {user} CapEff:\t{capabilities}" in said, said
    assert said.count("mknod refused") == 2, said

    for folder in (kept / "repo", kept / "home"):
        assert (folder / "suid-bash").is_file() and (folder / "inside").is_symlink()
        for path in folder.rglob("*"):
            mode = path.lstat().st_mode
            assert stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode), path
            assert not mode & (stat.S_ISUID | stat.S_ISGID), path
            assert path.lstat().st_uid == os.getuid(), path  # the caller's, whoever owned it in the container
            if path.is_symlink():
                assert path.resolve().is_relative_to(folder.resolve()), path
    left_out = (kept / "left-out.txt").read_text()
    for top in ("testbed", "home"):
        for name in ("fifo", "shadow", "up"):
            assert f"{top}/{name}: " in left_out, left_out
    assert not docker("ps", "-aq", "--filter", f"label={SESSION_LABEL}={row['session_id']}").stdout.strip()


DISK = "head -c 400000000 /dev/zero > /tmp/fill; sleep 60"
LOUD = "head -c 500000000 /dev/zero | tr '\\0' x; head -c 1000000 /dev/zero | tr '\\0' y >&2"
BIG_PATCH = "head -c 2300000 /dev/urandom | base64 > big.txt"


def test_disk_output_and_patch_are_bounded_and_the_rollout_holds_none_of_them(family_images, tmp_path):
    """Three sessions at --limits.disk 100m, --limits.output 64k, --limits.patch 1m: one fills /tmp (ended by the
    watchdog, well before its sleep ends), one prints 500 MB (kept: the tails and the sizes), one leaves a 3 MB
    patch (patch_too_large, no patch). The rollout process never holds what they wrote or printed."""
    tasks = {str(i): task for i, task in enumerate(family_images)}
    command = by_commit({"0": DISK, "1": LOUD, "2": BIG_PATCH}, tasks, "true") + "; : {instruction}"
    save_tasks(family_images, tmp_path / "tasks.jsonl")
    out = tmp_path / "run"
    cli = [sys.executable, "-m", "eval", "rollout", "--tasks", str(tmp_path / "tasks.jsonl"), "--harness", "shell"]
    cli += ["--command", command, "--proxy", NOWHERE, "--no-proxy-check", "--out", str(out), "--runtime", "docker"]
    cli += ["--concurrency", "3", "--timeout", "240"]
    cli += ["--limits.disk", "100m", "--limits.output", "64k", "--limits.patch", "1m"]
    with open(tmp_path / "rollout.log", "wb") as log:
        proc = subprocess.Popen(cli, stdout=log, stderr=subprocess.STDOUT)
        peak = peak_rss(proc)
    assert proc.wait() == 0, (tmp_path / "rollout.log").read_text()
    assert 0 < peak < 350 * 2**20, f"the rollout peaked at {peak / 2**20:.0f} MiB"

    rows = {row["task_id"]: row for row in read_sessions(out).iter_rows(named=True)}
    disk, loud, big = (rows[tasks[k]["instance_id"]] for k in ("0", "1", "2"))
    assert disk["status"] == "crashed" and disk["error"].startswith("ended at --limits.disk 100m: "), disk["error"]
    assert disk["duration_s"] < 200  # the watchdog, not the timeout, ended it
    assert (loud["status"], loud["stdout_bytes"], loud["stderr_bytes"]) == ("no_edit", 500_000_000, 1_000_000)
    stdout = (out / "logs" / loud["session_id"] / "stdout.txt").read_text()
    assert stdout.startswith("[polar: 500000000 bytes of output, the last 65536 kept]\n") and len(stdout) < 65700
    assert (big["status"], big["patch"]) == ("patch_too_large", "")


def test_a_rerun_removes_what_a_killed_rollout_left_in_its_folder_and_nothing_of_another(family_images, tmp_path):
    """kill -9 of a rollout while its session sleeps leaves its container, its relay's socket folder and its
    workspaces. The next rollout into the same folder removes them before it starts; another folder's container
    (here a stand-in with that folder's label) stays."""
    out = tmp_path / "killed-run"
    folder = rollout.folder_label(out)
    other = docker(
        "run", "-d", "--label", f"{FOLDER_LABEL}={rollout.folder_label(tmp_path / 'another-run')}",
        "--entrypoint", "sleep", family_images[0]["image"], "600",
    ).stdout.decode().strip()  # fmt: skip
    try:
        save_tasks(family_images[:1], tmp_path / "tasks.jsonl")
        cli = [sys.executable, "-m", "eval", "rollout", "--tasks", str(tmp_path / "tasks.jsonl"), "--harness", "shell"]
        cli += ["--command", "touch /tmp/asleep; sleep 600; : {instruction}", "--proxy", NOWHERE, "--no-proxy-check"]
        cli += ["--out", str(out), "--runtime", "docker", "--timeout", "600"]

        def ours() -> list[str]:
            return docker("ps", "-aq", "--filter", f"label={FOLDER_LABEL}={folder}").stdout.decode().split()

        proc = subprocess.Popen(cli, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 300
        while not any(_asleep(cid) for cid in ours()):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        (container,) = ours()
        config = json.loads(docker("inspect", "--format", "{{json .HostConfig}}", container).stdout)
        assert config["CapDrop"] == ["ALL"] and config["SecurityOpt"] == ["no-new-privileges"]
        assert config["LogConfig"] == {"Type": "json-file", "Config": {"max-file": "1", "max-size": "1m"}}
        proc.kill()
        proc.wait()
        tmp = Path("/tmp")
        left = [*tmp.glob(f"{rollout.WORK_PREFIX}{folder}-*"), *tmp.glob(f"{SOCKET_PREFIX}{folder}-*")]
        assert len(left) == 2 and ours() == [container]  # what kill -9 left

        sessions = shell_rollout(family_images[:1], "true {instruction}", out)
        assert sessions["status"].to_list() == ["no_edit"]
        assert ours() == [] and not any(path.exists() for path in left)
        assert docker("inspect", "--format", "{{.State.Running}}", other).stdout.strip() == b"true"
    finally:
        docker("rm", "-f", other, check=False)


def _asleep(container: str) -> bool:
    return docker("exec", container, "test", "-e", "/tmp/asleep", check=False).returncode == 0
