"""Rollouts as a service: submit a task with N samples over loopback HTTP, get back patches, rewards and traces.

    python -m eval serve-rollouts --proxy http://127.0.0.1:8080 --captures captures --root runs/service \\
        [--port 8090] [--workers 2] [--session-concurrency 1] [--token-file FILE] [--tokenizer DIR]
        [--runtime local|docker] [--session-secret FILE]

The proxy (mitmdump with addon/polar.py) is the user's; ``--captures`` is its ``polar_dir`` (checked at start against
the proxy's ``GET /polar/health``: the service refuses a proxy that would not record, or records elsewhere). Every job
runs the batch phases as subprocesses, each in its own process group, one after the other, in its own folder
``ROOT/<job_id>/``: ``python -m eval rollout`` (run/), ``python -m eval score run/``, then the job's sessions' records
copied out of the captures (captures.jsonl), ``python -m reconstruct`` on them (trajectories.parquet) and ``python -m
eval join`` (rewards on the traces). A crashed or hung harness is a session status (eval/sessions/rollout.py); a failed
grade or reconstruction is kept in the job's ``phase_errors`` and its sessions score reward 0 with that reason, and the
service goes on. ``job.json`` (written atomically) holds the parameters and the status, so a restart lists every
finished job; jobs still queued are queued again, jobs caught running are marked failed.

Where sessions run is the job's ``runtime`` (default: the service's ``--runtime``), passed on as ``python -m eval
rollout --runtime`` (eval/sessions/runtime.py): ``local`` runs the harness and the model's commands on this machine
(unsafe for untrusted models); ``docker`` runs each session in its task's own image with no network but its proxy,
and grades it in a fresh container (``python -m eval score --runner docker``).

Routes (JSON; with ``--token-file`` every route but /health needs ``Authorization: Bearer <token>``):

    GET  /health                       {status: "ok", proxy, jobs: {queued, running, done, failed, cancelled}}
    POST /v1/jobs                      202 {job_id, status: "queued"}; 400 {error} naming the field. Body:
         {"instance": {SWE-bench 5.x instance} | "instance_id": ID [, "tasks": "toy" | FILE],
          "harness": a preset name (eval/harness/presets.py), "samples": 1, "timeout": 1800 (s per
          session), "model": "tiny", "max_tokens": null, "command": null (shell only), "metadata": {},
          "runtime": the service's --runtime | "local" | "docker" (eval/sessions/runtime.py RUNTIMES)}
    GET  /v1/jobs                      {jobs: [job.json, ...]}
    GET  /v1/jobs/<id>                 job.json: {job_id, status: queued|running|done|failed|cancelled, phase,
                                       params, submitted_at, started_at, finished_at, error, phase_errors}
    GET  /v1/jobs/<id>/results[?traces=1]
                                       {job_id, status, error, phase_errors, trajectories: PARQUET, sessions: [
                                        {session_id, sample_id, status, exit_code, duration_s, patch, error,
                                         reward, resolved, reason, grade_error, calls, incomplete_calls, n_traces,
                                         traces: [{trace_id, prompt_ids, response_ids, loss_mask, logprobs, ...}]}]}
    POST /v1/jobs/<id>/cancel          the job.json, now cancelled (its processes killed); 409 when finished
"""

from __future__ import annotations

import dataclasses
import datetime
import hmac
import ipaddress
import json
import queue
import secrets
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from addon.session import read_secret
from eval.harness.presets import PRESETS
from eval.service.results import copy_session_records, session_results
from eval.sessions.containers import ContainerError, require_daemon
from eval.sessions.procs import ProxyNotRecording, check_proxy, stop_tree
from eval.sessions.runtime import RUNTIMES, RuntimeName
from eval.tasks.load import TaskError, load_tasks, save_tasks, validate
from reconstruct.files import write_atomic

__all__ = ["Args", "JobError", "Service", "main"]

HARNESSES = tuple(PRESETS)
FINISHED = ("done", "failed", "cancelled")
ERROR_TAIL = 2000  # characters of a failed phase's output kept in job.json
PHASE_SLACK_S = 300.0  # beyond the harness timeouts: checkouts, patch taking, process startup


