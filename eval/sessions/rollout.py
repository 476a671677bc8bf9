"""Roll out a harness on tasks x samples through the capture proxy; write the run folder's sessions table.

    python -m eval rollout --tasks toy --harness mini --samples 4 --proxy http://127.0.0.1:8080 --out runs/r1 \\
        [--model NAME] [--concurrency K] [--timeout S] [--instance-ids ID ...] [--command 'CMD {instruction}']
        [--transparent --ca-cert CA.pem]
    python -m eval rollout ... --ray auto --upstream http://127.0.0.1:8000   # over a Ray cluster: ray_rollout.py

For every task and sample: a fresh git checkout of the task's repo (eval.tasks.load.checkout), a session id that is
unique to this run (``<run>-<nonce>-<instance_id>-<sample>``; it is the API key, so the proxy files every call
under it), the harness run non-interactively against the proxy in an isolated HOME under a timeout
(eval/harness/presets.py), then the patch it left: ``git add -A`` and ``git diff --cached --binary`` against the base
commit, without harness and cache folders (HARNESS_FOLDERS). Each session ends with a status: ``ok`` (a patch),
``no_edit`` (exit 0, no change), ``crashed`` (non-zero exit), ``timeout``, ``setup_failed`` (checkout or launch
failed). Sessions run ``--concurrency`` at a time; one that crashes or hangs never stops the others.

Before anything runs, the proxy must answer ``GET /polar/health`` as a recording capture addon
(``eval.sessions.procs.check_proxy``): a mitmdump whose addon did not load forwards every call unrecorded.

Writes RUN_DIR/tasks.jsonl (the instances used), RUN_DIR/sessions.parquet (eval/runs.py; one row per task x
sample in task order, then sample order) and RUN_DIR/logs/<session_id>/{stdout,stderr}.txt. Next:
``python -m eval score RUN_DIR``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import hashlib
import re
import secrets
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import polars as pl
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from addon.session import is_session_id, looks_secret, read_secret, signed_key
from eval.errors import EvalError
from eval.harness.install import install
from eval.harness.presets import MINI, PRESETS, HarnessRun, Name, prepare
from eval.harness.transparent import run_transparent
from eval.runs import LOGS, SESSION_STATUSES, SESSIONS, SESSIONS_SCHEMA, TASKS, write_sessions
from eval.sessions.procs import check_proxy
from eval.sessions.runtime import (
    RUNTIMES,
    Limits,
    PatchError,
    PatchTooLarge,
    RuntimeName,
    remove_leftovers,
    remove_run,
    take_patch,
)
from eval.tasks.load import checkout, load_tasks, save_tasks
from reconstruct.files import write_atomic

__all__ = ["Args", "instruction", "main", "session_id"]

console = Console(stderr=True)

LOCK = ".rollout.lock"  # in the run folder: held by the one rollout writing there
WORK_PREFIX = "polar-rollout-"  # + the folder label: the workspaces' temporary folder
ERROR_TAIL = 2000  # characters of a failed harness's stderr kept in the sessions table


@dataclasses.dataclass
class Args:
    """Run one harness on every task x sample through the proxy."""

    # ---- what to run
    tasks: str
    """"toy" (the shipped toy tasks), "family[:train|:heldout][@SEED]" (the generated family, one split or both, of
    seed SEED, default 0), or a JSON / JSONL / Parquet file of SWE-bench-shaped instances."""
    harness: Name
    """Harness preset (eval/harness/presets.py): an npm CLI, mini (eval/harness/mini.py) or shell."""
    out: Path
    """Run folder to write (RUN_DIR); must not hold a sessions table yet."""
    proxy: str = ""
    """Base URL of mitmdump with the capture addon, without /v1, e.g. http://127.0.0.1:8080 (not with --ray)."""
    samples: int = 1
    """Rollouts per task."""
    instance_ids: tuple[str, ...] | None = None
    """Only these instances of --tasks; default: all."""
    # ---- the harness
    model: str = "tiny"
    """Model name the harness asks for (the proxy's polar_model can rename it upstream)."""
    command: str | None = None
    """shell harness only: the command line, with {instruction} where the shell-quoted task goes."""
    tools: tuple[str, ...] | None = None
    """Only these of the harness's built-in tools (its own names); default: all."""
    max_tokens: int | None = None
    """Output tokens per model call; default: the harness's own cap."""
    max_turns: int | None = None
    """Model calls per session at most (mini only); default: the harness's own limit."""
    # ---- where sessions run (eval/sessions/runtime.py, docs/runtimes.md)
    runtime: RuntimeName = "local"
    """local: the harness and the model's commands on this machine, in a temporary checkout, UNSAFE for untrusted
    models; docker: each session in its task's own image (python -m eval images build), no network but its proxy."""
    limits: Limits = dataclasses.field(default_factory=Limits)
    """With --runtime docker: what each session's container may use."""
    mounts: tuple[Path, ...] = ()
    """With --runtime docker: host files or folders bound read-only at the same paths (e.g. what a --command
    runs); the harness install and this interpreter are bound anyway."""
    # ---- limits
    concurrency: int = 1
    """Sessions at a time."""
    timeout: float = 1800.0
    """Seconds before a harness and its children are killed (status timeout)."""
    keep_workspaces: bool = False
    """Keep each checkout and harness HOME under RUN_DIR/workspaces/<session_id> instead of removing it."""
    # ---- transparent mode (README "No base URL change")
    transparent: bool = False
    """--proxy is a regular-mode mitmdump with polar_reroute (addon/reroute.py): the harness keeps its provider's
    own URL and gets only HTTPS_PROXY and the CA (--ca-cert). For the npm harnesses."""
    ca_cert: Path | None = None
    """With --transparent: the proxy's CA, mitmproxy-ca-cert.pem in the mitmdump's confdir."""
    session_secret: Path | None = None
    """The proxy's polar_secret_file: each harness then gets its session's signed key (addon/session.py), so no
    session can write calls into another's. Needed when the proxy checks keys."""
    proxy_check: bool = True
    """Refuse to start unless --proxy answers GET /polar/health as a recording capture addon (off only for
    harnesses that make no model call)."""
    # ---- over a Ray cluster (eval/sessions/ray_rollout.py, docs/scale.md)
    ray: str | None = None
    """Spread the sessions over this Ray cluster ("auto": the one `ray start` joined this machine to, or
    HOST:PORT); each node gets its own capture proxy, grades its sessions and sends back their captures."""
    upstream: str = "http://127.0.0.1:8000"
    """With --ray: the inference server each node's proxy forwards to; 127.0.0.1 is that node's own."""
    grade_timeout: float = 900.0
    """With --ray: seconds one eval script may run (sessions are graded where they ran; see eval score)."""

    def __post_init__(self) -> None:
        if (self.ray is None) == (not self.proxy):
            raise EvalError("give --proxy URL (one machine) or --ray ADDRESS (a proxy per node), not both or neither")
        if self.ray is not None and self.transparent:
            raise EvalError("--transparent runs against one regular-mode proxy; --ray starts reverse proxies")
        if self.samples < 1 or self.concurrency < 1:
            raise EvalError(f"--samples and --concurrency must be at least 1, got {self.samples}, {self.concurrency}")
        if self.timeout <= 0:
            raise EvalError(f"--timeout must be positive, got {self.timeout}")
        if (self.harness == "shell") != (self.command is not None):
            raise EvalError("--command goes with --harness shell, and --harness shell needs --command")
        if self.command is not None and "{instruction}" not in self.command:
            raise EvalError(f"--command must contain {{instruction}}, where the task goes: {self.command!r}")
        if self.max_turns is not None and (self.harness != "mini" or self.max_turns < 1):
            raise EvalError(
                f"--max-turns is a positive limit of the mini harness, got {self.max_turns} for {self.harness}"
            )
        if self.transparent and PRESETS[self.harness].provider_url is None:
            raise EvalError(
                f"--transparent runs the harnesses with a provider URL "
                f"({', '.join(name for name, preset in PRESETS.items() if preset.provider_url)}), not {self.harness}"
            )
        if self.transparent and not (self.ca_cert and self.ca_cert.is_file()):
            raise EvalError(f"--transparent needs --ca-cert, the proxy's mitmproxy-ca-cert.pem; got {self.ca_cert}")
        if self.session_secret is not None:
            try:
                read_secret(self.session_secret)
            except (OSError, ValueError) as e:
                raise EvalError(f"--session-secret {self.session_secret}: {e}") from e
        if missing := [str(m) for m in self.mounts if not m.exists()]:
            raise EvalError(f"--mounts: no such file or folder: {', '.join(missing)}")
        if self.runtime != "local" and self.transparent:
            raise EvalError(
                f"--transparent runs harnesses on this machine; it does not go with --runtime {self.runtime}"
            )
        if (self.out / SESSIONS).exists():
            raise EvalError(f"{self.out / SESSIONS} exists: give --out a new run folder")


