"""``python -m eval images``: the Docker images sessions and grading run in, built without a registry.

    python -m eval images build --tasks family:heldout [--instance-ids ...] [--base IMAGE] [--mirror URL]
    python -m eval images list                       # our images: tag, kind, what for, size, created, current
    python -m eval images prune [--all] [--dry-run]  # our images a build today would not reuse; --all: all ours

    from eval.sessions.images import require_image
    image = require_image(task)  # the task's image name; ContainerError naming it and the command that gets it

Our tasks (the toy suite and the generated family, eval/tasks/load.py) are built here, in three layers, each tagged
and labelled with a content key (``polar.key``) and built only when no image of that tag carries that key:

- **base**: Debian's packages, no registry: ``debootstrap --variant=minbase --include=python3,...,procps
  bookworm ROOTFS MIRROR`` (MIRROR: ``--mirror``, else the Debian mirror ``/etc/apt/sources.list.d/*.sources``
  or ``/etc/apt/sources.list`` names, else deb.debian.org), apt's caches dropped, ``tar -C ROOTFS -c . | docker
  import -``, tagged ``polar-base:bookworm-<key>``; the rootfs is removed. Or ``--base IMAGE``, any Debian-like
  image a registry gives (pulled when missing; what it lacks of python3-venv, git, patch and procps is installed
  with apt). debootstrap needs root.
- **env**: ``polar-env:<key>``, the base plus a venv at ``/opt/venv`` with the project's pytest version, first on
  ``PATH``, ``LANG=C.UTF-8``, ``safe.directory=*`` for git. The host's CA certificates
  (``/usr/local/share/ca-certificates/*.crt``, written at boot) are copied into the build context at every
  build and installed with ``update-ca-certificates``; pip runs with the host's index settings (its ``pip config
  list`` less local paths and ``file://`` indexes, which the image lacks) and the system CA bundle. Neither is
  part of the key: they are how the build reaches the index, not what the image holds.
- **task**: FROM env, the task's checkout (``eval.tasks.load.checkout``, ``.git`` included) at ``/testbed``, ``WORKDIR
  /testbed``, ``STOPSIGNAL SIGKILL`` (swebench stops its containers with ``docker stop --time=15``, whose SIGTERM
  the container's ``tail -f /dev/null`` ignores for all 15 s), tagged with the instance's ``image`` field
  (``<repo>:<base_commit[:12]>``).

Keys chain: the env's covers the base's, the task's the env's, so a new recipe, pytest or base rebuilds what
sits on it. Builds use ``--network host`` (a daemon started with ``--bridge=none`` has no other network).

Other instances (SWE-bench's ``swebench/sweb.eval.*``) name an image of their own: ``build`` pulls each that is
missing, and fails naming those that cannot be had and the command that gets them. ``require_image``, which a
runtime calls before each session, never falls back to the host.

``list`` and ``prune`` only ever touch images carrying our ``polar.image`` label (a base given with ``--base``
does not; an image someone builds FROM ours inherits it). ``prune`` removes what a build today would not reuse:
untagged images (replaced by a rebuild under the same tag) and those whose key is not the one today's recipe
gives for the same inputs (an older recipe, pytest version or base). An image a container still uses, or one
other images are built on, is kept and said so.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from eval.errors import EvalError
from eval.sessions.containers import ContainerError, daemon_address, docker, docker_cli, image_exists, require_daemon
from eval.tasks import family as taskgen
from eval.tasks.load import OURS, checkout, load_tasks

__all__ = [
    "CA_DIR",
    "KEY_LABEL",
    "KIND_LABEL",
    "Args",
    "Build",
    "Built",
    "Layer",
    "List",
    "OurImage",
    "Prune",
    "Pruned",
    "build_command",
    "build_images",
    "debian_base",
    "debian_mirror",
    "env_layer",
    "is_ours",
    "main",
    "named_base",
    "our_images",
    "prune_images",
    "pytest_version",
    "require_image",
    "task_layer",
]

RECIPE = "1"  # part of every key: bump it when a step below changes what an image holds
SUITE = "bookworm"
PACKAGES = ("python3", "python3-venv", "python3-pip", "git", "ca-certificates", "patch", "procps")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
SOURCES_DIR, SOURCES_LIST = Path("/etc/apt/sources.list.d"), Path("/etc/apt/sources.list")
CA_DIR = Path("/usr/local/share/ca-certificates")  # the host's own CAs; copied into every env build
SYSTEM_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"  # Debian's bundle, which update-ca-certificates rewrites
VENV = "/opt/venv"
WORKDIR = "/testbed"
# The unprivileged user a task image runs its sessions as (it owns /testbed). /root stays traversable: the host's
# interpreter, which the container runs for its relay and mini, may be bound under it (pyenv's /root/.pyenv).
USER = "polar"
PYTEST_FALLBACK = "9.2.0"  # where this interpreter has no pytest (the project's .venv has it)
PATH = f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

KIND_LABEL, KEY_LABEL = "polar.image", "polar.key"  # base | env | task; the content key
FOR_LABEL, FROM_LABEL = "polar.for", "polar.from"  # what it is for; the image it is built FROM
REPO_LABEL, COMMIT_LABEL = "polar.repo", "polar.commit"  # a task image's repository and base commit
KINDS = ("task", "env", "base")  # removal order: what sits on an image first

# pip settings of the host that mean the same inside the image; local paths and file:// URLs are left out.
PIP_KEYS = {"index-url", "extra-index-url", "trusted-host", "timeout", "default-timeout", "retries", "proxy"}
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")

WIDE = None if sys.stderr.isatty() else 200  # a log or a pipe: tables unwrapped (rich assumes 80 columns)
console = Console(stderr=True, width=WIDE)


def _digest(*parts: str) -> str:
    return hashlib.sha256(json.dumps([RECIPE, *parts]).encode()).hexdigest()


def _label_line(labels: dict[str, str]) -> str:
    return "LABEL " + " ".join(f"{key}={json.dumps(value)}" for key, value in labels.items())


@dataclasses.dataclass(frozen=True)
class Layer:
    """One image to have: its tag, content key and (for env and task) its Dockerfile, labels included."""

    kind: str  # base | env | task
    tag: str
    key: str
    about: str  # what it is for (the polar.for label)
    dockerfile: str = ""  # "" for a base (imported or named)
    named: bool = False  # a base given by name (--base): not ours, never built, labelled or removed

    def labels(self, **more: str) -> dict[str, str]:
        return {KIND_LABEL: self.kind, KEY_LABEL: self.key, FOR_LABEL: self.about, **more}


# ---- the layers and their keys (pure, but named_base, which asks the daemon for the image's id)


def debian_base() -> Layer:
    """The debootstrap base: its key is its recipe's (suite, variant, packages), not the mirror it came from."""
    key = _digest("base", SUITE, "minbase", *PACKAGES)
    return Layer("base", f"polar-base:{SUITE}-{key[:12]}", key, f"Debian {SUITE} minbase: {' '.join(PACKAGES)}")


