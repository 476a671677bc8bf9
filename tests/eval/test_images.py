"""eval/sessions/images.py without a daemon: the names and keys of the layers, the host settings a build takes (the
Debian mirror, pip's settings), and the command a missing image's error names. The builds themselves are tested against
a real daemon in tests/docker/test_images.py (make test-docker)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from eval.sessions import images
from eval.sessions.containers import ContainerError
from eval.tasks.load import load_tasks

SOURCES = """Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main
"""


def test_toy_and_family_tasks_name_their_image_by_repo_and_base_commit() -> None:
    for task in load_tasks("toy")[:3] + load_tasks("family:heldout")[:3]:
        assert task["image"] == f"{task['repo']}:{task['base_commit'][:12]}"
        assert images.is_ours(task)
    assert not images.is_ours({"repo": "astropy/astropy", "image": "swebench/sweb.eval.x86_64.astropy"})


def test_keys_chain_from_base_to_task_and_ignore_the_task_name() -> None:
    base = images.debian_base()
    assert base == images.debian_base() and base.tag == f"polar-base:bookworm-{base.key[:12]}"
    env = images.env_layer(base)
    assert env.tag == f"polar-env:{env.key[:12]}" and env.dockerfile.startswith(f"FROM {base.tag}\n")
    assert "pytest==" + images.pytest_version() in env.dockerfile and "polar.from=" in env.dockerfile
    # Another pytest, or another base, is another env, and so another key for every task on it.
    other_base = dataclasses.replace(base, key="0" * 64)
    assert len({env.key, images.env_layer(base, "8.0.0").key, images.env_layer(other_base).key}) == 3
    task = load_tasks("family:heldout")[0]
    layer = images.task_layer(env, task)
    assert layer.tag == task["image"] and "STOPSIGNAL SIGKILL" in layer.dockerfile
    assert layer.dockerfile.startswith(
        f"FROM {env.tag}\nCOPY --chown=polar:polar testbed /testbed\nWORKDIR /testbed\nUSER polar\n"
    )  # the session runs as the user the env layer adds, owning its checkout
    assert "useradd --create-home --shell /bin/bash polar" in env.dockerfile
    assert images.task_layer(env, {**task, "image": "x/y:1", "instance_id": "other"}).key == layer.key
    assert images.task_layer(env, {**task, "base_commit": "f" * 40}).key != layer.key
    assert images.task_layer(images.env_layer(other_base), task).key != layer.key


def test_the_debian_mirror_comes_from_apt_sources(tmp_path: Path) -> None:
    parts, listing = tmp_path / "sources.list.d", tmp_path / "sources.list"
    assert images.debian_mirror(parts, listing) == images.DEFAULT_MIRROR  # neither exists
    parts.mkdir()
    (parts / "debian.sources").write_text(SOURCES)
    (parts / "nodesource.sources").write_text(
        "Types: deb\nURIs: https://deb.nodesource.com/node_20.x\nSuites: nodistro\n"
    )
    assert images.debian_mirror(parts, listing) == "http://mirror.example/debian"
    (parts / "debian.sources").unlink()
    listing.write_text(
        "# deb http://old.example/debian bookworm main\ndeb [arch=amd64] http://list.example/debian bookworm main\n"
    )
    assert images.debian_mirror(parts, listing) == "http://list.example/debian"
    listing.write_text(
        "deb http://list.example/debian/ trixie main\n"
    )  # another suite: any Debian mirror serves bookworm
    assert images.debian_mirror(parts, listing) == "http://list.example/debian/"
    listing.write_text("deb http://archive.ubuntu.com/ubuntu noble main\n")
    assert images.debian_mirror(parts, listing) == images.DEFAULT_MIRROR


def test_pip_gets_the_system_bundle_and_the_hosts_index_settings_less_local_paths() -> None:
    listing = "\n".join([
        ":env:.cert='/etc/ssl/certs/ca-certificates.crt'",
        ":env:.default-timeout='180'",
        ":env:.find-links='/opt/wheels'",
        "global.constraint='/etc/xdg/pip/constraints.txt'",
        "global.extra-index-url='file:///opt/pypi/simple https://pypi.example/simple'",
        "global.index-url='file:///opt/pypi/only'",
        "global.trusted-host='pypi.example'",
        "user.cache-dir='/root/.cache/pip'",
    ])  # fmt: skip
    assert images.build_pip_config(listing) == (
        "[global]\ncert = /etc/ssl/certs/ca-certificates.crt\ndefault-timeout = 180\n"
        "extra-index-url = https://pypi.example/simple\ntrusted-host = pypi.example\n"
    )
    assert images.build_pip_config("") == "[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n"


def test_a_missing_image_names_the_command_that_gets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    toy, family = load_tasks("toy")[0], load_tasks("family:train@2")[5]
    assert images.build_command(toy) == f"python -m eval images build --tasks toy --instance-ids {toy['instance_id']}"
    assert images.build_command(family) == (
        f"python -m eval images build --tasks family:train@2 --instance-ids {family['instance_id']}"
    )
    theirs = {"instance_id": "astropy__astropy-1", "repo": "astropy/astropy", "image": "swebench/sweb.eval.x:latest"}
    assert images.build_command(theirs) == "docker pull swebench/sweb.eval.x:latest"
    with pytest.raises(ContainerError, match="names no image"):
        images.require_image({**theirs, "image": ""})
    # Without a daemon, require_image says so before anything else (never the host instead).
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    images.require_daemon.cache_clear()
    try:
        no_daemon = "no Docker daemon answered at unix:///nonexistent/docker.sock|the docker CLI is not on PATH"
        with pytest.raises(ContainerError, match=no_daemon):
            images.require_image(toy)
    finally:
        images.require_daemon.cache_clear()
