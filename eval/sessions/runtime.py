"""Where a rollout session runs: one ``Runtime`` per entry of ``RUNTIMES``, chosen with ``--runtime``.

    with RUNTIMES["docker"].open(task, session_id, work, proxy="http://127.0.0.1:8080", mounts=[...]) as box:
        argv, env = prepare(..., workspace=box.workspace, base_url=box.base_url, system_path=box.system_path)
        run = box.run("pi", argv, env, timeout=600)
        patch = box.patch(task["base_commit"])

``local``: the harness and every command the model writes run on this machine, as the caller, in a fresh checkout
(eval.tasks.load.checkout) under ``work``. Nothing stands between them and the host: for development and trusted
models only.

``docker``: the task's own image (its ``image`` field; ``python -m eval images build`` makes ours, a registry gives
SWE-bench's), the repository at ``/testbed``, one container per session:

- ``--network none``: the container has only its own loopback. A relay in it (eval/sessions/relay.py) carries
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
import re
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

from eval.errors import EvalError
from eval.harness.presets import PRESETS, HarnessRun, run_process
from eval.sessions.containers import ContainerError, daemon_address, docker, docker_cli, image_config, require_daemon
from eval.sessions.procs import OutputTail
from eval.sessions.relay import Relay
from eval.tasks.load import checkout

if TYPE_CHECKING:
    from docker import DockerClient

__all__ = [
    "EXCLUDES", "HARNESS_FOLDERS", "RUNTIMES", "Limits", "PatchError", "PatchTooLarge", "Runtime", "Sandbox",
    "parse_size", "remove_leftovers", "remove_run", "take_patch",
]  # fmt: skip

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
FOLDER_LABEL = "polar.folder"  # the run folder's digest (rollout.folder_label): what a rerun there removes
SOCKET_PREFIX = "polar-sock-"
CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER")
DISK_POLL_S = 0.5  # how often the watchdog reads a container's size; it may pass --limits.disk by this much writing
ERROR_KEEP = 8 << 10  # bytes of a failing git's stderr kept
START_TIMEOUT = 60.0  # seconds for a container's relay to come up


class PatchError(Exception):
    """The workspace's diff could not be read (the agent broke the repository, e.g. removed .git)."""


class PatchTooLarge(Exception):
    """The workspace's diff is past --limits.patch: not data to grade or train on, and never read whole."""


def parse_size(text: str, field: str) -> int:
    """Bytes in ``"512"``, ``"64k"``, ``"16m"``, ``"10g"`` (powers of 1024, as docker's --memory)."""
    match = re.fullmatch(r"(\d+(?:\.\d*)?)([kmgt]?)b?", text.strip().lower())
    if match is None:
        raise EvalError(f"{field}: expected a size such as 512k, 16m or 10g, got {text!r}")
    size = int(float(match[1]) * 1024 ** " kmgt".index(match[2] or " "))
    if size <= 0:
        raise EvalError(f"{field}: expected a positive size, got {text!r}")
    return size


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one session may use. ``output`` and ``patch`` bound every runtime; the rest are the container's."""

    cpus: float = 2.0
    """CPUs (docker --cpus)."""
    memory: str = "4g"
    """Memory, swap included (docker --memory and --memory-swap); a process past it is killed."""
    pids: int = 1024
    """Processes and threads at once (docker --pids-limit): a fork bomb stops there."""
    connections: int = 64
    """Connections at once from the container to its proxy (the host-side relay, two threads each): more are closed
    at once and counted in the session's error."""
    disk: str = "10g"
    """Bytes the session may write into its container (/testbed, /tmp, HOME: the container's own layer); a
    watchdog reads the layer's size every DISK_POLL_S and ends the session past it."""
    output: str = "4m"
    """Of the harness's stdout and of its stderr, the last bytes kept (logs/<session>/*.txt); their sizes are in
    the sessions table."""
    patch: str = "16m"
    """The largest patch taken; a larger one ends the session as patch_too_large, without a patch."""

    def __post_init__(self) -> None:
        if self.cpus <= 0 or self.pids < 16 or self.connections < 1:
            raise EvalError(
                "container limits: --cpus must be positive, --pids-limit at least 16 and --limits.connections at "
                f"least 1, got {self}"
            )
        for name in ("memory", "disk", "output", "patch"):
            parse_size(getattr(self, name), f"--limits.{name}")

    def size(self, name: Literal["memory", "disk", "output", "patch"]) -> int:
        return parse_size(getattr(self, name), f"--limits.{name}")


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