def named_base(image: str) -> Layer:
    """A base given by name; its key is the image's id, so a pull that changes it rebuilds what sits on it."""
    done = docker("image", "inspect", "--format", "{{.Id}}", image, check=False)
    if done.returncode != 0:
        raise ContainerError(f"base image {image} is not on the daemon at {daemon_address()}")
    image_id = done.stdout.decode().strip()
    return Layer("base", image, _digest("named", image_id), f"{image} ({image_id[7:19]})", named=True)


def pytest_version() -> str:
    """The project's pytest (this interpreter's), which every env pins."""
    try:
        return importlib.metadata.version("pytest")
    except importlib.metadata.PackageNotFoundError:
        return PYTEST_FALLBACK


def env_layer(base: Layer, pytest: str | None = None) -> Layer:
    pytest = pytest or pytest_version()
    install = " ".join(PACKAGES)
    dockerfile = f"""FROM {base.tag}
COPY ca-certificates/ /usr/local/share/ca-certificates/
COPY pip.conf /tmp/polar-pip.conf
RUN set -eu; \\
    if ! (command -v git && command -v patch && command -v ps && command -v update-ca-certificates \\
          && python3 -c 'import ensurepip, venv') >/dev/null 2>&1; then \\
        apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends {install} \\
        && rm -rf /var/lib/apt/lists/*; \\
    fi; \\
    update-ca-certificates >/dev/null; \\
    python3 -m venv {VENV}; \\
    PIP_CONFIG_FILE=/tmp/polar-pip.conf {VENV}/bin/pip install --no-cache-dir -q pytest=={pytest}; \\
    rm /tmp/polar-pip.conf; \\
    git config --system --add safe.directory '*'; \\
    useradd --create-home --shell /bin/bash {USER}; \\
    chmod 0755 /root
ENV PATH={PATH} LANG=C.UTF-8
"""
    key = _digest("env", base.key, dockerfile)
    about = f"venv {VENV} with pytest=={pytest} on {base.tag}"
    layer = Layer("env", f"polar-env:{key[:12]}", key, about)
    return dataclasses.replace(layer, dockerfile=dockerfile + _label_line(layer.labels(**{FROM_LABEL: base.tag})))