@dataclasses.dataclass
class Args:
    """Serve rollouts over HTTP on loopback."""

    # ---- the capture proxy, started by the user
    proxy: str
    """Base URL of mitmdump with the capture addon, e.g. http://127.0.0.1:8080."""
    captures: Path
    """The proxy's polar_dir: each job copies its sessions' records out of it."""
    session_secret: Path | None = None
    """The proxy's polar_secret_file, when it checks keys: each harness then gets its session's signed key
    (python -m eval rollout --session-secret), so no session can write calls into another's."""
    # ---- the service
    root: Path = Path("runs/service")
    """One folder per job here (job.json, run/, captures.jsonl, trajectories.parquet)."""
    host: str = "127.0.0.1"
    """Address to listen on; anything but loopback needs --allow-remote."""
    port: int = 8090
    """TCP port."""
    allow_remote: bool = False
    """Listen beyond loopback (captures hold code and prompts: put a token on it)."""
    token_file: Path | None = None
    """File holding a bearer token that every route but /health then requires."""
    # ---- limits
    workers: int = 2
    """Jobs run at a time; more wait in a queue."""
    session_concurrency: int = 1
    """Sessions of one job run at a time (python -m eval rollout --concurrency)."""
    grade_timeout: float = 900.0
    """Seconds one eval script may run (python -m eval score --timeout)."""
    # ---- where sessions run (eval/sessions/runtime.py)
    runtime: RuntimeName = "local"
    """A job's runtime unless it names one: local runs the harness and the model's commands on this machine,
    UNSAFE for untrusted models; docker runs each session in its task's image (python -m eval images build) with
    no network but its proxy, and grades it in a fresh container (score --runner docker)."""
    # ---- reconstruction
    tokenizer: str | None = None
    """Passed to python -m reconstruct --tokenizer, for calls captured without token ids."""

    def __post_init__(self) -> None:
        if self.workers < 1 or self.session_concurrency < 1:
            n = (self.workers, self.session_concurrency)
            raise ValueError(f"--workers and --session-concurrency must be >= 1, got {n}")
        loopback = self.host == "localhost" or ipaddress.ip_address(self.host).is_loopback
        if not loopback and not self.allow_remote:
            raise ValueError(f"--host {self.host} is not loopback: add --allow-remote (and --token-file) to mean it")
        if self.token_file is not None and not self.token_file.read_text().strip():
            raise ValueError(f"--token-file {self.token_file} is empty")
        if self.runtime not in RUNTIMES:
            raise ValueError(f"--runtime {self.runtime!r}: not one of {', '.join(RUNTIMES)}")
        if self.session_secret is not None:
            try:
                read_secret(self.session_secret)
            except (OSError, ValueError) as e:
                raise ValueError(f"--session-secret {self.session_secret}: {e}") from e


class JobError(ValueError):
    """A submission or request the service refuses; ``status`` is the HTTP status, the message names the field."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Readers (and a restart) never see a half-written file: temporary file, then rename."""
    write_atomic(path, json.dumps(data, indent=1).encode())


def parse_submission(body: Any, runtime: str = "local") -> tuple[dict[str, Any], dict[str, Any]]:
    """(the instance, the job parameters) of a ``POST /v1/jobs`` body, ``runtime`` the service's default;
    JobError naming the field otherwise."""
    if not isinstance(body, dict):
        raise JobError("the body must be a JSON object")
    known = {
        "instance",
        "tasks",
        "instance_id",
        "harness",
        "samples",
        "timeout",
        "model",
        "max_tokens",
        "command",
        "metadata",
        "runtime",
    }
    if extra := sorted(set(body) - known):
        raise JobError(f"unknown fields {extra}; known: {sorted(known)}")
    if ("instance" in body) == ("instance_id" in body):
        raise JobError('give "instance" (a SWE-bench instance) or "instance_id" (with "tasks", default "toy"): one')
    try:
        if "instance" in body:
            instance = validate(dict(body["instance"]), "instance")
        else:
            instance = load_tasks(str(body.get("tasks", "toy")), [str(body["instance_id"])])[0]
    except (TaskError, TypeError, ValueError, KeyError) as e:
        raise JobError(f"instance: {e}") from e
    params = {
        "harness": body.get("harness"),
        "samples": body.get("samples", 1),
        "timeout": body.get("timeout", 1800.0),
        "model": body.get("model", "tiny"),
        "max_tokens": body.get("max_tokens"),
        "command": body.get("command"),
        "metadata": body.get("metadata", {}),
        "runtime": body.get("runtime", runtime),
        "instance_id": instance["instance_id"],
    }
    if params["harness"] not in HARNESSES:
        raise JobError(f"harness: {params['harness']!r} is not one of {list(HARNESSES)}")
    if not (isinstance(params["samples"], int) and params["samples"] >= 1):
        raise JobError(f"samples: must be an integer >= 1, got {params['samples']!r}")
    if not (isinstance(params["timeout"], int | float) and params["timeout"] > 0):
        raise JobError(f"timeout: must be a positive number of seconds, got {params['timeout']!r}")
    if not isinstance(params["model"], str):
        raise JobError(f"model: must be a string, got {params['model']!r}")
    if params["max_tokens"] is not None and not (isinstance(params["max_tokens"], int) and params["max_tokens"] > 0):
        raise JobError(f"max_tokens: must be a positive integer, got {params['max_tokens']!r}")
    if (params["harness"] == "shell") != isinstance(params["command"], str):
        raise JobError('command: the shell harness needs a "command" string, and only it takes one')
    if not isinstance(params["metadata"], dict):
        raise JobError("metadata: must be a JSON object")
    if not (isinstance(params["runtime"], str) and params["runtime"] in RUNTIMES):
        raise JobError(f"runtime: {params['runtime']!r} is not one of {list(RUNTIMES)}")
    return instance, params


