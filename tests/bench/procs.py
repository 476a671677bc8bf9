"""Child processes for the proxy benchmark: the fake upstream and mitmdump, bounded and reaped.

Used by ``python -m tests.bench.proxy``. Every child stops by itself: it gets SIGTERM when the
benchmark dies (Linux ``PR_SET_PDEATHSIG``), mitmdump runs under ``timeout`` and the upstream under
its own ``--max-seconds``, and ``stop`` terminates (then kills) it in the caller's ``finally``.
"""

from __future__ import annotations

import ctypes
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["ROOT", "cpu_seconds", "die_with_parent", "free_port", "start_mitmdump", "start_upstream", "stop", "tail"]

ROOT = Path(__file__).resolve().parents[2]


def die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM when the benchmark dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tail(log: Path, n: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:]) if log.exists() else ""


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()  # mitmdump shuts down cleanly on SIGTERM and runs the addons' done() hooks
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds a process has used so far (Linux /proc, 10 ms resolution)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def start_upstream(limit_s: int) -> tuple[subprocess.Popen[bytes], int]:
    """The fake vLLM upstream as a subprocess (not a thread: it must not share our GIL); its port."""
    # stdin is a pipe we never write to: if we die it closes and the upstream exits.
    cmd = [sys.executable, "-m", "tests.bench.upstream", "--exit-on-stdin-eof", "--max-seconds", str(limit_s)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, preexec_fn=die_with_parent)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 15.0)
    line = proc.stdout.readline().decode() if ready else ""
    if not line.startswith("listening on"):
        stop(proc)
        raise RuntimeError(f"fake upstream did not start: {line!r}")
    return proc, int(line.rsplit(":", 1)[1])


def start_mitmdump(
    up_port: int,
    log: Path,
    confdir: Path,
    limit_s: int,
    extra: list[str],
    wait_s: float = 30.0,
    python_wrapper: list[Path] | None = None,
) -> tuple[subprocess.Popen[bytes], int, int | None]:
    """A reverse-proxy mitmdump, once it accepts connections: (process, port, pid of mitmdump itself).

    Raises RuntimeError with the exit status and log tail when it exits (mitmdump quits on startup
    errors such as an addon that fails to load or an unknown --set option) or never listens.
    """
    port = free_port()
    # python_wrapper: a script (and its arguments) that runs mitmdump in this Python (a profiler, proxy_profile.py).
    mitmdump = (
        [sys.executable, *map(str, python_wrapper)]
        if python_wrapper
        else [str(Path(sys.executable).parent / "mitmdump")]
    )
    cmd = [*mitmdump, "--mode", f"reverse:http://127.0.0.1:{up_port}"]
    # Its own confdir, so the run leaves no CA files in ~/.mitmproxy.
    cmd += ["--listen-host", "127.0.0.1", "-p", str(port), "-q", "--set", f"confdir={confdir}", *extra]
    wrapped = shutil.which("timeout") is not None
    if wrapped:  # a hard bound on its life, whatever happens to us
        cmd = ["timeout", "-k", "5", str(limit_s), *cmd]
    with log.open("wb") as f:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
        )
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mitmdump exited with status {proc.returncode}:\n{tail(log)}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        except OSError:
            time.sleep(0.1)
            continue
        # mitmdump listens first and quits on startup errors (its errorcheck addon) only after
        # that, so a port that answered once proves nothing yet.
        time.sleep(1.0)
        if proc.poll() is not None:
            raise RuntimeError(f"mitmdump exited with status {proc.returncode}:\n{tail(log)}")
        return proc, port, _child_pid(proc.pid) if wrapped else proc.pid
    stop(proc)
    raise RuntimeError(f"mitmdump not listening after {wait_s:.0f} s:\n{tail(log)}")


def _child_pid(pid: int) -> int | None:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None
