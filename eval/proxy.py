"""Start and stop a real `mitmdump` with the capture addon on loopback: used by the demo, rollouts, tests and benchmarks."""

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


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


class Mitmdump:
    """`mitmdump --mode reverse:UPSTREAM -s addon/polar.py` on a loopback port; `addon=False` runs it bare."""

    def __init__(self, upstream: str, polar_dir: Path | None, *, addon: bool = True, log: Path, **options: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        mitmdump = Path(sys.executable).parent / "mitmdump"
        cmd = [str(mitmdump), "--mode", f"reverse:{upstream}", "--listen-host", "127.0.0.1", "-p", str(self.port)]
        cmd += ["--set", "flow_detail=0", "--set", "termlog_verbosity=warn"]
        if addon:
            cmd += ["-s", str(ADDON), "--set", f"polar_dir={polar_dir}"]
            cmd += [arg for k, v in options.items() for arg in ("--set", f"{k}={v}")]
        self._log_file = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_for_port(self.port, self.proc)
        except Exception:
            self.stop()
            raise RuntimeError(f"mitmdump did not start:\n{log.read_text()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # mitmdump shuts down cleanly: the addon's done() flushes the writer
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()

    def __enter__(self) -> "Mitmdump":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
