"""The Docker CLI as the runtimes and the image builder use it: one call shape, one error, one daemon check.

    from eval.sessions.containers import docker, require_daemon
    require_daemon()                                  # ContainerError naming DOCKER_HOST when none answers
    docker("image", "inspect", "polar-gen/pager:0123abcd")

The daemon is the one ``DOCKER_HOST`` names (``.ci/dockerd start`` prints one of our own), else the system's
socket. The CLI rather than the SDK: ``docker exec`` under a timeout with its output in files, and ``docker build``
from a context folder, are one subprocess each. swebench's grading (eval/score.py ``--runner docker``) uses the
SDK on the same daemon.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from typing import Any

from eval.errors import EvalError

__all__ = [
    "ContainerError", "daemon_address", "docker", "docker_cli", "image_config", "image_exists", "require_daemon",
]  # fmt: skip

START_DAEMON = "start one with `.ci/dockerd start` and export the DOCKER_HOST it prints"


class ContainerError(EvalError):
    """A docker command failed, or no daemon answers."""


def daemon_address() -> str:
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def docker_cli() -> str:
    """The docker CLI's path, for commands that stream (``build``, ``cp``); ContainerError when it is missing."""
    cli = shutil.which("docker")
    if cli is None:
        raise ContainerError(f"the docker CLI is not on PATH; install docker.io (apt) and {START_DAEMON}")
    return cli


def docker(
    *args: str, input: bytes | None = None, timeout: float | None = None, check: bool = True
) -> subprocess.CompletedProcess[bytes]:
    """``docker ARGS`` with its output captured; ContainerError with the command and its stderr when it fails."""
    try:
        done = subprocess.run([docker_cli(), *args], input=input, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        raise ContainerError(f"docker {' '.join(args[:3])} ...: no answer within {timeout:g} s") from e
    if check and done.returncode != 0:
        stderr = done.stderr.decode(errors="replace").strip()[-2000:]
        raise ContainerError(f"docker {' '.join(args[:4])} ... failed ({done.returncode}): {stderr}")
    return done


@functools.cache
def require_daemon() -> str:
    """The daemon's server version; ContainerError naming the address when none answers."""
    done = docker("version", "--format", "{{.Server.Version}}", timeout=30, check=False)
    if done.returncode != 0:
        reason = done.stderr.decode(errors="replace").strip().splitlines()
        raise ContainerError(
            f"no Docker daemon answered at {daemon_address()} ({reason[-1] if reason else 'no output'}); {START_DAEMON}"
        )
    return done.stdout.decode().strip()


def image_exists(name: str) -> bool:
    return docker("image", "inspect", name, check=False).returncode == 0


def image_config(name: str) -> dict[str, Any]:
    """The image's ``Config`` (Env, WorkingDir, Labels, ...); ContainerError when the daemon lacks it."""
    done = docker("image", "inspect", "--format", "{{json .Config}}", name, check=False)
    if done.returncode != 0:
        raise ContainerError(f"image {name} is not on the daemon at {daemon_address()}")
    config: dict[str, Any] = json.loads(done.stdout)
    return config