def task_layer(env: Layer, task: dict[str, Any]) -> Layer:
    """A task's image: its checkout on ``env``; keyed by the env and the repository at its base commit."""
    repo, commit, tag = str(task["repo"]), str(task["base_commit"]), str(task["image"])
    dockerfile = (
        f"FROM {env.tag}\nCOPY --chown={USER}:{USER} testbed {WORKDIR}\nWORKDIR {WORKDIR}\nUSER {USER}\n"
        "STOPSIGNAL SIGKILL\n"
    )
    key = _digest("task", env.key, repo, commit, dockerfile)
    layer = Layer("task", tag, key, f"{task['instance_id']} ({repo} at {commit[:12]})")
    labels = layer.labels(**{FROM_LABEL: env.tag, REPO_LABEL: repo, COMMIT_LABEL: commit})
    return dataclasses.replace(layer, dockerfile=dockerfile + _label_line(labels))


def is_ours(task: dict[str, Any]) -> bool:
    """Whether ``images build`` makes the task's image (the toy suite, the generated family)."""
    return str(task.get("repo", "")).partition("/")[0] in OURS


# ---- the host's settings the builds use


def debian_mirror(sources_dir: Path = SOURCES_DIR, sources_list: Path = SOURCES_LIST) -> str:
    """The Debian mirror this machine's apt uses (a ``deb`` entry for bookworm, else any ``.../debian`` one), else
    deb.debian.org."""
    entries: list[tuple[str, list[str]]] = []  # (uri, suites)
    for path in sorted(sources_dir.glob("*.sources")) if sources_dir.is_dir() else []:
        for stanza in re.split(r"\n[ \t]*\n", path.read_text(errors="replace")):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if line.strip() and not line.startswith(("#", " ", "\t")):
                    name, _, value = line.partition(":")
                    fields[name.strip().lower()] = value.strip()
            if "deb" in fields.get("types", "").split() and fields.get("enabled", "yes").lower() != "no":
                entries += [(uri, fields.get("suites", "").split()) for uri in fields.get("uris", "").split()]
    if sources_list.is_file():
        for line in sources_list.read_text(errors="replace").splitlines():
            match = re.match(r"\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)", line)
            if match:
                entries.append((match.group(1), [match.group(2)]))
    for uri, suites in entries:
        if SUITE in suites:
            return uri
    for uri, _ in entries:
        if uri.rstrip("/").endswith("/debian"):
            return uri
    return DEFAULT_MIRROR


def build_pip_config(listing: str | None = None) -> str:
    """pip.conf for the env build: the system CA bundle, and the host's index settings that hold in the image, from
    ``listing`` (``pip config list``'s output; by default this interpreter's pip is asked)."""
    if listing is None:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60, check=False
        )
        listing = done.stdout if done.returncode == 0 else ""
    settings: dict[str, str] = {}
    for line in listing.splitlines():
        match = re.fullmatch(r"(global|install|:env:)\.([\w-]+)=(.*)", line.strip())
        if not match or match.group(2) not in PIP_KEYS:
            continue
        try:
            value = str(ast.literal_eval(match.group(3)))
        except (ValueError, SyntaxError):
            value = match.group(3)
        if match.group(2).endswith("url"):  # index-url, extra-index-url: only what the image can reach
            value = " ".join(url for url in value.split() if url.startswith(("http://", "https://")))
        if value:
            settings[match.group(2)] = value
    return "[global]\n" + "".join(f"{k} = {v}\n" for k, v in {"cert": SYSTEM_BUNDLE, **settings}.items())


