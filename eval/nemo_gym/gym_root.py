"""A Python 3.13 for NeMo Gym on a machine that has none: a Debian forky root filesystem with nemo-gym in a venv.

    .venv/bin/python -m eval.nemo_gym.gym_root [--root tests/.cache/gymroot] [--mirror URL]
    tests/.cache/gymvenv/bin/python check_gym.py        # Gym's interpreter, run in the root filesystem
    tests/.cache/gymvenv/bin/in-root gym env start ...   # any command there, in the current directory

Every nemo-gym release from 0.5.0 on declares ``Requires-Python >=3.13.14``; Debian bookworm's python3 is 3.11,
trixie's 3.13.5, forky's ``python3.13`` 3.13.15. uv's and pip's own Python downloads fetch from outside, which
these machines cannot reach. So this module, run as root:

1. ``debootstrap --variant=minbase --include=python3.13,python3.13-venv,ca-certificates forky ROOT MIRROR
   /usr/share/debootstrap/scripts/sid`` (bookworm's debootstrap has no forky script; sid's is the same; MIRROR:
   the Debian mirror apt uses here, eval.sessions.images.debian_mirror), apt's caches dropped: about 80 s, 280 MB;
2. the host's resolv.conf, its pip index settings (eval.sessions.images.build_pip_config: no local paths) and its CA
   certificates (``/usr/local/share/ca-certificates``, then ``update-ca-certificates``: outbound HTTPS goes through
   a local CA here, and pip and uv fail with CERTIFICATE_VERIFY_FAILED without it);
3. ``python3.13 -m venv /opt/gymvenv``, pip installs uv (``gym env start`` makes each server's venv with it), uv
   installs nemo-gym (ray, mlflow, wandb, datasets, pyarrow, scipy; no torch): about 1.3 GB. uv's cache stays in
   the root filesystem, so the venvs ``gym env start`` makes for its servers install from it;
4. the wrappers ``tests/.cache/gymvenv/bin/{in-root,python,gym}``, which the tests use.

A command runs there through ``unshare --mount`` + ``chroot``, in a mount namespace of its own that binds /dev,
/proc, /sys, /tmp and this repository at the same paths, with the same network (loopback servers on the host
answer), in the current directory (which must lie under one of those); PATH starts with the venv's bin, and the
host's local pip paths, PYTHONPATH and VIRTUAL_ENV are left out. Its interpreter cannot run on the host itself
(GLIBC_2.38). The root filesystem is built once: ``ROOT/.polar-gym.json`` records the recipe it was built with, and
a build finding the same one only writes the wrappers again; a build that stopped half way leaves ``ROOT.partial``,
removed by the next.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import tyro

from eval.errors import EvalError
from eval.sessions.images import CA_DIR, build_pip_config, debian_mirror
from eval.sessions.procs import ROOT as REPO

__all__ = ["GYM_BIN", "GYM_ROOT", "NEMO_GYM", "RECIPE", "Args", "build", "main", "wrapper"]

NEMO_GYM = "0.7.0"
UV = "0.13.9"
SUITE = "forky"
PACKAGES = ("python3.13", "python3.13-venv", "ca-certificates")
DEBOOTSTRAP_SCRIPT = Path("/usr/share/debootstrap/scripts/sid")  # forky's script, under the name sid has
VENV = "/opt/gymvenv"
GYM_ROOT = REPO / "tests" / ".cache" / "gymroot"
GYM_BIN = REPO / "tests" / ".cache" / "gymvenv" / "bin"  # where the tests look for Gym's interpreter
RECIPE = {"recipe": 1, "suite": SUITE, "packages": list(PACKAGES), "nemo_gym": NEMO_GYM, "uv": UV}
MARKER = ".polar-gym.json"
# Left out inside: the host's local pip paths (its find-links), its Python's search path and venv.
DROPPED_ENV = ("PIP_FIND_LINKS", "PIP_CONSTRAINT", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
PATH = f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclasses.dataclass
class Args:
    """Build the Python 3.13 root filesystem with nemo-gym (once) and write its wrappers."""

    root: Path = GYM_ROOT
    """Where the root filesystem goes (about 1.6 GB)."""
    mirror: str | None = None
    """Debian mirror for debootstrap; default: the one this machine's apt uses."""
    bin: Path = GYM_BIN
    """Folder for the wrappers in-root, python and gym."""


def wrapper(root: Path, command: str = '"$@"') -> str:
    """A POSIX sh script that runs ``command`` (its arguments by default) in ``root``, in the current directory."""
    inner = (
        "r=$0; repo=$1; wd=$2; shift 2\n"
        'for d in /dev /proc /sys /tmp "$repo"; do\n'
        '  mount --rbind "$d" "$r$d" || { echo "in-root: cannot bind $d into $r (run as root)" >&2; exit 125; }\n'
        "done\n"
        f'exec chroot "$r" /usr/bin/env {" ".join(f"-u {v}" for v in DROPPED_ENV)} PATH={PATH} \\\n'
        '  /bin/sh -c \'cd "$0" 2>/dev/null || { echo "in-root: $0 is not under /tmp or the repository" >&2; '
        'exit 125; }; exec "$@"\' "$wd" "$@"\n'
    )
    quoted = inner.replace("'", "'\\''")
    return (
        "#!/bin/sh\n"
        "# Made by python -m eval.nemo_gym.gym_root: runs a command in the Python 3.13 root filesystem below,\n"
        "# in a mount namespace of its own (/dev /proc /sys /tmp and the repository bound at the same paths).\n"
        f"exec unshare --mount --propagation private -- /bin/sh -c '{quoted}' \\\n"
        f'  {root} {REPO} "$PWD" {command}\n'
    )


