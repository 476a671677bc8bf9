"""Install the harness CLIs pinned in this folder's package.json (and its lock) from npm, once per version set.

    python -m eval harness install       # prints the node_modules/.bin folder the presets run from

The pins live beside this module so an installed eval package carries them; a version bump changes their hash,
so the next run installs afresh. Wiring facts: shared/reference/stack.md §3.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["CACHE", "PACKAGE_JSON", "NpmMissing", "install"]

PACKAGE_JSON = Path(__file__).with_name("package.json")
CACHE = Path(__file__).resolve().parents[2] / "tests" / ".cache" / "harness"  # gitignored, ~1 GB
INSTALLED = ".installed"  # written last: its presence means the install finished


class NpmMissing(RuntimeError):
    """npm is not on PATH, so the harness CLIs cannot be installed."""


def install(package_json: Path = PACKAGE_JSON, cache: Path = CACHE) -> Path:
    """Install the CLIs pinned in ``package_json`` once, under ``cache/<hash of package_json>``; returns the
    ``node_modules/.bin`` folder. A file lock lets parallel test workers and rollouts share one install; a
    version bump changes the hash, installs afresh and removes the old install."""
    spec = package_json.read_bytes()
    lock_file = package_json.with_name("package-lock.json")
    lock = lock_file.read_bytes() if lock_file.exists() else b""
    key = hashlib.sha256(spec + lock).hexdigest()[:16]
    target = cache / key
    bin_dir = target / "node_modules" / ".bin"
    if (target / INSTALLED).exists():
        return bin_dir
    npm = shutil.which("npm")
    if npm is None:
        raise NpmMissing("npm is not on PATH: install Node.js with npm to run the harness CLIs")
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / ".lock"):
        if (target / INSTALLED).exists():  # another process finished it while we waited
            return bin_dir
        shutil.rmtree(target, ignore_errors=True)  # a half-done install from a killed run
        target.mkdir()
        (target / "package.json").write_bytes(spec)
        if lock:  # the shipped lock pins the transitive packages too; `npm install` follows it
            # (`npm ci` would refuse it: npm leaves other platforms' optional packages out of the lock)
            (target / "package-lock.json").write_bytes(lock)
        cmd = [npm, "install", "--no-audit", "--no-fund", "--no-update-notifier", "--loglevel=error"]
        done = subprocess.run(cmd, cwd=target, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed in {target} ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        (target / INSTALLED).write_text(json.dumps({"package_json": str(package_json), "t": time.time()}))
        for old in cache.iterdir():
            if old.is_dir() and old.name != key:
                shutil.rmtree(old, ignore_errors=True)
    return bin_dir


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
