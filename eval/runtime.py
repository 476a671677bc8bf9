"""Where a rollout session runs: one ``Runtime`` per entry of ``RUNTIMES``, chosen with ``--runtime``.

    with RUNTIMES["docker"].open(task, session_id, work, proxy="http://127.0.0.1:8080", mounts=[...]) as box:
        argv, env = prepare(..., workspace=box.workspace, base_url=box.base_url, system_path=box.system_path)
        run = box.run("pi", argv, env, timeout=600)
        patch = box.patch(task["base_commit"])

``local``: the harness and every command the model writes run on this machine, as the caller, in a fresh checkout
(eval.tasks.checkout) under ``work``. Nothing stands between them and the host: for development and trusted
models only.

``docker``: the task's own image (its ``image`` field; ``python -m eval images build`` makes ours, a registry gives
SWE-bench's), the repository at ``/testbed``, one container per session:

- ``--network none``: the container has only its own loopback. A relay in it (eval/relay.py) carries
  ``127.0.0.1:<proxy port>`` to a unix socket bound from the host, where a host-side relay carries it on to this
  session's proxy and nowhere else. The harness sees the proxy's URL with the host replaced by 127.0.0.1.
- bound read-only at their own paths: this interpreter's prefixes (the relay, ``mini``), and ``mounts`` (the npm
  harness install, mini.py); read-write: the session's HOME under ``work``, which no other container sees.
- ``--cpus``, ``--memory`` (swap included) and ``--pids-limit`` from :class:`Limits`; ``--init`` reaps orphans.
- the harness is a ``docker exec``; at the timeout the container is killed, then started again only to read the
  patch: ``git diff`` against ``base_commit`` runs inside it (a hostile repository's hooks or config never run on
  the host), new and binary files included, harness folders left out.
- the container is removed whatever happens (``docker rm -f``, and a sweep by run label in ``remove_run``).

Grading runs afterwards in a fresh container of the same image (``python -m eval score --runner docker``).
Design, isolation measurements and costs: docs/runtimes.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol
from urllib.parse import urlsplit

from eval.containers import ContainerError, docker, image_config, require_daemon
from eval.errors import EvalError
from eval.harness.presets import PRESETS, HarnessRun, run_process
from eval.relay import Relay
from eval.tasks import checkout

__all__ = ["EXCLUDES", "HARNESS_FOLDERS", "RUNTIMES", "Limits", "PatchError", "Runtime", "Sandbox", "take_patch"]

# Folders a harness or the tools it runs leave in the workspace; never part of the agent's patch. Excluded
# from `git add` by pathspec, so a file the agent meant to create is never deleted.
HARNESS_FOLDERS = (
    *(preset.config_folder for preset in PRESETS.values() if preset.config_folder),
    "node_modules", "__pycache__", ".pytest_cache", ".venv", ".mypy_cache", ".ruff_cache", ".tox",
)  # fmt: skip
EXCLUDES = [f":(exclude,glob)**/{name}/**" for name in HARNESS_FOLDERS]
GIT = ["git", "-c", "core.quotepath=off"]

WORKDIR = "/testbed"  # swebench's DOCKER_WORKDIR: where every SWE-bench image has the repository
RELAY = "/polar/relay.py"
# A container ends by itself this long after its session's --timeout (its relay's --deadline): room for the setup
# before the harness and the patch after it, and a bound on what a killed rollout leaves running.
DEADLINE_GRACE_S = 60.0
SOCKET_DIR = "/polar/sock"
RUN_LABEL = "polar.run"
SESSION_LABEL = "polar.session"
START_TIMEOUT = 60.0  # seconds for a container's relay to come up


class PatchError(Exception):
    """The workspace's diff could not be read (the agent broke the repository, e.g. removed .git)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one docker session may use."""

    cpus: float = 2.0
    """CPUs (docker --cpus)."""
    memory: str = "4g"
    """Memory, swap included (docker --memory and --memory-swap); a process past it is killed."""
    pids: int = 1024
    """Processes and threads at once (docker --pids-limit): a fork bomb stops there."""
    connections: int = 64
    """Connections at once from the container to its proxy (the host-side relay, two threads each): more are closed
    at once and counted in the session's error."""

    def __post_init__(self) -> None:
        if self.cpus <= 0 or self.pids < 16 or self.connections < 1:
            raise EvalError(
                "container limits: --cpus must be positive, --pids-limit at least 16 and --limits.connections at "
                f"least 1, got {self}"
            )


class Sandbox(Protocol):
    """One session's place to run: the workspace and the proxy as the harness sees them."""

    workspace: Path
    base_url: str
    system_path: str | None  # the PATH after the harness's own bin folder; None: this process's

    def run(self, harness: str, argv: list[str], env: dict[str, str], timeout: float) -> HarnessRun: ...
    def patch(self, base_commit: str) -> str: ...
    def keep(self, dest: Path) -> None: ...