def instruction(task: dict[str, Any]) -> str:
    """The prompt a harness gets for a task: the issue, and where to fix it."""
    return (
        f"{task['problem_statement'].strip()}\n\n"
        "The repository with this issue is checked out in the current directory. Edit its source files so the "
        "issue is resolved; do not change the tests."
    )


def session_id(run_tag: str, instance_id: str, sample: int) -> str:
    """``<run_tag>-<instance_id>-<sample>`` as a session id the addon accepts (addon/session.py); unique per
    (instance_id, sample): an instance id that had to be changed, or an id cut to length, gets a hash."""
    iid = re.sub(r"[^A-Za-z0-9_.-]+", "-", instance_id)
    if iid != instance_id:
        iid = f"{iid}-{_digest(instance_id)}"
    sid = f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', run_tag)}-{iid}-{sample}"
    if not is_session_id(sid[:1]) or looks_secret(sid):  # an API key starting like a provider's is never kept
        sid = f"run-{sid}"
    if len(sid) > 128:
        sid = f"{sid[:111]}-{_digest(f'{run_tag}-{instance_id}-{sample}')}"
    return sid


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _tail(text: str) -> str:
    return text[-ERROR_TAIL:].strip()


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")


@dataclasses.dataclass(frozen=True)
class Job:
    task: dict[str, Any]
    sample: int
    session_id: str
    run_tag: str  # labels this run's containers, so that a stop removes them
    folder: str = ""  # labels what a run into this run folder leaves, so that a rerun there removes it