def runtime_of(params: dict[str, Any]) -> str:
    """A job's runtime: ``local`` for one submitted before jobs had one (its job.json has none)."""
    runtime: str = params.get("runtime", "local")
    return runtime


def rollout_command(args: Args, folder: Path, params: dict[str, Any]) -> list[str]:
    """``python -m eval rollout`` for the job in ``folder``, into ``folder/run``."""
    cmd = [
        sys.executable,
        "-m",
        "eval",
        "rollout",
        "--tasks",
        str(folder / "instance.jsonl"),
        "--out",
        str(folder / "run"),
        "--harness",
        params["harness"],
        "--samples",
        str(params["samples"]),
        "--proxy",
        args.proxy,
        "--model",
        params["model"],
        "--timeout",
        str(params["timeout"]),
        "--concurrency",
        str(args.session_concurrency),
        "--runtime",
        runtime_of(params),
    ]
    cmd += ["--command", params["command"]] if params["command"] is not None else []
    cmd += ["--max-tokens", str(params["max_tokens"])] if params["max_tokens"] is not None else []
    cmd += ["--session-secret", str(args.session_secret.resolve())] if args.session_secret is not None else []
    return cmd


def score_command(args: Args, folder: Path, params: dict[str, Any]) -> list[str]:
    """``python -m eval score`` on the job's run: in a fresh container when its sessions ran in one."""
    runner = "docker" if runtime_of(params) == "docker" else "local"
    cmd = [sys.executable, "-m", "eval", "score", str(folder / "run"), "--timeout", str(args.grade_timeout)]
    return [*cmd, "--concurrency", "1", "--runner", runner]


