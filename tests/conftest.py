"""Shared fixtures: the tiny offline model, built once per test run, and reference servers on it."""

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from eval.procs import ReferenceServer
from eval.upstream.models import build_tiny


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def reference_server(tmp_path_factory) -> Iterator[Callable[..., str]]:
    """Factory: ``reference_server(model_dir, script=None, seed=0)`` starts ``python -m eval serve`` on a free
    port and returns its base URL once it accepts connections. ``script`` is a list of assistant messages (or a
    path to one) to replay per ``x-polar-session``. Every server started is stopped when the test session ends."""
    servers: list[ReferenceServer] = []

    def start(model_dir: Path, *, script: list[dict] | Path | None = None, seed: int = 0) -> str:
        tmp = tmp_path_factory.mktemp("reference_server")
        if isinstance(script, list):
            (tmp / "script.json").write_text(json.dumps(script))
            script = tmp / "script.json"
        server = ReferenceServer(model_dir, log=tmp / "server.log", script=script, seed=seed)
        servers.append(server)
        return server.url

    yield start
    for server in servers:
        server.stop()