def _proxy_args() -> list[str]:
    """The host's proxy variables as build args (docker's predefined ones: used by RUN, not kept in the image)."""
    return [arg for name in PROXY_VARS if os.environ.get(name) for arg in ("--build-arg", name)]


# ---- building


@dataclasses.dataclass(frozen=True)
class Built:
    """What ``build_images`` did for one image."""

    kind: str  # base | env | task | foreign (an image of an instance we do not build)
    image: str
    action: str  # built | reused | pulled | present | missing
    seconds: float
    detail: str = ""


def _labels(name: str) -> dict[str, str] | None:
    """The image's labels; None when the daemon lacks it."""
    done = docker("image", "inspect", "--format", "{{json .Config.Labels}}", name, check=False)
    if done.returncode != 0:
        return None
    labels: dict[str, str] = json.loads(done.stdout) or {}
    return labels


def _current(layer: Layer) -> bool:
    labels = _labels(layer.tag)
    return labels is not None and labels.get(KEY_LABEL) == layer.key


def _streamed(argv: Sequence[str], on_line: Callable[[str], None], stdin: Any = None) -> tuple[int, list[str]]:
    """Run ``argv``, each output line (stdout and stderr) to ``on_line``; (exit code, the last 40 lines)."""
    tail: collections.deque[str] = collections.deque(maxlen=40)
    with subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL if stdin is None else stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            on_line(line.rstrip())
    return proc.returncode, list(tail)


def _docker_build(
    layer: Layer, context: Path, on_line: Callable[[str], None] = lambda _: None, *, no_cache: bool = False
) -> None:
    (context / "Dockerfile").write_text(layer.dockerfile)
    argv = [docker_cli(), "build", "--network", "host", "--force-rm", *_proxy_args(), "-t", layer.tag]
    argv += ["--no-cache", str(context)] if no_cache else [str(context)]
    code, tail = _streamed(argv, on_line)
    if code != 0:
        raise ContainerError(f"docker build of {layer.tag} failed ({code}):\n" + "\n".join(tail[-25:]))


def _mounts_under(root: Path) -> list[str]:
    prefix = str(root.resolve()) + "/"
    mounts = Path("/proc/mounts").read_text().splitlines() if Path("/proc/mounts").exists() else []
    return [p for line in mounts if (p := line.split()[1].replace("\\040", " ")).startswith(prefix)]


def _remove_rootfs(rootfs: Path) -> None:
    """Unmount what a failed debootstrap can leave mounted in it (/proc, /sys), then remove it."""
    for mount in sorted(_mounts_under(rootfs), reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True, check=False)
    if left := _mounts_under(rootfs):
        raise ContainerError(f"{rootfs}: still has mounts {left}; unmount them and remove it by hand")
    shutil.rmtree(rootfs, ignore_errors=True)