def take_patch(repo: Path, base_commit: str, limit: int) -> str:
    """Everything the agent changed since ``base_commit`` (commits included), as a binary-safe git diff;
    PatchTooLarge past ``limit`` bytes."""
    git = [*GIT, "-C", str(repo)]
    try:
        subprocess.run([*git, "add", "-A", "--", ".", *EXCLUDES], check=True, capture_output=True)
    except subprocess.CalledProcessError as e:
        raise PatchError(e.stderr.decode(errors="replace")) from e
    return read_patch([*git, "diff", "--cached", "--binary", base_commit, "--", ".", *EXCLUDES], limit)


def read_patch(argv: list[str], limit: int) -> str:
    """The output of ``argv`` (a git diff, here or in a container), read up to ``limit`` bytes and no further."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    err = OutputTail(proc.stderr, ERROR_KEEP)
    with proc.stdout:
        diff = proc.stdout.read(limit + 1)
    if len(diff) > limit:
        proc.kill()
        proc.wait()
        raise PatchTooLarge(f"the patch is past --limits.patch ({limit} bytes); not taken")
    if proc.wait():
        raise PatchError(err.text())
    return diff.decode(errors="replace")


# ---- local


@dataclasses.dataclass
class LocalSandbox:
    workspace: Path
    base_url: str
    limits: Limits
    system_path: str | None = None

    def run(self, harness: str, argv: list[str], env: dict[str, str], timeout: float) -> HarnessRun:
        argv = [shutil.which(argv[0], path=env["PATH"]) or argv[0], *argv[1:]]
        return run_process(harness, argv, env, self.workspace, timeout, keep=self.limits.size("output"))

    def patch(self, base_commit: str) -> str:
        return take_patch(self.workspace, base_commit, self.limits.size("patch"))

    def keep(self, dest: Path) -> None:
        pass  # the checkout already is under the kept work folder


@contextlib.contextmanager
def open_local(
    task: dict[str, Any], session_id: str, work: Path, *, proxy: str, limits: Limits = Limits(), **_: Any
) -> Iterator[LocalSandbox]:
    yield LocalSandbox(checkout(task, work / "repo").resolve(), proxy, limits)


# ---- docker


def container_name(session_id: str) -> str:
    return f"polar-{hashlib.sha256(session_id.encode()).hexdigest()[:20]}"


@dataclasses.dataclass
class DockerSandbox:
    name: str
    image: str
    home: Path  # the harness's HOME: filled on the host (prepare), copied into the container before the run
    limits: Limits
    workspace: Path
    base_url: str
    system_path: str | None
    relay: Relay  # the host side of the container's one way to its proxy
    client: DockerClient  # the SDK, for the watchdog's reads of the container's size (no process per read)

    def run(self, harness: str, argv: list[str], env: dict[str, str], timeout: float) -> HarnessRun:
        self._copy_home_in()
        exec_argv = ["docker", "exec", "-w", str(self.workspace)]
        exec_argv += [arg for key, value in env.items() for arg in ("-e", f"{key}={value}")]
        exec_argv += [self.name, *argv]
        start = time.monotonic()
        proc = subprocess.Popen(exec_argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None and proc.stderr is not None
        keep = self.limits.size("output")
        out, err = OutputTail(proc.stdout, keep), OutputTail(proc.stderr, keep)
        code, ended_by_limit = self._watch(proc, start + timeout)
        duration = time.monotonic() - start
        notes = self._limit_notes()  # before a kill: a restarted container counts afresh
        if code is None:
            # Kills every process of the session at once; the restart brings back only the relay, for the patch.
            docker("kill", self.name, check=False)
            proc.wait()
            docker("start", self.name, check=False)
        run = HarnessRun.of(harness, argv, code, out, err, duration)
        notes = "; ".join(note for note in (ended_by_limit, notes) if note)
        stderr = f"{run.stderr}\n[polar docker runtime] {notes}\n" if notes else run.stderr
        return dataclasses.replace(
            run, stderr=stderr, timed_out=code is None and ended_by_limit is None, ended_by_limit=ended_by_limit
        )

    def _watch(self, proc: subprocess.Popen[bytes], deadline: float) -> tuple[int | None, str | None]:
        """Wait for the harness until ``deadline``, reading the container's written bytes every DISK_POLL_S: its
        exit code (None when it must be killed) and, when --limits.disk ends it, why."""
        disk = self.limits.size("disk")
        while True:
            try:
                return proc.wait(max(0.0, min(DISK_POLL_S, deadline - time.monotonic()))), None
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() >= deadline:
                return None, None
            if (written := self.written_bytes()) > disk:
                return None, f"ended at --limits.disk {self.limits.disk}: {written} bytes written in the container"

    def written_bytes(self) -> int:
        """What the session wrote into its container's layer (/testbed, /tmp, HOME), as the daemon counts it."""
        listed = self.client.api.containers(all=True, filters={"name": f"^{self.name}$"}, size=True)
        return int(listed[0].get("SizeRw") or 0) if listed else 0

    def _copy_home_in(self) -> None:
        """HOME as prepare() filled it, into the container's own layer: bound from the host, it would take what
        the container writes (a setuid file, a device node) back to the host, outside --limits.disk."""
        docker("exec", "-u", "0", self.name, "mkdir", "-p", "-m", "1777", str(self.home.parent))
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            tar.add(self.home, arcname=self.home.name)
        # The image's tar, as the image's user: the files are the harness's own.
        docker("exec", "-i", self.name, "tar", "-xf", "-", "-C", str(self.home.parent), input=archive.getvalue())

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
        if add.returncode:
            raise PatchError(add.stderr.decode(errors="replace"))
        return read_patch([docker_cli(), *git, "diff", "--cached", "--binary", base_commit, "--", ".", *EXCLUDES],
                          self.limits.size("patch"))  # fmt: skip

    def keep(self, dest: Path) -> None:
        """The container's workspace and HOME as the caller's files under ``dest/repo`` and ``dest/home``. The
        daemon's own archive (``docker cp``; nothing of the container runs), streamed, each entry through
        tarfile's data filter: no setuid or setgid bit, device node, FIFO, or link out of its folder; what is left
        out is listed in ``dest/left-out.txt``."""
        left_out: list[str] = []
        for source, target in ((self.workspace, dest / "repo"), (self.home, dest / "home")):
            shutil.rmtree(target, ignore_errors=True)  # HOME as prepare() left it: the container's copy replaces it
            target.mkdir(parents=True)
            proc = subprocess.Popen([docker_cli(), "cp", f"{self.name}:{source}", "-"], stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL)  # fmt: skip
            assert proc.stdout is not None
            with proc.stdout, tarfile.open(fileobj=proc.stdout, mode="r|") as archive:
                archive.extractall(target, filter=_kept(source.name, left_out))
            proc.wait()
        if left_out:
            (dest / "left-out.txt").write_text("".join(f"{line}\n" for line in left_out))


