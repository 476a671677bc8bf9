"""eval/sessions/images.py against a real daemon: built from scratch once per run, a rebuild does nothing, swebench
grades the images (gold resolves, no fix does not), a missing image that is not ours fails naming it and the command
that gets it, and list and prune touch only images carrying our label."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker as docker_sdk
import polars as pl
import pytest
from rich.console import Console

from eval.score import grade_docker
from eval.sessions import images
from eval.sessions.containers import ContainerError, docker, image_config, image_exists
from eval.tasks.load import save_tasks
from tests.docker.conftest import REUSE, FamilyImages

UNFIX = (  # a patch that changes something, but fixes nothing
    "diff --git a/NOTES.md b/NOTES.md\nnew file mode 100644\nindex 0000000..8b13789\n"
    "--- /dev/null\n+++ b/NOTES.md\n@@ -0,0 +1 @@\n+notes\n"
)


def run_in(image: str, script: str) -> str:
    done = docker("run", "--rm", "--network", "none", image, "bash", "-c", script, timeout=120)
    return done.stdout.decode()


def foreign_image(tag: str) -> str:
    """A tiny image without our label (imported from one file)."""
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("hello.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"hi\n"))
    docker("import", "-", tag, input=buffer.getvalue())
    return tag


def test_built_from_scratch(family_images: FamilyImages) -> None:
    by_kind = {kind: [b for b in family_images.built if b.kind == kind] for kind in ("base", "env", "task")}
    print("\nfrom-scratch build:", f"{family_images.seconds:.1f} s")
    for b in family_images.built:
        print(f"  {b.kind:5} {b.image:45} {b.action:7} {b.seconds:6.2f} s")
    assert [len(by_kind[k]) for k in ("base", "env", "task")] == [1, 1, len(family_images)]
    if not REUSE:
        assert all(b.action == "built" for b in family_images.built)
    base, env = by_kind["base"][0].image, by_kind["env"][0].image
    assert base == images.debian_base().tag and env == images.env_layer(images.debian_base()).tag
    for task in family_images:
        config = image_config(task["image"])
        assert task["image"] == f"{task['repo']}:{task['base_commit'][:12]}"
        assert config["WorkingDir"] == "/testbed" and config["StopSignal"] == "SIGKILL"
        assert config["Env"][0].startswith("PATH=/opt/venv/bin:")
        labels = config["Labels"]
        assert labels["polar.image"] == "task" and labels["polar.from"] == env
        assert labels["polar.key"] == images.task_layer(images.env_layer(images.debian_base()), task).key
    task = family_images[0]
    out = run_in(task["image"], "pwd; git rev-parse HEAD; git status --porcelain | wc -l; python -m pytest --version")
    assert out.split() == ["/testbed", task["base_commit"], "0", "pytest", images.pytest_version()]
    # The host's CAs, copied at build time, are in the image's trust store; the tools swebench uses are there.
    cas = sorted(p.name for p in images.CA_DIR.glob("*.crt"))
    listed = run_in(task["image"], "ls /usr/local/share/ca-certificates; command -v git patch ps python3").split()
    assert set(cas) <= set(listed) and {"/usr/bin/git", "/usr/bin/patch", "/usr/bin/ps"} <= set(listed)


def test_a_second_build_builds_nothing_and_says_so(family_images: FamilyImages) -> None:
    out = io.StringIO()
    start = time.monotonic()
    again = images.build_images(family_images, out=Console(file=out, width=200))
    seconds = time.monotonic() - start
    print(f"\nno-op rebuild of {len(family_images)} tasks: {seconds:.2f} s")
    assert [b.action for b in again] == ["reused"] * (2 + len(family_images))
    assert [b.image for b in again] == [b.image for b in family_images.built]
    assert f"nothing to build: all {len(again)} images are up to date" in out.getvalue()
    assert seconds < 15


# swebench's exec_run_with_timeout leaves the docker SDK's exec socket to the garbage collector.
@pytest.mark.filterwarnings("ignore:Exception ignored in. <socket.socket:pytest.PytestUnraisableExceptionWarning")
def test_swebench_grades_the_images_gold_resolves_and_no_fix_does_not(
    family_images: FamilyImages, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # swebench writes logs/run_evaluation/ under the current folder
    tasks_file = save_tasks(family_images, tmp_path / "tasks.jsonl")
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "eval", "score", "--gold", "--tasks", str(tasks_file), "--out", str(tmp_path / "gold"),
         "--runner", "docker", "--concurrency", "1", "--timeout", "120"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    seconds = time.monotonic() - start
    assert done.returncode == 0, done.stderr[-3000:]
    rewards = pl.read_parquet(tmp_path / "gold" / "rewards.parquet")
    assert rewards["resolved"].to_list() == [True] * len(family_images), rewards.to_dicts()
    assert set(rewards["reason"]) == {"graded"}
    print(f"\npython -m eval score --gold --runner docker: {len(family_images)} instances in {seconds:.1f} s")

    task, run_id = family_images[0], f"images-{uuid.uuid4().hex[:8]}"
    with contextlib.closing(docker_sdk.from_env()) as client:
        for name, patch, resolved in (("unfixed", UNFIX, False), ("gold", task["patch"], True)):
            start = time.monotonic()
            grade = grade_docker(
                task, patch, timeout=120, log_dir=tmp_path / name, session_id=f"{name}/0", client=client, run_id=run_id
            )
            print(f"grade_docker {name}: {time.monotonic() - start:.2f} s")
            assert (grade.resolved, grade.reason) == (resolved, "graded"), (tmp_path / name / "eval.log").read_text()
    report = json.loads((tmp_path / "unfixed" / "report.json").read_text())[task["instance_id"]]
    assert report["tests_status"]["FAIL_TO_PASS"]["failure"] == task["FAIL_TO_PASS"]
    gc.collect()  # the exec sockets swebench leaves (see the filter above) are collected here, not in a later test
    # run_instance removes its containers (sweb.eval.<instance>.<run id>): none is left behind.
    assert not docker("ps", "-aq", "--filter", f"name=sweb.eval.{task['instance_id']}.{run_id}").stdout.strip()


def test_a_missing_image_names_itself_and_the_command_that_gets_it(family_images: FamilyImages) -> None:
    theirs: dict[str, Any] = {
        **family_images[0], "instance_id": "astropy__astropy-1", "repo": "astropy/astropy",
        "image": "registry.invalid/nope:1",
    }  # fmt: skip
    with pytest.raises(ContainerError) as raised:
        images.require_image(theirs)
    message = str(raised.value)
    assert "registry.invalid/nope:1" in message and "`docker pull registry.invalid/nope:1`" in message
    assert "cannot be pulled" in message
    with pytest.raises(ContainerError, match=r"registry\.invalid/nope:1.*docker pull registry\.invalid/nope:1"):
        images.build_images([theirs], out=Console(file=io.StringIO()))

    ours = {**family_images[0], "image": "polar-gen/not-built:000000000000"}
    with pytest.raises(ContainerError) as raised:
        images.require_image(ours)
    command = f"python -m eval images build --tasks family:heldout@0 --instance-ids {ours['instance_id']}"
    assert "polar-gen/not-built:000000000000" in str(raised.value) and f"`{command}`" in str(raised.value)
    assert images.require_image(family_images[0]) == family_images[0]["image"]


@pytest.fixture
def strays() -> Iterator[dict[str, str]]:
    """An image without our label, and one with it whose key no build today gives; removed afterwards."""
    suffix = uuid.uuid4().hex[:8]
    foreign = foreign_image(f"polar-test-foreign:{suffix}")
    stale = f"polar-env:stale-{suffix}"
    docker("build", "-q", "-t", stale, "-", input=f"FROM {foreign}\nLABEL polar.image=env polar.key=old\n".encode())
    yield {"foreign": foreign, "stale": stale}
    for name in (stale, foreign):
        docker("rmi", name, check=False)


def test_list_and_prune_touch_only_our_images(family_images: FamilyImages, strays: dict[str, str]) -> None:
    listed = {i.tag: i for i in images.our_images()}
    assert strays["foreign"] not in listed and not listed[strays["stale"]].current
    wanted = [b.image for b in family_images.built]
    assert all(listed[name].current for name in wanted), {name: listed[name] for name in wanted}
    assert {listed[t["image"]].kind for t in family_images} == {"task"}

    everything = images.prune_images(everything=True, dry_run=True)  # --all, not carried out: the tier's images stay
    assert set(wanted) | {strays["stale"]} <= set(everything.removed) and strays["foreign"] not in everything.removed
    pruned = images.prune_images()
    assert strays["stale"] in pruned.removed and not set(wanted) & set(pruned.removed)
    assert not image_exists(strays["stale"]) and image_exists(strays["foreign"])
    assert all(image_exists(name) for name in wanted)
    out = subprocess.run([sys.executable, "-m", "eval", "images", "list"], capture_output=True, text=True, check=True)
    assert all(name in out.stdout for name in wanted) and strays["foreign"] not in out.stdout


def test_a_named_base_builds_its_own_env(family_images: FamilyImages) -> None:
    """--base IMAGE: a base of someone else's (here the debootstrap base copied without our labels), never labelled
    or removed by us; its env and task images key on its id."""
    suffix = uuid.uuid4().hex[:8]
    named = f"polar-test-named-base:{suffix}"
    container = docker("create", images.debian_base().tag).stdout.decode().strip()
    with subprocess.Popen(["docker", "export", container], stdout=subprocess.PIPE) as exported:
        subprocess.run(["docker", "import", "-", named], stdin=exported.stdout, check=True, capture_output=True)
    docker("rm", container)
    task = {**family_images[0], "image": f"polar-gen/named-base-test:{suffix}"}
    try:
        start = time.monotonic()
        built = images.build_images([task], base=named, out=Console(file=io.StringIO()))
        print(f"\nenv and task on a named base: {time.monotonic() - start:.1f} s")
        assert [(b.kind, b.action) for b in built] == [("base", "present"), ("env", "built"), ("task", "built")]
        env = images.env_layer(images.named_base(named))
        assert built[1].image == env.tag != images.env_layer(images.debian_base()).tag
        assert "polar.image" not in (image_config(named).get("Labels") or {})
        assert run_in(task["image"], "git rev-parse HEAD").strip() == task["base_commit"]
        assert {i.tag: i.current for i in images.our_images()}[env.tag]  # prune keeps an env on a named base
    finally:
        for name in (task["image"], images.env_layer(images.named_base(named)).tag, named):
            docker("rmi", name, check=False)
