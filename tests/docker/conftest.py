"""The Docker tier: real images and containers on the daemon ``DOCKER_HOST`` names.

Run by ``make test-docker``, which sets ``POLAR_TEST_DOCKER=1``; without that variable this folder is not
collected, so ``make test`` never needs a daemon. With it, a daemon that does not answer fails the tier (the
``docker_daemon`` fixture raises ContainerError naming DOCKER_HOST and ``.ci/dockerd start``); it is never skipped.

``family_images`` builds the images of a few generated tasks once per run, from scratch: the debootstrap base
(root and a Debian mirror; about 1-2 min), the env (pip through the host's CA), then each task's image. In the edit
loop, ``POLAR_TEST_DOCKER_REUSE=1`` reuses the layers an earlier run left on the daemon instead.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from eval.sessions.containers import require_daemon
from eval.sessions.images import Built, build_images
from eval.tasks.load import load_tasks

if os.environ.get("POLAR_TEST_DOCKER") != "1":
    collect_ignore_glob = ["test_*.py"]

REUSE = os.environ.get("POLAR_TEST_DOCKER_REUSE") == "1"
FAMILY_SPEC = "family:heldout"  # load_tasks(FAMILY_SPEC)[:FAMILY_COUNT] are the tasks family_images builds
FAMILY_COUNT = 3


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(item.path).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.timeout(900))  # the first test of a run waits for the debootstrap base


@pytest.fixture(scope="session")
def docker_daemon() -> str:
    """The daemon's server version; ContainerError (the tier fails) when none answers."""
    return require_daemon()


class FamilyImages(list[dict[str, Any]]):
    """The tasks whose images are built, with what the build did (``built``) and how long it took (``seconds``)."""

    built: list[Built]
    seconds: float


@pytest.fixture(scope="session")
def family_images(docker_daemon: str) -> FamilyImages:
    """A few generated tasks (the first of family:heldout) whose images are on the daemon, built once per run."""
    tasks = FamilyImages(load_tasks(FAMILY_SPEC)[:FAMILY_COUNT])
    start = time.monotonic()
    tasks.built = build_images(tasks, rebuild=not REUSE, out=Console(stderr=True, width=200))
    tasks.seconds = time.monotonic() - start
    return tasks