def _step(name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> float:
    start = time.monotonic()
    print(f"gym_root: {name} ...", file=sys.stderr, flush=True)
    with log.open("a") as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    seconds = time.monotonic() - start
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise EvalError(f"{name} failed ({done.returncode}, {seconds:.0f} s); {log}:\n{tail}")
    print(f"gym_root: {name}: {seconds:.0f} s", file=sys.stderr, flush=True)
    return seconds


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()) + "/"
    lines = Path("/proc/mounts").read_text().splitlines()
    return [p for line in lines if (p := line.split()[1].replace("\\040", " ")).startswith(prefix)]


def _remove(path: Path) -> None:
    """Remove a root filesystem, unmounting first whatever a killed command left bound in it."""
    if not path.exists():
        return
    for mount in sorted(_mounts_under(path), reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True, check=False)
    if left := _mounts_under(path):
        raise EvalError(f"{path}: still has mounts {left}; unmount them and remove it by hand")
    shutil.rmtree(path)


def write_wrappers(root: Path, bin_dir: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("in-root", wrapper(root)),
        ("python", wrapper(root, f'{VENV}/bin/python "$@"')),
        ("gym", wrapper(root, f'{VENV}/bin/gym "$@"')),
    ):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)


def build(args: Args) -> dict[str, float]:
    """Build ``args.root`` unless it holds this recipe; write the wrappers. Seconds per step done."""
    root = args.root.resolve()
    marker = root / MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("recipe") == RECIPE:
        write_wrappers(root, args.bin)
        print(f"gym_root: {root} is built (nemo-gym {NEMO_GYM}): reused", file=sys.stderr)
        return {}
    if os.geteuid() != 0:
        raise EvalError("building the Gym root filesystem needs root (debootstrap, unshare --mount, chroot)")
    for tool in ("debootstrap", "unshare", "chroot"):
        if shutil.which(tool) is None:
            raise EvalError(f"{tool} is not on PATH: apt-get install debootstrap util-linux coreutils")
    if not DEBOOTSTRAP_SCRIPT.is_file():
        raise EvalError(f"{DEBOOTSTRAP_SCRIPT} is missing: apt-get install debootstrap")
    partial = root.with_name(root.name + ".partial")
    _remove(partial)
    _remove(root)  # an older recipe's
    partial.parent.mkdir(parents=True, exist_ok=True)
    log = root.with_name(root.name + ".log")
    log.write_text("")
    seconds: dict[str, float] = {}
    mirror = args.mirror or debian_mirror()
    include = f"--include={','.join(PACKAGES)}"
    argv = ["debootstrap", "--variant=minbase", include, SUITE, str(partial), mirror, str(DEBOOTSTRAP_SCRIPT)]
    seconds["debootstrap"] = _step(f"debootstrap {SUITE} from {mirror}", argv, log)
    for pattern in ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*_*"):
        for path in partial.glob(pattern):
            path.unlink()
    shutil.copyfile("/etc/resolv.conf", partial / "etc" / "resolv.conf")
    (partial / "etc" / "pip.conf").write_text(build_pip_config())
    for crt in sorted(CA_DIR.glob("*.crt")) if CA_DIR.is_dir() else []:
        shutil.copyfile(crt, partial / "usr" / "local" / "share" / "ca-certificates" / crt.name)
    for target in ("dev", "proc", "sys", "tmp", str(REPO).lstrip("/")):
        (partial / target).mkdir(parents=True, exist_ok=True)
    seconds["ca-certificates"] = _step(
        "update-ca-certificates", ["chroot", str(partial), "update-ca-certificates"], log
    )
    in_root = partial.with_name(partial.name + ".in-root")
    in_root.write_text(wrapper(partial))
    in_root.chmod(0o755)
    try:
        install = (
            f"python3.13 -m venv {VENV} && {VENV}/bin/pip install --quiet uv=={UV} && "
            f"uv pip install --python {VENV}/bin/python nemo-gym=={NEMO_GYM}"
        )
        env = os.environ | {"UV_NATIVE_TLS": "1", "SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt"}
        seconds["nemo-gym"] = _step(
            f"venv {VENV}: uv, nemo-gym {NEMO_GYM}", [str(in_root), "sh", "-c", install], log, env
        )
    finally:
        in_root.unlink()
    (partial / MARKER).write_text(json.dumps({"recipe": RECIPE, "seconds": seconds}, indent=1) + "\n")
    partial.rename(root)
    write_wrappers(root, args.bin)
    print(f"gym_root: built {root} in {sum(seconds.values()):.0f} s; wrappers in {args.bin}", file=sys.stderr)
    return seconds


def main(args: Args) -> int:
    build(args)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(tyro.cli(Args, description=__doc__)))
    except EvalError as e:
        print(f"python -m eval.nemo_gym.gym_root: error: {e}", file=sys.stderr)
        sys.exit(2)