def build_debian_base(layer: Layer, mirror: str | None, on_line: Callable[[str], None]) -> None:
    """debootstrap a rootfs into a temporary folder, import it as ``layer.tag``, remove the folder."""
    if shutil.which("debootstrap") is None:
        raise ContainerError(
            "debootstrap is not on PATH: `apt-get install debootstrap` (.ci/dockerd start installs it), or give "
            "--base IMAGE when a registry answers"
        )
    if os.geteuid() != 0:
        raise ContainerError("debootstrap needs root; run images build as root, or give --base IMAGE")
    mirror = mirror or debian_mirror()
    rootfs = Path(tempfile.mkdtemp(prefix="polar-rootfs-"))
    try:
        argv = ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(rootfs), mirror]
        code, tail = _streamed(argv, on_line)
        if code != 0:
            raise ContainerError(f"{' '.join(argv)} failed ({code}):\n" + "\n".join(tail[-20:]))
        for pattern in ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*_*"):
            for path in rootfs.glob(pattern):
                path.unlink()
        on_line(f"docker import {layer.tag}")
        changes = [f"LABEL {k}={json.dumps(v)}" for k, v in layer.labels().items()] + ['CMD ["/bin/bash"]']
        tar = subprocess.Popen(["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        importer = subprocess.Popen(
            [docker_cli(), "import", *(arg for c in changes for arg in ("--change", c)), "-", layer.tag],
            stdin=tar.stdout,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert tar.stdout is not None
        tar.stdout.close()  # the importer holds the pipe now; tar sees it close if the import fails
        _, err = importer.communicate()
        if tar.wait() != 0 or importer.returncode != 0:
            raise ContainerError(f"tar | docker import {layer.tag} failed: {err.decode(errors='replace')[-1000:]}")
    finally:
        _remove_rootfs(rootfs)


def build_env(layer: Layer, on_line: Callable[[str], None], *, no_cache: bool = False) -> None:
    with tempfile.TemporaryDirectory(prefix="polar-env-") as tmp:
        context = Path(tmp)
        (context / "ca-certificates").mkdir()
        for crt in sorted(CA_DIR.glob("*.crt")) if CA_DIR.is_dir() else []:  # written at boot: fresh each build
            shutil.copyfile(crt, context / "ca-certificates" / crt.name)
        (context / "pip.conf").write_text(build_pip_config())
        _docker_build(layer, context, on_line, no_cache=no_cache)


def build_task(layer: Layer, task: dict[str, Any], *, no_cache: bool = False) -> None:
    with tempfile.TemporaryDirectory(prefix="polar-task-") as tmp:
        checkout(task, Path(tmp) / "testbed")
        _docker_build(layer, Path(tmp), no_cache=no_cache)


def _pull(image: str) -> str | None:
    """None when ``docker pull`` got the image; else the daemon's reason."""
    done = docker("pull", "--quiet", image, check=False)
    if done.returncode == 0:
        return None
    lines = done.stderr.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else f"exit {done.returncode}"


def _step(
    progress: Progress, kind: str, layer: Layer, build: Callable[[Callable[[str], None]], None], rebuild: bool
) -> Built:
    """Reuse ``layer`` when an image of its tag carries its key, else build it with a spinner showing its output."""
    if not rebuild and _current(layer):
        return Built(kind, layer.tag, "reused", 0.0, layer.about)
    start = time.monotonic()
    task = progress.add_task(f"{kind}: {layer.tag}", total=None)

    def on_line(line: str) -> None:
        if line.strip():
            progress.update(task, description=f"{kind}: {layer.tag}: {line.strip()[:90]}")

    try:
        build(on_line)
    finally:
        progress.remove_task(task)
    built = Built(kind, layer.tag, "built", time.monotonic() - start, layer.about)
    progress.console.print(f"{kind}: built {layer.tag} in {built.seconds:.1f} s")
    return built


def build_images(
    tasks: Iterable[dict[str, Any]],
    *,
    base: str | None = None,
    mirror: str | None = None,
    jobs: int = 4,
    rebuild: bool = False,
    out: Console | None = None,
) -> list[Built]:
    """Have every image ``tasks`` need: ours built (each layer once per content key), the others pulled when
    missing. Prints progress and a summary to ``out`` (stderr by default); returns what was done per image.
    ContainerError, after all else is done, naming the images that could not be had and the command that gets
    them."""
    out = out or console
    require_daemon()
    tasks = list(tasks)
    ours: dict[str, dict[str, Any]] = {}  # one task per image: the first that names it
    for task in tasks:
        if is_ours(task):
            ours.setdefault(str(task["image"]), task)
    foreign = sorted({str(t["image"]) for t in tasks if not is_ours(t)})
    done: list[Built] = []
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=out, transient=True) as progress:
        if ours:
            if base is None:
                base_layer = debian_base()
                done.append(
                    _step(progress, "base", base_layer, lambda log: build_debian_base(base_layer, mirror, log), rebuild)
                )
            else:
                if not image_exists(base) and (reason := _pull(base)) is not None:
                    raise ContainerError(
                        f"base image {base} is not on the daemon at {daemon_address()} and cannot be pulled "
                        f"({reason}); `docker pull {base}` where a registry answers, or leave out --base to build "
                        "one from Debian's packages"
                    )
                base_layer = named_base(base)
                done.append(Built("base", base, "present", 0.0, base_layer.about))
            env = env_layer(base_layer)
            done.append(_step(progress, "env", env, lambda log: build_env(env, log, no_cache=rebuild), rebuild))
            layers = [(task_layer(env, task), task) for task in ours.values()]
            done += _build_tasks(progress, layers, jobs, rebuild)
        for image in foreign:
            start = time.monotonic()
            if image_exists(image):
                done.append(Built("foreign", image, "present", 0.0))
                continue
            task_id = progress.add_task(f"pull {image}", total=None)
            reason = _pull(image)
            progress.remove_task(task_id)
            action = "missing" if reason else "pulled"
            done.append(Built("foreign", image, action, time.monotonic() - start, reason or ""))
    summarize(done, out)
    if missing := [b.image for b in done if b.action == "missing"]:
        pulls = "; ".join(f"docker pull {image}" for image in missing)
        reasons = sorted({b.detail for b in done if b.action == "missing"})
        raise ContainerError(
            f"{len(missing)} image(s) are not on the daemon at {daemon_address()} and cannot be pulled "
            f"({'; '.join(reasons)}): {', '.join(missing)}. Get them where a registry answers ({pulls}), then "
            "`docker save IMAGE | docker load` them here"
        )
    return done


def _build_tasks(
    progress: Progress, layers: list[tuple[Layer, dict[str, Any]]], jobs: int, rebuild: bool
) -> list[Built]:
    bar = progress.add_task("task images", total=len(layers))
    lock = threading.Lock()

    def one(item: tuple[Layer, dict[str, Any]]) -> Built:
        layer, task = item
        try:
            if not rebuild and _current(layer):
                return Built("task", layer.tag, "reused", 0.0, layer.about)
            start = time.monotonic()
            build_task(layer, task, no_cache=rebuild)
            return Built("task", layer.tag, "built", time.monotonic() - start, layer.about)
        finally:
            with lock:
                progress.advance(bar)

    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(layers) or 1))) as pool:
        results = list(pool.map(one, layers))
    progress.remove_task(bar)
    return results