Open = Callable[..., contextlib.AbstractContextManager[Sandbox]]


@dataclasses.dataclass(frozen=True)
class Runtime:
    """A way to run sessions. Adding one is an entry in ``RUNTIMES``."""

    open: Open
    """``open(task, session_id, work, *, proxy, run_tag, mounts, limits)``: a context giving the session's Sandbox;
    ``work`` is a host folder for the session's own files (HOME, sockets, the local checkout)."""
    sandboxed: bool
    """The model's commands cannot reach the host's files, processes or network."""
    about: str


def take_patch(repo: Path, base_commit: str) -> str:
    """Everything the agent changed since ``base_commit`` (commits included), as a binary-safe git diff."""
    git = [*GIT, "-C", str(repo)]
    try:
        subprocess.run([*git, "add", "-A", "--", ".", *EXCLUDES], check=True, capture_output=True)
        diff = subprocess.run(
            [*git, "diff", "--cached", "--binary", base_commit, "--", ".", *EXCLUDES], check=True, capture_output=True
        )
    except subprocess.CalledProcessError as e:
        raise PatchError(e.stderr.decode(errors="replace")) from e
    return diff.stdout.decode(errors="replace")


# ---- local


@dataclasses.dataclass
class LocalSandbox:
    workspace: Path
    base_url: str
    system_path: str | None = None

    def run(self, harness: str, argv: list[str], env: dict[str, str], timeout: float) -> HarnessRun:
        argv = [shutil.which(argv[0], path=env["PATH"]) or argv[0], *argv[1:]]
        return run_process(harness, argv, env, self.workspace, timeout)

    def patch(self, base_commit: str) -> str:
        return take_patch(self.workspace, base_commit)

    def keep(self, dest: Path) -> None:
        pass  # the checkout already is under the kept work folder


@contextlib.contextmanager
def open_local(task: dict[str, Any], session_id: str, work: Path, *, proxy: str, **_: Any) -> Iterator[LocalSandbox]:
    yield LocalSandbox(checkout(task, work / "repo").resolve(), proxy)


# ---- docker


def container_name(session_id: str) -> str:
    return f"polar-{hashlib.sha256(session_id.encode()).hexdigest()[:20]}"