class Service:
    """Jobs on disk under ``args.root``, run by ``args.workers`` threads; thread-safe."""

    def __init__(self, args: Args) -> None:
        self.args = args
        self.root = args.root.resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._jobs: dict[str, dict[str, Any]] = {}
        self._procs: dict[str, subprocess.Popen[bytes]] = {}  # job id → its running phase
        self._queue: queue.Queue[str] = queue.Queue()
        for path in sorted(self.root.glob("*/job.json")):
            job = json.loads(path.read_text())
            if job["status"] == "running":
                job |= {"status": "failed", "error": "the service stopped while this job ran; submit it again"}
                _write_json(path, job)
            self._jobs[job["job_id"]] = job
            if job["status"] == "queued":
                self._queue.put(job["job_id"])
        for n in range(args.workers):
            threading.Thread(target=self._worker, name=f"job-worker-{n}", daemon=True).start()

    # ---- the routes' operations
    def submit(self, body: Any) -> dict[str, Any]:
        instance, params = parse_submission(body, self.args.runtime)
        if params["runtime"] == "docker":  # refused now, not as a job whose every session fails to start
            try:
                require_daemon()
            except ContainerError as e:
                raise JobError(f"runtime: docker: {e}") from e
        job_id = f"job-{datetime.datetime.now(datetime.UTC):%Y%m%dT%H%M%S}-{secrets.token_hex(4)}"
        folder = self.root / job_id
        folder.mkdir()
        save_tasks([instance], folder / "instance.jsonl")
        job = {
            "job_id": job_id,
            "status": "queued",
            "phase": None,
            "submitted_at": _now(),
            "started_at": None,
            "finished_at": None,
            "params": params,
            "error": None,
            "phase_errors": {},
        }
        self._save(job)
        self._queue.put(job_id)
        return {"job_id": job_id, "status": "queued"}

    def job(self, job_id: str) -> dict[str, Any]:
        with self._lock:
            if job_id not in self._jobs:
                raise JobError(f"no job {job_id!r}", 404)
            copy: dict[str, Any] = json.loads(json.dumps(self._jobs[job_id]))
            return copy

    def jobs(self) -> list[dict[str, Any]]:
        with self._lock:
            return [json.loads(json.dumps(job)) for job in self._jobs.values()]

    def cancel(self, job_id: str) -> dict[str, Any]:
        job = self.job(job_id)
        if job["status"] in FINISHED:
            raise JobError(f"job {job_id} is already {job['status']}", 409)
        self._update(job_id, status="cancelled", finished_at=_now())
        with self._lock:
            proc = self._procs.get(job_id)
        if proc is not None:
            stop_tree(proc)
        return self.job(job_id)

    def results(self, job_id: str, *, traces: bool) -> dict[str, Any]:
        job = self.job(job_id)
        sessions = session_results(self.root / job_id, job, traces=traces)
        return {
            "job_id": job_id,
            "status": job["status"],
            "phase_errors": job["phase_errors"],
            "error": job["error"],
            "trajectories": str(self.root / job_id / "trajectories.parquet"),
            "sessions": sessions,
        }

    def counts(self) -> dict[str, int]:
        with self._lock:
            statuses = [job["status"] for job in self._jobs.values()]
        return {status: statuses.count(status) for status in ("queued", "running", *FINISHED)}

    def shutdown(self) -> None:
        """Kill the running phases; their jobs read as failed on the next start."""
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            stop_tree(proc)

    # ---- the pipeline
    def _worker(self) -> None:
        while True:
            job_id = self._queue.get()
            if self.job(job_id)["status"] != "queued":  # cancelled while it waited
                continue
            self._update(job_id, status="running", started_at=_now())
            try:
                status, error = self._run(job_id)
            except Exception as e:  # noqa: BLE001 - a bug or a full disk: this job fails, the service goes on
                status, error = "failed", f"{type(e).__name__}: {e}"
            if self.job(job_id)["status"] == "running":
                self._update(job_id, status=status, error=error, phase=None, finished_at=_now())

    def _run(self, job_id: str) -> tuple[str, str | None]:
        folder, params, py = self.root / job_id, self.job(job_id)["params"], sys.executable
        run = folder / "run"
        rollout = rollout_command(self.args, folder, params)
        waves = -(-params["samples"] // self.args.session_concurrency)
        if error := self._phase(job_id, "rollout", rollout, waves * params["timeout"] + PHASE_SLACK_S):
            return "failed", error
        # A failed grade or reconstruction leaves the sessions and their patches: recorded, and the job is done.
        score = score_command(self.args, folder, params)
        score_limit = params["samples"] * self.args.grade_timeout + PHASE_SLACK_S
        graded = self._phase(job_id, "score", score, score_limit) is None
        if self.job(job_id)["status"] != "running":
            return "cancelled", None
        self._update(job_id, phase="captures")
        copy_session_records(self.args.captures, run, folder / "captures.jsonl", folder / "captures.summary.json")
        traces = folder / "trajectories.parquet"
        build = [
            py,
            "-m",
            "reconstruct",
            str(folder / "captures.jsonl"),
            "-o",
            str(traces),
            "--no-progress",
            "--sessions",
            str(run / "sessions.parquet"),
            "--allow-empty",
        ]
        build += ["--tokenizer", self.args.tokenizer] if self.args.tokenizer else []
        if self._phase(job_id, "reconstruct", build, PHASE_SLACK_S) is None and graded:
            join = [py, "-m", "eval", "join", str(traces), str(run), "-o", str(traces)]
            self._phase(job_id, "join", join, PHASE_SLACK_S)
        return "done", None

    def _phase(self, job_id: str, phase: str, cmd: list[str], timeout: float) -> str | None:
        """Run one phase's CLI; None when it succeeded, else why not (also kept in job.json's phase_errors)."""
        folder = self.root / job_id
        with self._lock:
            if self._jobs[job_id]["status"] != "running":
                return "cancelled"
        self._update(job_id, phase=phase)
        with open(folder / f"{phase}.log", "wb") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
            with self._lock:
                self._procs[job_id] = proc
                cancelled = self._jobs[job_id]["status"] != "running"  # a cancel that came before the line above
            if cancelled:
                stop_tree(proc)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                stop_tree(proc)
                code = None
            finally:
                with self._lock:
                    self._procs.pop(job_id, None)
        if code == 0:
            return None
        tail = (folder / f"{phase}.log").read_text(errors="replace")[-ERROR_TAIL:].strip()
        ended = f"killed after {timeout:g} s" if code is None else f"exit {code}"
        error = f"{phase}: {ended}: {tail}"
        job = self.job(job_id)
        self._update(job_id, phase_errors={**job["phase_errors"], phase: error})
        return error

    # ---- state
    def _update(self, job_id: str, **fields: Any) -> None:
        with self._lock:
            job = self._jobs[job_id] | fields
            self._jobs[job_id] = job
            _write_json(self.root / job_id / "job.json", job)

    def _save(self, job: dict[str, Any]) -> None:
        with self._lock:
            self._jobs[job["job_id"]] = job
            _write_json(self.root / job["job_id"] / "job.json", job)


class Handler(BaseHTTPRequestHandler):
    service: Service  # set on the subclass made in serve()
    token: str | None

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        parts = [p for p in url.path.split("/") if p]
        try:
            if (method, parts) == ("GET", ["health"]):
                health = {"status": "ok", "proxy": self.service.args.proxy, "jobs": self.service.counts()}
                return self._send(200, health)
            if self.token is not None:
                given = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
                if not hmac.compare_digest(given.encode(), self.token.encode()):
                    raise JobError("missing or wrong bearer token", 401)
            if parts[:2] != ["v1", "jobs"] or len(parts) > 4:
                raise JobError(f"no route {method} {url.path}", 404)
            match method, parts[2:]:
                case "POST", []:
                    return self._send(202, self.service.submit(self._body()))
                case "GET", []:
                    return self._send(200, {"jobs": self.service.jobs()})
                case "GET", [job_id]:
                    return self._send(200, self.service.job(job_id))
                case "GET", [job_id, "results"]:
                    traces = parse_qs(url.query).get("traces", ["0"])[-1] in ("1", "true")
                    return self._send(200, self.service.results(job_id, traces=traces))
                case "POST", [job_id, "cancel"]:
                    return self._send(200, self.service.cancel(job_id))
            raise JobError(f"no route {method} {url.path}", 404)
        except JobError as e:
            self._send(e.status, {"error": str(e)})

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            return json.loads(self.rfile.read(length) or b"null")
        except json.JSONDecodeError as e:
            raise JobError(f"the body is not JSON: {e}") from e

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        sys.stderr.write(f"{self.address_string()} {format % args}\n")


def serve(args: Args) -> tuple[ThreadingHTTPServer, Service]:
    """The server (not yet serving) and its service; ``server.server_address`` has the bound port."""
    service = Service(args)
    token = args.token_file.read_text().strip() if args.token_file else None
    handler = type("BoundHandler", (Handler,), {"service": service, "token": token})
    return ThreadingHTTPServer((args.host, args.port), handler), service


def check_capture_proxy(args: Args) -> None:
    """Refuse to serve through a proxy that would not record, or records somewhere other than --captures."""
    health = check_proxy(args.proxy)
    polar_dir = Path(health["options"]["polar_dir"])
    if polar_dir != args.captures.resolve():
        raise ProxyNotRecording(
            f"--captures {args.captures} is not where the proxy records: its polar_dir is {polar_dir}", answered=True
        )
    if health.get("signed_keys") and args.session_secret is None:  # every job's rollout would refuse it
        raise ProxyNotRecording(
            f"{args.proxy} accepts only signed session keys: give --session-secret, its polar_secret_file",
            answered=True,
        )


def main(args: Args) -> int:
    try:
        check_capture_proxy(args)
        if args.runtime == "docker":
            require_daemon()  # a job may still name local; this service's default must be able to run
    except (ProxyNotRecording, ContainerError) as e:
        print(f"rollout service: error: {e}", file=sys.stderr)
        return 2
    server, service = serve(args)
    host, port = server.server_address[:2]
    print(f"rollout service on http://{host!s}:{port} (jobs in {service.root})", flush=True)
    # SIGTERM stops serving like Ctrl-C, so the running phases are killed rather than left orphaned.
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        service.shutdown()
    return 0