def summarize(done: Sequence[Built], out: Console) -> None:
    """A table: base and env one row each, task images counted, other images one row each; then one line."""
    table = Table(title="images", title_justify="left")
    for column in ("layer", "image", "action", "seconds"):
        table.add_column(column, justify="right" if column == "seconds" else "left")

    def row(b: Built) -> None:
        action = b.action + (f": {b.detail}" if b.action == "missing" else "")
        table.add_row(b.kind, b.image, action, f"{b.seconds:.1f}")

    for b in done:
        if b.kind in ("base", "env"):
            row(b)
    tasks = [b for b in done if b.kind == "task"]
    if tasks:
        built = [b for b in tasks if b.action == "built"]
        each = f" ({sum(b.seconds for b in built) / len(built):.2f} s each)" if built else ""
        table.add_row(
            "task",
            f"{len(tasks)} image(s)",
            f"{len(built)} built{each}, {len(tasks) - len(built)} reused",
            f"{sum(b.seconds for b in built):.1f}",
        )
    for b in done:
        if b.kind == "foreign":
            row(b)
    out.print(table)
    made = sum(b.action in ("built", "pulled") for b in done)
    if made == 0 and not any(b.action == "missing" for b in done):
        out.print(f"nothing to build: all {len(done)} images are up to date")
    else:
        out.print(
            f"{sum(b.action == 'built' for b in done)} built, {sum(b.action == 'pulled' for b in done)} pulled, "
            f"{sum(b.action in ('reused', 'present') for b in done)} up to date, "
            f"{sum(b.action == 'missing' for b in done)} missing"
        )


# ---- before a session

_pull_locks: dict[str, threading.Lock] = collections.defaultdict(threading.Lock)


