"""Processes of a run: free ports, the loopback services (the reference server and `mitmdump` with the capture
addon), and stopping a process tree.

Used by the demo, rollouts, the rollout service, tests and benchmarks. Each service is a real subprocess on a free
127.0.0.1 port, its output in a log file, stopped on ``stop()``/``with`` exit, also when startup fails. With
``ReferenceServer.forked`` (the tests set it) reference servers are forked from one forkserver per process that
has imported torch, transformers and the server once (about 5 CPU-seconds), so each server after the first
starts in a fraction of a second.
:func:`stop_tree` stops a harness, a grading script or a phase with everything it started.

:func:`check_proxy` is the one place that decides whether a proxy records: it asks the addon's
``GET /polar/health``. mitmproxy keeps forwarding when the addon failed to load (a repeated
``--set polar_...`` option is enough), so a port that answers proves nothing; the rollout CLI, the
rollout service and :class:`Mitmdump` (hence the demo) all refuse a proxy that does not answer it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import multiprocessing
import os
import runpy
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any, ClassVar, Self

import psutil

from addon import health

ROOT = Path(__file__).resolve().parents[2]
ADDON = ROOT / "addon" / "polar.py"
HEALTH_PATH = health.PATH  # addon/polar.py answers it itself
# Through a regular-mode (transparent) proxy the health request needs some plain-HTTP origin; the addon
# answers the path before the host matters, so this name is never resolved.
HEALTH_ORIGIN = "http://polar.invalid"


class ProxyNotRecording(ConnectionError):  # an OSError: the CLIs print it as an error, not a traceback
    """The proxy does not answer ``GET /polar/health`` as the capture addon, or says it cannot record.

    ``answered``: something answered (the upstream through an addon-less proxy, or the addon itself
    saying it cannot write); false when nothing did.
    """

    def __init__(self, message: str, *, answered: bool) -> None:
        super().__init__(message)
        self.answered = answered


def check_proxy(url: str, *, transparent: bool = False, timeout: float = 10.0) -> dict[str, Any]:
    """The addon's health answer from the proxy at ``url`` (without /v1); raises :class:`ProxyNotRecording`.

    ``transparent``: ``url`` is a regular-mode proxy (``--transparent`` rollouts), asked as a proxy.
    """
    base = url.rstrip("/").removesuffix("/v1")
    if transparent:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": base}))
        target = HEALTH_ORIGIN + HEALTH_PATH
    else:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via the caller's proxy
        target = base + HEALTH_PATH
    hint = (
        f"start it with `mitmdump ... -s {ADDON.relative_to(ROOT)}` and read its log: mitmproxy keeps forwarding "
        "without the addon when the script fails to load (e.g. a --set polar_... option given twice)"
    )
    nonce = secrets.token_hex(16)  # only the addon answers with its proof (addon/health.py)
    request = urllib.request.Request(target, headers={health.NONCE_HEADER: nonce})
    try:
        with opener.open(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except OSError as e:
        raise ProxyNotRecording(
            f"the capture proxy {base} does not answer GET {HEALTH_PATH} ({e}); {hint}", answered=False
        ) from e
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    if status != 200 or not isinstance(answer, dict) or answer.get("proof") != health.proof(nonce):
        got = raw[:200].decode("utf-8", "replace")
        raise ProxyNotRecording(
            f"{base} answers GET {HEALTH_PATH} with {status} {got!r}, not the capture addon's health: "
            f"the addon is not loaded, so calls through it would not be recorded; {hint}",
            answered=True,
        )
    if not answer.get("writable"):
        raise ProxyNotRecording(
            f"the capture proxy {base} cannot write its records ({answer.get('problem') or 'polar_dir is not writable'}"
            f", polar_dir {answer.get('options', {}).get('polar_dir')}): it would refuse every model call",
            answered=True,
        )
    return answer


def stop_tree(proc: subprocess.Popen[bytes] | subprocess.Popen[str], *, grace: float = 0.0) -> None:
    """Stop ``proc`` and every process under it, then reap it. Harness sessions and shell tools start their own
    process groups (``start_new_session``), so the tree is followed by parent links, and the group ``proc`` leads,
    if any, is signalled too: it holds the background children that outlived their parent. With ``grace`` > 0
    each gets SIGTERM first and SIGKILL only if it is still there ``grace`` seconds later (mitmdump, the trainer);
    with 0, SIGKILL at once."""
    tree: list[psutil.Process] = []
    if proc.poll() is None:  # once reaped, its pid may be another process's
        with contextlib.suppress(psutil.NoSuchProcess):
            parent = psutil.Process(proc.pid)
            tree = [parent, *parent.children(recursive=True)]
    for sig in ([signal.SIGTERM] if grace > 0 else []) + [signal.SIGKILL]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)  # no such group unless proc was started with start_new_session
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)
        if sig == signal.SIGTERM:
            tree = psutil.wait_procs(tree, timeout=grace)[1]
    proc.wait()


class OutputTail:
    """A process's output stream, read on a thread of its own: its size and its last ``keep`` bytes, never more
    in memory, whatever the process prints (a session printing 800 MB would otherwise hold them all)."""

    def __init__(self, stream: IO[bytes], keep: int) -> None:
        self.keep = keep
        self.size = 0
        self._tail = bytearray()
        self._stream = stream
        self._thread = threading.Thread(target=self._read, name="output-tail", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with self._stream:
            while chunk := os.read(self._stream.fileno(), 1 << 16):  # what the pipe holds, not a full buffer
                self.size += len(chunk)
                self._tail += chunk
                if len(self._tail) > 2 * self.keep:  # trimmed in steps, not on every chunk
                    del self._tail[: -self.keep]

    def text(self, wait: float = 5.0) -> str:
        """What was kept, once the stream ends (or ``wait`` seconds on: a background child that escaped its
        session may hold the pipe open), with a first line saying how much was left out."""
        self._thread.join(wait)
        tail = bytes(self._tail[-self.keep :])
        text = tail.decode(errors="replace")
        if self.size > len(tail):
            text = f"[polar: {self.size} bytes of output, the last {len(tail)} kept]\n{text}"
        return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Service:
    """A subprocess listening on ``self.port``; ready once the port accepts connections (``_wait_until_ready``)."""

    def __init__(
        self,
        cmd: list[str],
        *,
        port: int,
        log: Path,
        startup_timeout: float = 120.0,
        env: dict[str, str] | None = None,
        own_group: bool = False,
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self._log_file = open(log, "ab")  # noqa: SIM115 - the process writes it until close()
        self.proc = self._start(cmd, env, own_group)
        try:
            self._wait_until_ready(startup_timeout)
        except Exception as e:
            self.stop()
            # The end of the output: vLLM's start-up log runs to thousands of lines.
            raise RuntimeError(
                f"{type(self).__name__} did not start ({e}); its output ends:\n{self.output()[-6000:]}"
            ) from e

    def _start(self, cmd: list[str], env: dict[str, str] | None, own_group: bool) -> subprocess.Popen[bytes] | Forked:
        return subprocess.Popen(
            cmd,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
            env=env,
            start_new_session=own_group,
        )

    def _wait_until_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}")
            # Its own socket, not a port that answers: free_port() can hand the same port to two services started
            # at once, and the other one's answer would pass for this one's.
            if self._listens():
                return
            time.sleep(0.05)
        raise TimeoutError(f"this process does not listen on port {self.port} after {timeout:.0f} s")

    def _listens(self) -> bool:
        """Whether this process, or one it started (vLLM's engine), listens on ``self.port``."""
        try:
            root = psutil.Process(self.proc.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            return False
        for process in tree:
            with contextlib.suppress(psutil.Error):
                for conn in process.net_connections("tcp"):
                    if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == self.port:
                        return True
        return False

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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ReferenceServer(Service):
    """``python -m eval serve --model DIR`` (see eval/upstream/server.py)."""

    forked: ClassVar[bool] = False
    """Fork each server from this process's forkserver instead of starting Python afresh: for a process that
    starts many (the test suite). Its command line is then the forkserver's, not ``python -m eval serve``, and,
    as with any multiprocessing start, a script that sets it needs the ``if __name__ == "__main__":`` guard."""

    def __init__(
        self,
        model: Path,
        *,
        log: Path,
        script: Path | None = None,
        seed: int = 0,
        lora: dict[str, Path] | None = None,
        flavor: str = "vllm",
        max_model_len: int | None = None,
        dtype: str = "float32",
        share_prefix: bool = True,
    ) -> None:
        # float32 unless told: the tests compare the log-probs served with the trainer's to fp32 tolerances; the
        # demo passes auto (bf16 where this CPU runs it faster, eval/upstream/server.py).
        port = free_port()
        cmd = [sys.executable, "-m", "eval", "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--dtype", dtype] + ([] if share_prefix else ["--no-share-prefix"])
        cmd += ["--seed", str(seed)] + (["--script", str(script)] if script else [])
        cmd += ["--flavor", flavor] + (["--max-model-len", str(max_model_len)] if max_model_len else [])
        if lora:
            cmd += ["--lora-modules", *(f"{name}={path}" for name, path in lora.items())]
        super().__init__(cmd, port=port, log=log)

    def _start(self, cmd: list[str], env: dict[str, str] | None, own_group: bool) -> subprocess.Popen[bytes] | Forked:
        """With ``forked``: ``python -m eval serve ...`` forked from the forkserver (same arguments, log, working
        directory and environment as the subprocess would have)."""
        if not self.forked:
            return super()._start(cmd, env, own_group)
        argv = cmd[cmd.index("eval") + 1 :]
        process = _forkserver().Process(target=_serve, args=(argv, str(self.log), dict(env or os.environ)))
        process.start()
        return Forked(process)


# The imports a reference server spends its start-up on, torch's and transformers' lazy ones included.
SERVER_IMPORTS = [
    "eval.__main__",
    "eval.upstream.server",
    "transformers.core_model_loading",
    "transformers.masking_utils",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3.modeling_qwen3",
]


@functools.cache
def _forkserver() -> multiprocessing.context.ForkServerContext:
    """This process's forkserver, started with the first reference server. It only imports (SERVER_IMPORTS) and
    runs nothing, so no thread pool exists to be copied half-held into a forked server."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(SERVER_IMPORTS)
    return context


def _serve(argv: list[str], log: str, env: dict[str, str]) -> None:
    """The forked server: the subprocess's working directory, environment and log, then ``python -m eval ARGV``."""
    os.chdir(ROOT)
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = [sys.executable, *argv]
    runpy.run_module("eval", run_name="__main__", alter_sys=True)  # python -m eval ARGV


class Forked:
    """A forked server process behind the part of ``subprocess.Popen`` that Service and stop_tree use."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process
        assert process.pid is not None  # started
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"reference server {self.pid}", timeout or 0)
        return self._process.exitcode

    def terminate(self) -> None:
        self._process.terminate()

    def kill(self) -> None:
        self._process.kill()


def new_secret_file(path: Path) -> Path:
    """A new secret for the addon's ``polar_secret_file`` at ``path``: 32 random bytes as hex, mode 0600, created
    exclusively (an existing file raises FileExistsError, never replaced). Sign session keys for it with
    ``addon.session.signed_key(session_id, addon.session.read_secret(path))``."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # whatever the umask
        f.write(secrets.token_hex(32) + "\n")
    return path


class Mitmdump(Service):
    """``mitmdump --mode reverse:UPSTREAM -s addon/polar.py`` on loopback; ``addon=False`` runs it bare.

    ``secret_file`` (:func:`new_secret_file`): the addon then takes only session keys signed with it
    (``--set polar_secret_file=...``, addon/session.py) and refuses every other call with 403."""

    def __init__(
        self,
        upstream: str,
        polar_dir: Path | None,
        *,
        log: Path,
        addon: bool = True,
        startup_timeout: float = 120.0,
        secret_file: Path | None = None,
        **options: str,
    ) -> None:
        port = free_port()
        mitmdump = Path(sys.executable).parent / "mitmdump"
        cmd = [str(mitmdump), "--mode", f"reverse:{upstream}", "--listen-host", "127.0.0.1", "-p", str(port)]
        cmd += ["--set", "flow_detail=0", "--set", "termlog_verbosity=warn"]
        if secret_file is not None and not addon:
            raise ValueError("secret_file needs the addon: a bare mitmdump checks no keys")
        self.secret_file = secret_file
        if addon:
            cmd += ["-s", str(ADDON), "--set", f"polar_dir={polar_dir}"]
            if secret_file is not None:
                cmd += ["--set", f"polar_secret_file={secret_file}"]
            cmd += [arg for name, value in options.items() for arg in ("--set", f"{name}={value}")]
        super().__init__(cmd, port=port, log=log, startup_timeout=startup_timeout)
        self.health: dict[str, Any] | None = None
        if addon:
            self.health = self._wait_until_recording(startup_timeout)
            if secret_file is not None and not self.health.get("signed_keys"):
                self.stop()  # an addon that does not know the option would take any key
                raise ProxyNotRecording(
                    f"the capture proxy {self.url} does not check signed keys (its health: {self.health})",
                    answered=True,
                )

    def _wait_until_recording(self, timeout: float) -> dict[str, Any]:
        """Poll the addon's health: mitmdump may answer a moment before its script is loaded (or has failed
        to load); an answer that is not the addon's, for 2 s on end, means it never will be."""
        deadline, foreign_since = time.time() + timeout, None
        while True:
            try:
                return check_proxy(self.url, timeout=5.0)
            except ProxyNotRecording as e:
                now = time.time()
                foreign_since = (foreign_since or now) if e.answered else None
                if self.proc.poll() is None and now < deadline and (foreign_since is None or now - foreign_since < 2.0):
                    time.sleep(0.2)
                    continue
                self.stop()
                raise ProxyNotRecording(f"{e}\nmitmdump's output:\n{self.output()}", answered=e.answered) from e