def _kept(top: str, left_out: list[str]) -> Callable[[tarfile.TarInfo, str], tarfile.TarInfo | None]:
    """A tar filter for ``docker cp``'s archive of folder ``top``: its entries relative to the folder, through the
    data filter; a refused one is named in ``left_out`` and skipped."""

    def inside(name: str) -> str:
        return name.partition("/")[2] if name.startswith(f"{top}/") else ""

    def kept(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
        name = inside(member.name)
        if not name:
            return None  # the folder itself
        member = member.replace(name=name, deep=False)
        if member.islnk():
            member = member.replace(linkname=inside(member.linkname), deep=False)
        try:
            return tarfile.data_filter(member, path)
        except tarfile.FilterError as e:
            left_out.append(f"{top}/{name}: {e}")
            return None

    return kept


@contextlib.contextmanager
def open_docker(
    task: dict[str, Any],
    session_id: str,
    work: Path,
    *,
    proxy: str,
    run_tag: str,
    folder: str = "",
    mounts: Sequence[Path] = (),
    limits: Limits = Limits(),
    timeout: float | None = None,
    **_: Any,
) -> Iterator[DockerSandbox]:
    require_daemon()
    import docker as docker_sdk  # the SDK's import costs a second: only where containers run

    from eval.sessions.images import require_image

    image = require_image(task)  # ContainerError naming the image and the command that gets it
    url = urlsplit(proxy)
    if url.scheme != "http" or url.port is None:
        raise EvalError(f"--runtime docker relays plain http://HOST:PORT proxies, got {proxy}")
    home = (work / "home").resolve()
    home.mkdir(parents=True, exist_ok=True)
    # A short folder of its own: a unix socket's path must stay under 108 bytes, which a run folder may not. Named
    # after the run folder, so that a rerun there removes what a killed run left (remove_leftovers).
    sockets = Path(tempfile.mkdtemp(prefix=f"{SOCKET_PREFIX}{folder}-", dir="/tmp"))
    relay = Relay(f"unix:{sockets}/proxy.sock", f"tcp:{url.hostname}:{url.port}", limits.connections).start()
    sockets.chmod(0o755)  # the container's user (not root in our images) connects through the read-only bind
    (sockets / "proxy.sock").chmod(0o666)
    name = container_name(session_id)
    python = Path(sys.executable)
    binds = [(sockets, Path(SOCKET_DIR), "ro"), (Path(__file__).with_name("relay.py"), Path(RELAY), "ro")]
    binds += [(Path(p), Path(p), "ro") for p in {sys.prefix, sys.base_prefix}]
    binds += [(Path(m).resolve(), Path(m).resolve(), "ro") for m in mounts]
    argv = ["run", "-d", "--init", "--name", name, "--label", f"{RUN_LABEL}={run_tag}"]
    argv += ["--label", f"{SESSION_LABEL}={session_id}", "--label", f"{FOLDER_LABEL}={folder}"]
    argv += ["--network", "none", "--hostname", "sandbox"]
    argv += ["--cpus", f"{limits.cpus:g}", "--memory", limits.memory, "--memory-swap", limits.memory]
    argv += ["--pids-limit", str(limits.pids), "-w", WORKDIR]
    # Least privilege: of root's capabilities, only those a package install as root needs (an image whose user is
    # root, as SWE-bench's), and no setuid gain; a log the session cannot grow (its output comes through exec).
    argv += ["--cap-drop", "ALL", *(arg for cap in CAPABILITIES for arg in ("--cap-add", cap))]
    argv += ["--security-opt", "no-new-privileges", "--log-driver", "json-file"]
    argv += ["--log-opt", "max-size=1m", "--log-opt", "max-file=1"]
    argv += [arg for source, target, mode in binds for arg in ("-v", f"{source}:{target}:{mode}")]
    argv += ["--entrypoint", str(python), image, "-P", RELAY]
    argv += ["--listen", f"tcp:127.0.0.1:{url.port}", "--connect", f"unix:{SOCKET_DIR}/proxy.sock"]
    argv += ["--deadline", f"{timeout + DEADLINE_GRACE_S:g}"] if timeout is not None else []
    client = docker_sdk.DockerClient(base_url=daemon_address())
    try:
        docker(*argv)
        _wait_for_relay(name)
        env = image_config(image).get("Env") or []
        path = next((e.removeprefix("PATH=") for e in env if e.startswith("PATH=")), None)
        base_url = f"http://127.0.0.1:{url.port}"
        yield DockerSandbox(name, image, home, limits, Path(WORKDIR), base_url, path, relay, client)
    finally:
        docker("rm", "-f", "-v", name, check=False)
        client.close()
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
    """Remove every container of the run ``run_tag`` (a stopped rollout's); returns how many."""
    return _remove(f"{RUN_LABEL}={run_tag}")


def remove_leftovers(folder: str) -> int:
    """Remove what rollouts into the run folder labelled ``folder`` left behind (a ``kill -9``): its containers and its
    temporary folders, never another folder's. Only while holding that folder's lock (eval.sessions.rollout): no live
    rollout writes there then. Returns how many containers went."""
    for leftover in Path(tempfile.gettempdir()).glob(f"{SOCKET_PREFIX}{folder}-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    return _remove(f"{FOLDER_LABEL}={folder}")


def _remove(label: str) -> int:
    listed = docker("ps", "-aq", "--filter", f"label={label}", check=False).stdout.decode().split()
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
