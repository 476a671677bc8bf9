"""Shared fixtures: the tiny offline model and the other expensive artefacts, each built once per test run whichever
worker asks first (``run_once``), and reference servers on the tiny model."""

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from filelock import FileLock

from eval.sessions.procs import ReferenceServer
from eval.upstream.models import build_tiny, build_tiny_qwen35

# make test hands whole files to its two workers (--dist loadfile) in collection order (--no-loadscope-reorder in
# pyproject.toml; xdist's default hands out the files with the most tests first, which left the minutes-long
# one-test files for last: one worker ran the Pi demo alone at the end while the other had nothing left). The
# longest files go first, each worker taking the next when it is free; the notebooks, which wait for the fast
# demo's run folder (run_once), go last, when it has long been built, instead of idling a worker meanwhile.
FIRST = [
    "tests/eval/loop/test_demo.py",
    "tests/eval/loop/test_demo_pi.py",
    "tests/eval/harness/test_transparent.py",
    "tests/eval/service/test_app.py",
    "tests/eval/upstream/test_models.py",
    "tests/train/test_launch.py",
    "tests/eval/test_rollout.py",
    "tests/eval/test_ray_rollout.py",
    "tests/eval/harness/test_harnesses.py",
    "tests/reconstruct/test_merge.py",
]
LAST = ["tests/test_notebooks.py"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """FIRST's files in that order, then the others by number of tests (xdist's own order), then LAST's."""
    files = [item.nodeid.split("::")[0] for item in items]
    count = {file: files.count(file) for file in set(files)}

    def rank(file: str) -> tuple[int, int]:
        if file in FIRST:
            return (0, FIRST.index(file))
        return (2, 0) if file in LAST else (1, -count[file])

    order = {item.nodeid: rank(file) for item, file in zip(items, files, strict=True)}
    items.sort(key=lambda item: order[item.nodeid])  # stable: each file's tests stay together, in their order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """In the Gym tier (make test-gym sets POLAR_GYM=1) a skip is a failure: each of its tests is there to run."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("POLAR_GYM") == "1" and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped in the Gym tier (POLAR_GYM=1), where nothing may skip: {report.longrepr}"


def pytest_configure(config: pytest.Config) -> None:
    # A run starts ~30 reference servers: forked from one forkserver per worker that has their imports, each costs
    # ~0.2 CPU-s instead of ~6 (eval/sessions/procs.py).
    ReferenceServer.forked = True


@pytest.fixture(scope="session")
def run_once(
    tmp_path_factory: pytest.TempPathFactory, worker_id: str
) -> Callable[[str, Callable[[Path], object]], Path]:
    """Factory: ``run_once(name, build)`` calls ``build(folder)`` once per test run and returns ``folder``.

    ``make test`` runs two xdist workers, each with its own session fixtures, and a file's tests stay in one worker:
    an artefact that tests in several files read (the tiny model, the demo's run folder, the reconstruction
    captures) would be built twice. The folder lies in the directory the workers share; the first worker to ask
    builds it under a file lock while the other waits, and a ``<name>.done`` marker beside it makes it reusable. A
    build that raised leaves no marker, so the next test to ask builds it again (and fails with its own error)."""
    base = tmp_path_factory.getbasetemp()
    shared = base if worker_id == "master" else base.parent

    def get(name: str, build: Callable[[Path], object]) -> Path:
        folder = shared / "run-once" / name
        folder.parent.mkdir(exist_ok=True)
        done = folder.parent / f"{name}.done"
        with FileLock(folder.parent / f"{name}.lock"):
            if not done.exists():
                shutil.rmtree(folder, ignore_errors=True)  # what a failed build left
                folder.mkdir()
                build(folder)
                done.touch()
        return folder

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(run_once) -> Path:
    return run_once("tiny", build_tiny)


@pytest.fixture(scope="session")
def tiny_qwen35_dir(run_once) -> Path:
    return run_once("tiny-qwen3.5", build_tiny_qwen35)


@pytest.fixture(scope="session")
def long_memory_qwen35_dir(run_once, tiny_qwen35_dir) -> Path:
    """The tiny Qwen3.5 with Gated DeltaNet decay rates A in [0.01, 0.1] (A_log: their logs), so that each token keeps
    about 0.9 to 0.99 of the recurrent state before it. The random init keeps about e^-9, so a wrong state (carried
    between traces, or lost between rows) would change its log-probs by about 1e-4 only."""

    def build(folder: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        shutil.copytree(tiny_qwen35_dir, folder, dirs_exist_ok=True)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for layer in model.model.layers:
                if layer.block_type == "linear_attention":
                    rates = torch.empty(layer.linear_attn.A_log.shape).uniform_(0.01, 0.1, generator=generator)
                    layer.linear_attn.A_log.copy_(rates.log())
        model.save_pretrained(folder)

    return run_once("tiny-qwen3.5-long-memory", build)


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
