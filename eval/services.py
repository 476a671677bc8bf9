"""Start and stop the loopback services of a run: the reference server and `mitmdump` with the capture addon.

Used by the demo, rollouts, tests and benchmarks. Each service is a real subprocess on a free
127.0.0.1 port, its output in a log file, stopped on ``stop()``/``with`` exit, also when startup fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ADDON = ROOT / "addon" / "polar.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """A subprocess listening on ``self.port``; ready once the port accepts connections."""

    def __init__(self, cmd: list[str], *, port: int, log: Path, startup_timeout: float = 120.0) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self._log_file = open(log, "ab")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT
        )
        try:
            self._wait_until_listening(startup_timeout)
        except Exception as e:
            self.stop()
            raise RuntimeError(f"{cmd[0]} did not start ({e}); its output:\n{self.output()}") from e

    def _wait_until_listening(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"nothing listens on port {self.port} after {timeout:.0f} s")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # mitmdump shuts down cleanly on SIGTERM: the addon flushes its writer
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()

    def __enter__(self) -> "Service":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ReferenceServer(Service):
    """``python -m eval.serve --model DIR`` (see eval/serve.py)."""

    def __init__(
        self,
        model: Path,
        *,
        log: Path,
        script: Path | None = None,
        seed: int = 0,
        lora: dict[str, Path] | None = None,
        flavor: str = "vllm",
    ) -> None:
        port = free_port()
        cmd = [sys.executable, "-m", "eval.serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--seed", str(seed)] + (["--script", str(script)] if script else [])
        cmd += ["--flavor", flavor]
        if lora:
            cmd += ["--lora-modules", *(f"{name}={path}" for name, path in lora.items())]
        super().__init__(cmd, port=port, log=log)


class Mitmdump(Service):
    """``mitmdump --mode reverse:UPSTREAM -s addon/polar.py`` on loopback; ``addon=False`` runs it bare."""

    def __init__(self, upstream: str, polar_dir: Path | None, *, log: Path, addon: bool = True, **options: str) -> None:
        port = free_port()
        mitmdump = Path(sys.executable).parent / "mitmdump"
        cmd = [str(mitmdump), "--mode", f"reverse:{upstream}", "--listen-host", "127.0.0.1", "-p", str(port)]
        cmd += ["--set", "flow_detail=0", "--set", "termlog_verbosity=warn"]
        if addon:
            cmd += ["-s", str(ADDON), "--set", f"polar_dir={polar_dir}"]
            cmd += [arg for name, value in options.items() for arg in ("--set", f"{name}={value}")]
        super().__init__(cmd, port=port, log=log)
