"""eval.harness.install with a stand-in npm: one install per package.json, shared under a lock, redone after a
failure or a version bump."""

import os
import threading
from pathlib import Path

import pytest

from eval.harness.install import NpmMissing, install

# Counts its calls, takes a while (so racing installs overlap), fails on request, and leaves a bin folder.
FAKE_NPM = """#!/bin/sh
echo "$*" >> "{calls}"
sleep 0.3
[ -e "{fail}" ] && exit 1
mkdir -p node_modules/.bin && touch node_modules/.bin/pi
"""


@pytest.fixture
def npm(tmp_path, monkeypatch):
    """A fake npm first on PATH; returns the file that logs its calls (one line each)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "npm-calls"
    (bin_dir / "npm").write_text(FAKE_NPM.format(calls=calls, fail=tmp_path / "npm-fails"))
    (bin_dir / "npm").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    return calls


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def package(tmp_path: Path, version: str) -> Path:
    path = tmp_path / "package.json"
    path.write_text(f'{{"private": true, "dependencies": {{"@mariozechner/pi-coding-agent": "{version}"}}}}')
    return path


def test_installs_once_per_package_json_and_replaces_old_versions(tmp_path, npm):
    cache = tmp_path / "cache"
    spec = package(tmp_path, "0.73.1")
    bin_dir = install(spec, cache)
    assert (bin_dir / "pi").exists() and bin_dir.parent.parent.parent == cache
    assert install(spec, cache) == bin_dir
    assert len(calls(npm)) == 1 and calls(npm)[0].startswith("install")

    bumped = install(package(tmp_path, "0.74.0"), cache)
    assert bumped != bin_dir and (bumped / "pi").exists()
    assert not bin_dir.exists()  # the old version's install is gone
    assert len(calls(npm)) == 2


def test_parallel_installs_share_one_npm_run(tmp_path, npm):
    spec, cache = package(tmp_path, "0.73.1"), tmp_path / "cache"
    results: list[Path] = []
    workers = [threading.Thread(target=lambda: results.append(install(spec, cache))) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(set(results)) == 1 and len(results) == 3
    assert len(calls(npm)) == 1


def test_failed_install_raises_and_is_redone(tmp_path, npm):
    spec, cache = package(tmp_path, "0.73.1"), tmp_path / "cache"
    (tmp_path / "npm-fails").touch()
    with pytest.raises(RuntimeError, match="npm install"):
        install(spec, cache)
    (tmp_path / "npm-fails").unlink()
    assert (install(spec, cache) / "pi").exists()
    assert len(calls(npm)) == 2


def test_missing_npm_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NpmMissing, match="npm is not on PATH"):
        install(package(tmp_path, "0.73.1"), tmp_path / "cache")