@dataclasses.dataclass
class DockerSandbox:
    name: str
    image: str
    home: Path
    limits: Limits
    workspace: Path
    base_url: str
    system_path: str | None
    relay: Relay  # the host side of the container's one way to its proxy

    def run(self, harness: str, argv: list[str], env: dict[str, str], timeout: float) -> HarnessRun:
        exec_argv = ["docker", "exec", "-w", str(self.workspace)]
        exec_argv += [arg for key, value in env.items() for arg in ("-e", f"{key}={value}")]
        exec_argv += [self.name, *argv]
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            start = time.monotonic()
            proc = subprocess.Popen(exec_argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
            try:
                code: int | None = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                code = None
            duration = time.monotonic() - start
            notes = self._limit_notes()  # before a kill: a restarted container counts afresh
            if code is None:
                # Kills every process of the session at once; the restart brings back only the relay, for the patch.
                docker("kill", self.name, check=False)
                proc.wait()
                docker("start", self.name, check=False)
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
        if notes:
            stderr += f"\n[polar docker runtime] {notes}\n"
        return HarnessRun(harness, argv, code, code is None, stdout, stderr, round(duration, 3))

    def _limit_notes(self) -> str:
        """What the container's limits refused, read from the host's cgroup files and its relay (the container
        cannot fake them): forks past --pids-limit, kills at --memory, connections past --limits.connections."""
        notes = []
        if self.relay.refused:
            notes.append(f"{self.relay.refused} connections refused at --limits.connections {self.limits.connections}")
        done = docker("inspect", "--format", "{{.Id}} {{.State.OOMKilled}}", self.name, check=False)
        if done.returncode != 0:
            return "; ".join(notes)
        cid, oom = done.stdout.decode().split()
        notes += [f"killed at --memory {self.limits.memory}"] if oom == "true" else []
        for events in (
            Path(f"/sys/fs/cgroup/pids/docker/{cid}/pids.events"),
            Path(f"/sys/fs/cgroup/docker/{cid}/pids.events"),
        ):
            if events.is_file():
                refused = int(events.read_text().split()[-1])
                if refused:
                    notes.append(f"{refused} forks refused at --pids-limit {self.limits.pids}")
        return "; ".join(notes)

    def patch(self, base_commit: str) -> str:
        git = ["exec", "-w", str(self.workspace), self.name, *GIT]
        add = docker(*git, "add", "-A", "--", ".", *EXCLUDES, check=False)
        diff = (
            add if add.returncode else docker(*git, "diff", "--cached", "--binary", base_commit, "--", ".", *EXCLUDES)
        )
        if diff.returncode:
            raise PatchError(diff.stderr.decode(errors="replace"))
        return diff.stdout.decode(errors="replace")

    def keep(self, dest: Path) -> None:
        """The container's workspace as files of the caller's under ``dest/repo``."""
        done = docker("exec", self.name, "tar", "-C", str(self.workspace), "-cf", "-", ".")
        with tarfile.open(fileobj=io.BytesIO(done.stdout)) as archive:
            archive.extractall(dest / "repo", filter="data")  # no links out of dest, no devices, no owners


@contextlib.contextmanager
def open_docker(
    task: dict[str, Any],
    session_id: str,
    work: Path,
    *,
    proxy: str,
    run_tag: str,
    mounts: Sequence[Path] = (),
    limits: Limits = Limits(),
    timeout: float | None = None,
    **_: Any,
) -> Iterator[DockerSandbox]:
    require_daemon()
    from eval.images import require_image

    image = require_image(task)  # ContainerError naming the image and the command that gets it
    url = urlsplit(proxy)
    if url.scheme != "http" or url.port is None:
        raise EvalError(f"--runtime docker relays plain http://HOST:PORT proxies, got {proxy}")
    home = (work / "home").resolve()
    home.mkdir(parents=True, exist_ok=True)
    # A short folder of its own: a unix socket's path must stay under 108 bytes, which a run folder may not.
    sockets = Path(tempfile.mkdtemp(prefix="polar-sock-", dir="/tmp"))
    relay = Relay(f"unix:{sockets}/proxy.sock", f"tcp:{url.hostname}:{url.port}", limits.connections).start()
    name = container_name(session_id)
    python = Path(sys.executable)
    binds = [
        (home, home, "rw"),
        (sockets, Path(SOCKET_DIR), "ro"),
        (Path(__file__).with_name("relay.py"), Path(RELAY), "ro"),
    ]
    binds += [(Path(p), Path(p), "ro") for p in {sys.prefix, sys.base_prefix}]
    binds += [(Path(m).resolve(), Path(m).resolve(), "ro") for m in mounts]
    argv = ["run", "-d", "--init", "--name", name, "--label", f"{RUN_LABEL}={run_tag}"]
    argv += ["--label", f"{SESSION_LABEL}={session_id}", "--network", "none", "--hostname", "sandbox"]
    argv += ["--cpus", f"{limits.cpus:g}", "--memory", limits.memory, "--memory-swap", limits.memory]
    argv += ["--pids-limit", str(limits.pids), "-w", WORKDIR]
    argv += [arg for source, target, mode in binds for arg in ("-v", f"{source}:{target}:{mode}")]
    argv += ["--entrypoint", str(python), image, "-P", RELAY]
    argv += ["--listen", f"tcp:127.0.0.1:{url.port}", "--connect", f"unix:{SOCKET_DIR}/proxy.sock"]
    argv += ["--deadline", f"{timeout + DEADLINE_GRACE_S:g}"] if timeout is not None else []
    try:
        docker(*argv)
        _wait_for_relay(name)
        env = image_config(image).get("Env") or []
        path = next((e.removeprefix("PATH=") for e in env if e.startswith("PATH=")), None)
        yield DockerSandbox(name, image, home, limits, Path(WORKDIR), f"http://127.0.0.1:{url.port}", path, relay)
    finally:
        if os.geteuid() != 0:  # what the container's root wrote into the bound HOME goes back to the caller
            docker("exec", name, "chown", "-R", f"{os.getuid()}:{os.getgid()}", str(home), check=False)
        docker("rm", "-f", "-v", name, check=False)
        relay.stop()
        shutil.rmtree(sockets, ignore_errors=True)


def _wait_for_relay(name: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        logs = docker("logs", name, check=False)
        if b"relay: " in logs.stdout:
            return
        state = docker("inspect", "--format", "{{.State.Status}}", name, check=False).stdout.decode().strip()
        if state not in ("created", "running") or time.monotonic() > deadline:
            raise ContainerError(
                f"container {name}: its relay did not start ({state}): "
                f"{(logs.stdout + logs.stderr).decode(errors='replace')[-1500:]}"
            )
        time.sleep(0.05)


def remove_run(run_tag: str) -> int:
    """Remove every container left by the run ``run_tag`` (a killed rollout's); returns how many."""
    listed = docker("ps", "-aq", "--filter", f"label={RUN_LABEL}={run_tag}", check=False).stdout.decode().split()
    if listed:
        docker("rm", "-f", "-v", *listed, check=False)
    return len(listed)


RUNTIMES: dict[str, Runtime] = {
    "local": Runtime(open_local, sandboxed=False, about="on this machine, in a temporary checkout; unsafe"),
    "docker": Runtime(open_docker, sandboxed=True, about="in the task's image, one container per session, no network"),
}
if TYPE_CHECKING:
    RuntimeName = str
else:
    RuntimeName = Literal[tuple(RUNTIMES)]
