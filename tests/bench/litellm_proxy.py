"""LiteLLM's proxy for the side-by-side benchmark: its own venv, made on first use, and one server.

Used by ``python -m tests.bench.litellm``. ``ensure_venv`` creates ``.venv-litellm`` at the repository
root (``python3 -m venv``, then ``pip install 'litellm[proxy]==VERSION'``, a few minutes) and writes a
stamp last, so a half-made venv is made again; later runs reuse it. ``start_litellm`` runs
``litellm --config`` in front of the fake upstream with ``tests/bench/litellm_logger.py`` as its
logging callback, and returns once it answers ``/health/liveliness``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.bench.procs import ROOT, die_with_parent, free_port, stop, tail

__all__ = ["MODEL", "PIP_SPEC", "VENV", "LiteLLM", "ensure_venv", "start_litellm"]

# 1.108.0: of the releases tried, the newest whose [proxy] extra resolved from PyPI on 2026-12-02
# (1.108.14, 1.109.3 and 1.110.2 pin litellm-proxy / litellm-proxy-extras releases PyPI did not have).
VERSION = "1.108.0"
PIP_SPEC = f"litellm[proxy]=={VERSION}"
VENV = ROOT / ".venv-litellm"
_STAMP = VENV / "polar-bench-stamp"  # holds PIP_SPEC once the install finished
MODEL = "bench-model"  # the name clients ask for, as the fake upstream calls itself


def ensure_venv(log: Path) -> Path:
    """The ``litellm`` executable of ``.venv-litellm``, installing it first when the stamp is missing or stale."""
    litellm = VENV / "bin" / "litellm"
    if _STAMP.is_file() and _STAMP.read_text().strip() == PIP_SPEC and litellm.is_file():
        return litellm
    with log.open("wb") as f:
        # A venv made from inside another one shares nothing with it but the base interpreter.
        for cmd in (
            [sys.executable, "-m", "venv", "--clear", str(VENV)],
            [str(VENV / "bin" / "pip"), "install", PIP_SPEC],
        ):
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{tail(log)}")
    _STAMP.write_text(PIP_SPEC + "\n")
    return litellm


class LiteLLM:
    """A running LiteLLM proxy: its process (a ``timeout`` wrapper), port and master key."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, key: str, log: Path) -> None:
        self.proc, self.port, self.key, self.log = proc, port, key, log


def _config(up_port: int) -> dict[str, object]:
    """The proxy config: the upstream as an OpenAI-compatible model, our JSONL callback, no database."""
    return {
        "model_list": [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": f"openai/{MODEL}",
                    "api_base": f"http://127.0.0.1:{up_port}/v1",
                    "api_key": "none",
                },
            }
        ],
        "litellm_settings": {"callbacks": "tests.bench.litellm_logger.handler"},
    }


def start_litellm(
    litellm: Path, up_port: int, workdir: Path, record_path: Path, limit_s: int, wait_s: float = 180.0
) -> LiteLLM:
    """``litellm --config`` on a free loopback port with one uvicorn worker (its default), once it answers.

    Raises RuntimeError with the log tail when it exits or does not answer within ``wait_s`` (it
    takes 10-30 s to start: it imports most of its providers).
    """
    port, key = free_port(), "sk-" + secrets.token_hex(32)  # no master key: it refuses to start
    config = workdir / "litellm-config.yaml"
    config.write_text(json.dumps(_config(up_port), indent=2))  # JSON is YAML
    env = os.environ | {
        "PYTHONPATH": str(ROOT),  # to import tests.bench.litellm_logger by name
        "POLAR_BENCH_LITELLM_LOG": str(record_path),
        "LITELLM_MASTER_KEY": key,
        # The box may be offline: use the cost map shipped in the wheel instead of fetching one (with retries).
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    cmd = [str(litellm), "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    if shutil.which("timeout"):  # a hard bound on its life, whatever happens to us
        cmd = ["timeout", "-k", "5", str(limit_s), *cmd]
    log = workdir / "litellm.log"
    with log.open("wb") as f:
        proc = subprocess.Popen(
            cmd,
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"litellm exited with status {proc.returncode}:\n{tail(log)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/liveliness", timeout=2) as r:
                if r.status == 200:
                    return LiteLLM(proc, port, key, log)
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"litellm not answering after {wait_s:.0f} s:\n{tail(log)}")