def build_command(task: dict[str, Any]) -> str:
    """The command that makes the task's image: ``images build`` for ours, ``docker pull`` for the others."""
    if not is_ours(task):
        return f"docker pull {task['image']}"
    iid = str(task["instance_id"])
    spec = "toy"
    if str(task["repo"]).startswith(f"{taskgen.OWNER}/"):
        seed = re.search(r"-(\d+)$", iid)
        try:
            spec = f"family:{taskgen.instance_split(iid)}@{seed.group(1) if seed else 0}"
        except EvalError:
            spec = "SPEC"
    return f"python -m eval images build --tasks {spec} --instance-ids {iid}"


def require_image(task: dict[str, Any], *, pull: bool = True) -> str:
    """The task's image name, once the daemon has it (pulled first when it is not ours and ``pull``).
    ContainerError naming the image and the command that gets it otherwise: a session never runs on the host."""
    iid, image = task.get("instance_id"), task.get("image")
    if not image:
        raise ContainerError(f"instance {iid!r} names no image (its 'image' field is empty)")
    image = str(image)
    require_daemon()
    if image_exists(image):
        return image
    where = f"image {image} of instance {iid!r} is not on the daemon at {daemon_address()}"
    if is_ours(task):
        raise ContainerError(f"{where}; build it with `{build_command(task)}`")
    if pull:
        with _pull_locks[image]:
            if image_exists(image):  # another session's pull got it
                return image
            reason = _pull(image)
        if reason is None:
            return image
        where += f" and cannot be pulled ({reason})"
    raise ContainerError(
        f"{where}; get it with `{build_command(task)}` where a registry answers (then `docker save {image} | "
        "docker load` here), or `python -m eval images build --tasks SPEC`, which pulls every image a task set needs"
    )


# ---- list and prune


@dataclasses.dataclass(frozen=True)
class OurImage:
    """An image carrying our label, one per tag (an untagged one has ``tag`` None)."""

    id: str
    tag: str | None
    kind: str
    about: str
    size: str
    created: str
    current: bool  # a build today would reuse it
    labels: dict[str, str]


def our_images() -> list[OurImage]:
    """Every image carrying our ``polar.image`` label on the daemon, tasks first, then envs, then bases."""
    require_daemon()
    fmt = "{{.ID}}\t{{.Repository}}\t{{.Tag}}\t{{.Size}}\t{{.CreatedAt}}"
    done = docker("images", "--no-trunc", "--filter", f"label={KIND_LABEL}", "--format", fmt)
    rows = [line.split("\t") for line in done.stdout.decode().splitlines() if line.strip()]
    if not rows:
        return []
    ids = sorted({row[0] for row in rows})
    inspected = docker("image", "inspect", "--format", "{{.Id}}\t{{json .Config.Labels}}", *ids)
    labels = {
        i: json.loads(js) or {} for i, js in (line.split("\t", 1) for line in inspected.stdout.decode().splitlines())
    }
    judge = _Judge()
    images = []
    for image_id, repo, tag, size, created in rows:
        name = None if repo == "<none>" or tag == "<none>" else f"{repo}:{tag}"
        own = labels.get(image_id, {})
        current = name is not None and judge.current(name, own)
        images.append(
            OurImage(image_id, name, own.get(KIND_LABEL, "?"), own.get(FOR_LABEL, ""), size, created, current, own)
        )
    order = {kind: n for n, kind in enumerate(KINDS)}
    return sorted(images, key=lambda i: (order.get(i.kind, -1), i.tag or "", i.id))


class _Judge:
    """Whether an image of ours is what a build today would reuse: its key is today's for the same inputs."""

    def __init__(self) -> None:
        self.debian = debian_base()
        self.envs: dict[str, Layer | None] = {}  # env tag -> today's layer of that tag; None: stale

    def env(self, tag: str, labels: dict[str, str] | None = None) -> Layer | None:
        if tag not in self.envs:
            labels = labels if labels is not None else (_labels(tag) or {})
            source, key = labels.get(FROM_LABEL, ""), labels.get(KEY_LABEL, "")
            layer: Layer | None = None
            if source == self.debian.tag:
                layer = env_layer(self.debian)
            elif source and not source.startswith("polar-base:"):
                # A named base that is gone cannot be judged: its env is kept, as its key says.
                named = image_exists(source)
                layer = env_layer(named_base(source)) if named else Layer("env", tag, key, "")
            self.envs[tag] = layer if layer and layer.tag == tag and layer.key == key else None
        return self.envs[tag]

    def current(self, name: str, labels: dict[str, str]) -> bool:
        kind, key = labels.get(KIND_LABEL), labels.get(KEY_LABEL)
        if kind == "base":
            return name == self.debian.tag and key == self.debian.key
        if kind == "env":
            return self.env(name, labels) is not None
        if kind == "task":
            env = self.env(labels.get(FROM_LABEL, ""))
            task = {"repo": labels.get(REPO_LABEL, ""), "base_commit": labels.get(COMMIT_LABEL, "")}
            return env is not None and task_layer(env, {**task, "image": name, "instance_id": ""}).key == key
        return False