def folder_label(run_dir: Path) -> str:
    """The run folder's label on its containers and temporary folders (its resolved path's digest)."""
    return _digest(str(run_dir.resolve()))[:12]


@contextlib.contextmanager
def folder_lock(run_dir: Path) -> Iterator[None]:
    """One rollout at a time into ``run_dir``: while it holds the lock, whatever carries the folder's label and is
    not its own was left by a killed run."""
    with open(run_dir / LOCK, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise EvalError(
                f"{run_dir}: another rollout is writing this run folder (it holds {run_dir / LOCK})"
            ) from None
        yield  # the lock goes with the file's close, also when the process is killed


def remove_left_behind(run_dir: Path, runtime: str) -> None:
    """What earlier rollouts into ``run_dir`` left when killed (``kill -9``): their workspaces, relay sockets and
    containers. Never another run folder's: each carries its folder's label."""
    folder = folder_label(run_dir)
    left = list(Path(tempfile.gettempdir()).glob(f"{WORK_PREFIX}{folder}-*"))
    for leftover in left:
        shutil.rmtree(leftover, ignore_errors=True)
    containers = remove_leftovers(folder) if runtime == "docker" else 0
    if left or containers:
        console.print(
            f"removed what a killed run left in {run_dir}: {containers} container(s), {len(left)} workspace folder(s)"
        )


def roll_out(job: Job, args: Args, work_root: Path, logs: Path) -> dict[str, Any]:
    """One session, start to patch, in ``args.runtime``; returns its sessions-table row. Never raises: a failure
    is a status."""
    started = time.monotonic()
    row: dict[str, Any] = {
        "session_id": job.session_id,
        "task_id": job.task["instance_id"],
        "sample_id": job.sample,
        "harness": args.harness,
        "model": args.model,
        "status": "setup_failed",
        "exit_code": None,
        "started_at": _now(),
        "setup_s": None,
        "duration_s": None,
        "patch_s": None,
        "patch": "",
        "error": None,
        "stdout_bytes": None,
        "stderr_bytes": None,
    }
    work = work_root / job.session_id
    log_dir = logs / job.session_id
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        with contextlib.ExitStack() as stack:
            try:
                if args.transparent:  # on this machine only (Args refuses another runtime)
                    repo = checkout(job.task, work / "repo")  # at base_commit: checkout checks it
                    row["setup_s"] = time.monotonic() - started
                    run = _run_transparent(job, args, repo, work)
                    box = None
                else:
                    box = stack.enter_context(
                        RUNTIMES[args.runtime].open(
                            job.task, job.session_id, work, proxy=args.proxy, run_tag=job.run_tag, folder=job.folder,
                            mounts=[*_mounts(args.harness), *args.mounts], limits=args.limits, timeout=args.timeout,
                        )
                    )  # fmt: skip
                    argv, env = prepare(
                        args.harness,
                        instruction(job.task),
                        workspace=box.workspace,
                        home=work / "home",
                        base_url=box.base_url,
                        session_id=_key(job.session_id, args.session_secret),
                        model=args.model,
                        tools=args.tools,
                        max_tokens=args.max_tokens,
                        max_turns=args.max_turns,
                        command=args.command,
                        system_path=box.system_path,
                    )
                    row["setup_s"] = time.monotonic() - started
                    run = box.run(args.harness, argv, env, args.timeout)
            except Exception as e:  # noqa: BLE001 - checkout, image or launch: the harness never ran
                row["setup_s"] = row["setup_s"] or time.monotonic() - started
                row["error"] = f"{type(e).__name__}: {e}"[-ERROR_TAIL:]
                (log_dir / "setup_error.txt").write_text(traceback.format_exc())
                return row
            (log_dir / "stdout.txt").write_text(run.stdout)
            (log_dir / "stderr.txt").write_text(run.stderr)
            row |= {"exit_code": run.exit_code, "duration_s": run.duration_s}
            row |= {"stdout_bytes": run.stdout_bytes, "stderr_bytes": run.stderr_bytes}
            patch_started = time.monotonic()
            try:
                row["patch"] = (
                    box.patch(job.task["base_commit"])
                    if box
                    else take_patch(work / "repo", job.task["base_commit"], args.limits.size("patch"))
                )
            except PatchError as e:  # the agent broke the repository (e.g. removed .git)
                row |= {"status": "crashed", "error": f"could not take the patch: {_tail(str(e))}"}
                return row
            except PatchTooLarge as e:
                row |= {"status": "patch_too_large", "error": str(e)}
                return row
            finally:
                row["patch_s"] = time.monotonic() - patch_started
                if args.keep_workspaces and box is not None:
                    box.keep(work)
        if run.ended_by_limit:
            row |= {"status": "crashed", "error": f"{run.ended_by_limit}; stderr: {_tail(run.stderr)}"}
        elif run.timed_out:
            row |= {"status": "timeout", "error": f"killed after {args.timeout:g} s; stderr: {_tail(run.stderr)}"}
        elif run.exit_code != 0:
            row |= {"status": "crashed", "error": f"exit {run.exit_code}; stderr: {_tail(run.stderr or run.stdout)}"}
        elif not row["patch"]:
            row |= {"status": "no_edit", "error": "the harness exited 0 and left no change"}
        else:
            row["status"] = "ok"
        return row
    finally:
        if not args.keep_workspaces:
            shutil.rmtree(work, ignore_errors=True)


def _run_transparent(job: Job, args: Args, repo: Path, work: Path) -> HarnessRun:
    assert args.ca_cert is not None
    return run_transparent(
        args.harness,
        instruction(job.task),
        proxy_url=args.proxy,
        ca_cert=args.ca_cert,
        workspace=repo,
        session_id=_key(job.session_id, args.session_secret),
        model=args.model,
        timeout=args.timeout,
        tools=args.tools,
        max_tokens=args.max_tokens,
        home=work / "home",
    )


def _key(session_id: str, secret_file: Path | None) -> str:
    """The API key the harness gets: the session id, signed when the proxy checks keys."""
    return session_id if secret_file is None else signed_key(session_id, read_secret(secret_file))


def _mounts(harness: str) -> list[Path]:
    """What a container needs of this machine to run ``harness``, bound read-only at the same paths: the npm
    install (its own Node 22 runs on a minbase image) or mini.py."""
    if PRESETS[harness].npm:
        return [install().parent.parent]
    return [MINI] if harness == "mini" else []


def run_all(jobs: list[Job], args: Args, work_root: Path, logs: Path, stop: threading.Event) -> list[dict[str, Any]]:
    """Every job, ``args.concurrency`` at a time, with a live count; rows in job order. Once ``stop`` is set (by
    the caller on SIGTERM, here on Ctrl-C or an error) no further job starts."""
    rows: list[dict[str, Any] | None] = [None] * len(jobs)
    lock = threading.Lock()
    running = failed = 0
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task(f"{args.harness}: running 0, failed 0", total=len(jobs))

        def one(i: int) -> None:
            nonlocal running, failed
            if stop.is_set():
                return
            with lock:
                running += 1
                progress.update(bar, description=f"{args.harness}: running {running}, failed {failed}")
            row = roll_out(jobs[i], args, work_root, logs)
            with lock:
                rows[i] = row
                running -= 1
                failed += row["status"] not in ("ok", "no_edit")
                progress.update(bar, advance=1, description=f"{args.harness}: running {running}, failed {failed}")

        with ThreadPoolExecutor(max_workers=args.concurrency, thread_name_prefix="rollout") as pool:
            futures = [pool.submit(one, i) for i in range(len(jobs))]
            try:
                for future in futures:
                    future.result()  # roll_out never raises; this surfaces a bug in the bookkeeping itself
            except BaseException:  # stopped (SIGTERM, Ctrl-C): no new session starts, the running ones end
                stop.set()
                raise
    return [row for row in rows if row is not None]


def _on_ray(jobs: list[Job], args: Args, run_dir: Path, run_tag: str) -> list[dict[str, Any]]:
    """The round over the Ray cluster at ``args.ray``; also writes rewards, lost attempts and captures."""
    import ray

    from eval.sessions import ray_rollout

    ray.init(address=args.ray, log_to_driver=False)
    try:
        return ray_rollout.run_round(jobs, args, run_dir, run_tag=run_tag, roll_out=roll_out, session_id=session_id)
    finally:
        ray.shutdown()


def _run(tasks: list[dict[str, Any]], args: Args, run_dir: Path) -> list[dict[str, Any]]:
    run_tag = f"{run_dir.resolve().name}-{secrets.token_hex(3)}"  # the nonce keeps reruns into a same-named dir apart
    folder = folder_label(run_dir)
    jobs = [
        Job(task, n, session_id(run_tag, task["instance_id"], n), run_tag, folder)
        for task in tasks
        for n in range(args.samples)
    ]
    # Unless kept, outside the run folder: harnesses read instruction files (CLAUDE.md, AGENTS.md) from parent folders.
    work_root = (
        run_dir / "workspaces" if args.keep_workspaces else Path(tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{folder}-"))
    )
    containers_here = args.runtime == "docker" and args.ray is None  # on Ray, each session on its node removes its own
    stop = threading.Event()

    def terminate(signum: int, frame: Any) -> None:
        # Stopped from outside (the demo stops a phase with SIGTERM): no queued session starts, the run's containers
        # go, which ends their sessions at once, then the finally below runs as on Ctrl-C. Python's default would
        # exit at once and leave every container running.
        stop.set()
        if containers_here:
            remove_run(run_tag)
        raise SystemExit(128 + signum)

    in_main = threading.current_thread() is threading.main_thread()  # only the main thread may set a handler
    previous = signal.signal(signal.SIGTERM, terminate) if in_main else None
    try:
        if args.ray is not None:
            rows = _on_ray(jobs, args, run_dir, run_tag)
        else:
            rows = run_all(jobs, args, work_root, run_dir / LOGS, stop)
    finally:
        if not args.keep_workspaces:
            shutil.rmtree(work_root, ignore_errors=True)
        if containers_here and (left := remove_run(run_tag)):
            console.print(f"removed {left} container(s) this run left behind")
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return rows


def main(args: Args) -> int:
    tasks = load_tasks(args.tasks, args.instance_ids)  # refuses instance ids it does not have
    if not tasks:
        raise EvalError(f"{args.tasks}: no tasks")
    proxy = args.proxy.rstrip("/").removesuffix("/v1")  # harness presets add /v1 where their API wants it
    args = dataclasses.replace(args, proxy=proxy)
    # A proxy without the addon would forward every call unrecorded: no training data. With --ray, each node's
    # proxy is checked as it starts.
    if args.proxy_check and args.ray is None:
        health = check_proxy(proxy, transparent=args.transparent)
        print(f"proxy:    {proxy} records into {health['options']['polar_dir']}")
        if health.get("signed_keys") and args.session_secret is None:
            raise EvalError(f"{proxy} accepts only signed session keys: give --session-secret, its polar_secret_file")
        if not health.get("signed_keys") and RUNTIMES[args.runtime].sandboxed:
            console.print(
                f"[yellow]warning[/]: {proxy} accepts any session key, so a session can write calls into another's; "
                "start mitmdump with --set polar_secret_file=FILE and pass --session-secret FILE"
            )
    run_dir = args.out
    run_dir.mkdir(parents=True, exist_ok=True)
    # A folder a killed run left (tasks, no sessions table) is reused only for the same tasks: never replaced.
    with tempfile.TemporaryDirectory(prefix="polar-tasks-") as tmp:
        wanted = save_tasks(tasks, Path(tmp) / TASKS).read_bytes()
    if (run_dir / TASKS).exists() and (run_dir / TASKS).read_bytes() != wanted:
        raise EvalError(f"{run_dir / TASKS} holds other tasks (another run's): give --out a new run folder")
    write_atomic(run_dir / TASKS, wanted)

    started = time.monotonic()
    with folder_lock(run_dir):
        remove_left_behind(run_dir, args.runtime)
        rows = _run(tasks, args, run_dir)
    sessions = write_sessions(pl.DataFrame(rows, schema=SESSIONS_SCHEMA), run_dir)

    table = Table(title=f"{args.harness}: {len(rows)} sessions in {time.monotonic() - started:.0f} s")
    for column in ("status", "sessions"):
        table.add_column(column)
    counts = pl.DataFrame(rows, schema=SESSIONS_SCHEMA)["status"].value_counts()
    for status in SESSION_STATUSES:
        n = counts.filter(pl.col("status") == status)["count"].sum()
        table.add_row(status, str(n))
    console.print(table)
    print(f"tasks:    {run_dir / TASKS}")
    print(f"sessions: {sessions}")
    print(f"logs:     {run_dir / LOGS}/<session_id>/")
    if args.ray is not None:
        print(f"rewards:  {run_dir / 'rewards.parquet'} (graded on the nodes)")
        print(f"captures: {run_dir / 'captures'}/<node>/; lost attempts: {run_dir / 'lost.parquet'}")
        print(f"next:     python -m reconstruct {run_dir / 'captures'} --skip-sessions {run_dir / 'lost.parquet'} ...")
    else:
        print(f"next:     python -m eval score {run_dir}")
    return 0