@dataclasses.dataclass(frozen=True)
class Pruned:
    removed: list[str]
    kept: list[tuple[str, str]]  # (image, why it could not be removed)


def prune_images(*, everything: bool = False, dry_run: bool = False) -> Pruned:
    """Remove our images a build today would not reuse (``everything``: all of ours); tagged ones by tag, untagged
    ones by id, tasks first. Only images carrying our label are touched."""
    removed, kept = [], []
    for image in our_images():
        if image.current and not everything:
            continue
        name = image.tag or image.id
        if dry_run:
            removed.append(name)
            continue
        done = docker("rmi", name, check=False)
        if done.returncode == 0:
            removed.append(name)
        else:
            reason = done.stderr.decode(errors="replace").strip().splitlines()
            kept.append((name, reason[-1] if reason else f"exit {done.returncode}"))
    return Pruned(removed, kept)


# ---- the CLI


@dataclasses.dataclass
class Build:
    """Build the images a task set needs (ours), pull the others; each layer once per content key."""

    tasks: str
    """"toy", "family[:train|:heldout][@SEED]", or a .json/.jsonl/.parquet file of SWE-bench instances"""
    instance_ids: tuple[str, ...] | None = None
    """only these instances of --tasks"""
    base: str | None = None
    """a Debian-like base image to build on (pulled when missing) instead of one made with debootstrap"""
    mirror: str | None = None
    """the Debian mirror debootstrap fetches from; default: the one /etc/apt/sources.list.d names"""
    jobs: int = 4
    """task images built at once"""
    rebuild: bool = False
    """build every layer again, docker's build cache unused, even one whose key an image already carries"""


@dataclasses.dataclass
class List:
    """Our images (those carrying the polar.image label): tag, kind, what for, size, created, current."""


@dataclasses.dataclass
class Prune:
    """Remove our images a build today would not reuse: untagged ones and those with a stale content key."""

    all: bool = False
    """remove every image carrying our label"""
    dry_run: bool = False
    """only say what would be removed"""


Args = Build | List | Prune


def main(args: Args) -> int:
    if isinstance(args, Build):
        if args.jobs < 1:
            raise EvalError(f"--jobs must be >= 1, got {args.jobs}")
        tasks = load_tasks(args.tasks, args.instance_ids)
        build_images(tasks, base=args.base, mirror=args.mirror, jobs=args.jobs, rebuild=args.rebuild)
        return 0
    if isinstance(args, List):
        images = our_images()
        table = Table(title=f"our images on {daemon_address()}", title_justify="left")
        for column in ("image", "kind", "for", "size", "created", "current"):
            table.add_column(column)
        for image in images:
            name = image.tag or f"<none> {image.id.removeprefix('sha256:')[:12]}"
            table.add_row(
                name, image.kind, image.about, image.size, image.created[:19], "yes" if image.current else "no"
            )
        Console(width=None if sys.stdout.isatty() else 200).print(table)
        print(f"{len(images)} image(s); {sum(not i.current for i in images)} not current (python -m eval images prune)")
        return 0
    pruned = prune_images(everything=args.all, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for name in pruned.removed:
        print(f"{verb} {name}")
    for name, why in pruned.kept:
        print(f"kept {name}: {why}")
    print(f"{verb} {len(pruned.removed)} image(s), kept {len(pruned.kept)} that could not be removed")
    return 0
