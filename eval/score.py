"""Grade patches with swebench: run each task's eval script on a fresh checkout, let swebench's grading decide.

    python -m eval score RUN_DIR [--runner local|docker] [--timeout S] [--concurrency K]
    python -m eval score --gold --tasks toy --out runs/gold             # the reference patches: all resolved
    python -m eval score --predictions preds.jsonl --tasks tasks.jsonl --out runs/p1

RUN_DIR holds ``tasks.jsonl`` and ``sessions.parquet`` (eval/runs.py); every session gets one row in
``RUN_DIR/rewards.parquet`` (sorted by session_id, so a rerun writes the same table) and its logs in
``RUN_DIR/logs/<session_id>/``: ``patch.diff``, ``eval.sh``, ``eval.log`` (patch application, then the eval
script's output, which is what swebench grades) and ``report.json`` (swebench's report). ``--predictions`` takes
swebench's JSONL (``instance_id, model_name_or_path, model_patch``), ``--gold`` the tasks' own patches; both
write a run folder to ``--out`` with session ids ``<model_name_or_path>/<instance_id>``.

The local runner (default) needs no Docker: a fresh ``eval.tasks.load.checkout`` in a temporary folder, the patch
applied with ``git apply`` or else ``patch --fuzz``, then ``bash eval.sh`` in its own process group, killed at
the timeout, with a scrubbed environment (no keys, HOME a temporary folder), the grader's virtualenv first on
PATH and ``PYTHON`` set to its interpreter, which the eval script runs pytest with. Grading is swebench's own
``get_eval_report`` with the instance's ``log_parser``. ``--runner docker`` hands each instance to swebench's
``run_instance`` in a fresh container of its image (``python -m eval images build`` makes ours): it needs a Docker
daemon (``DOCKER_HOST``) and the images. Each grading gets its own swebench run id, so a report of an earlier
run is never reused, and swebench's ``logs/run_evaluation/<run id>/`` is removed once copied into ``RUN_DIR/logs``.

Reasons (eval/runs.py REWARD_REASONS): ``graded`` (swebench graded it, resolved or not), ``empty_patch``,
``patch_failed``, ``tests_timed_out``, ``eval_error`` (a broken instance, an eval script whose output swebench
refuses, any other failure: eval.log says which), ``session_failed`` (the harness crashed or timed out and
left no patch). ``grade`` never raises for one bad session.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import polars as pl
import tyro
from swebench.harness.constants import APPLY_PATCH_FAIL, APPLY_PATCH_PASS, TESTS_TIMEOUT
from swebench.harness.grading import get_eval_report
from swebench.harness.utils import make_test_spec
from swebench.types import TestSpec
from tqdm import tqdm

from eval.errors import EvalError
from eval.runs import LOGS, REWARDS_SCHEMA, TASKS, read_sessions, write_rewards
from eval.sessions.procs import stop_tree
from eval.tasks.instances import GIT_ENV
from eval.tasks.load import TaskError, checkout, load_tasks, save_tasks, validate

if TYPE_CHECKING:
    from docker import DockerClient

__all__ = ["Args", "Grade", "grade", "main"]


@dataclasses.dataclass
class Args:
    run_dir: tyro.conf.Positional[Path | None] = None
    """run folder with tasks.jsonl and sessions.parquet; rewards.parquet and logs/ are written into it"""

    # --- how to grade
    runner: Literal["local", "docker"] = "local"
    """local: eval script in a subprocess sandbox on this machine; docker: swebench's containers (needs a daemon)"""
    timeout: float = 900.0
    """seconds one eval script may run before it is killed (reason tests_timed_out)"""
    concurrency: int = 2
    """sessions graded at once"""

    # --- instead of RUN_DIR: a swebench-style predictions file, or the tasks' gold patches
    predictions: Path | None = None
    """JSONL of {instance_id, model_name_or_path, model_patch}; needs --tasks and --out"""
    gold: bool = False
    """grade each task's own reference patch (model_name_or_path "gold"); needs --tasks and --out"""
    tasks: str | None = None
    """with --predictions/--gold: "toy", or a .json/.jsonl/.parquet file of SWE-bench instances"""
    out: Path | None = None
    """with --predictions/--gold: run folder to write tasks.jsonl, rewards.parquet and logs/ into"""

    def __post_init__(self) -> None:
        if self.predictions is not None and self.gold:
            raise EvalError("give --predictions FILE or --gold, not both")
        from_file = self.predictions is not None or self.gold
        if from_file == (self.run_dir is not None):
            raise EvalError("give either RUN_DIR, or --predictions FILE / --gold with --tasks and --out")
        if from_file and (self.tasks is None or self.out is None):
            raise EvalError("--predictions and --gold need --tasks SPEC and --out DIR")
        if self.concurrency < 1 or self.timeout <= 0:
            raise EvalError(f"--concurrency must be >= 1 and --timeout > 0, got {self.concurrency}, {self.timeout}")


@dataclasses.dataclass(frozen=True)
class Grade:
    """One patch's grade; ``reason`` is one of eval/runs.py REWARD_REASONS."""

    reward: float
    resolved: bool
    reason: str
    report: dict[str, Any] | None  # swebench's report for the instance; None when it was not graded


@dataclasses.dataclass(frozen=True)
class Job:
    """One row to grade: a session of RUN_DIR, or one prediction."""

    session_id: str
    task_id: str
    sample_id: int
    harness: str | None
    patch: str
    harness_failed: bool  # crashed / timed out / never set up: an empty patch is the harness's fault


HARNESS_FAILED = ("crashed", "timeout", "setup_failed", "patch_too_large")
APPLY_COMMANDS = (["git", "apply", "--verbose"], ["patch", "--batch", "--forward", "--fuzz=5", "-p1", "-i"])


def _ungraded(reason: str) -> Grade:
    return Grade(reward=0.0, resolved=False, reason=reason, report=None)


def grade(task: dict[str, Any], patch: str, *, timeout: float, log_dir: Path) -> Grade:
    """Grade ``patch`` on ``task`` with the local runner; logs go to ``log_dir``. Never raises for bad input."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / "eval.log"
    (log_dir / "report.json").unlink(missing_ok=True)
    if not patch.strip():
        log.write_text("empty patch: nothing to grade\n")
        return _ungraded("empty_patch")
    try:
        task = validate(task, "task")
        spec = make_test_spec(task)
        with tempfile.TemporaryDirectory(prefix="polar-grade-", ignore_cleanup_errors=True) as tmp:
            return _grade_in(Path(tmp), task, spec, patch, timeout, log_dir)
    except Exception as e:  # noqa: BLE001 - one broken session must not stop the run; the log keeps what happened
        with log.open("a") as f:
            f.write(f"\neval_error: {type(e).__name__}: {e}\n")
            if not isinstance(e, TaskError):
                f.write(traceback.format_exc())
        return _ungraded("eval_error")


def _grade_in(tmp: Path, task: dict[str, Any], spec: TestSpec, patch: str, timeout: float, log_dir: Path) -> Grade:
    log = log_dir / "eval.log"
    (log_dir / "patch.diff").write_text(patch)
    (log_dir / "eval.sh").write_text(spec.eval_script)
    repo = checkout(task, tmp / "repo")
    env = sandbox_env(tmp / "home")
    applied, apply_output = apply_patch(repo, log_dir / "patch.diff", env)
    # swebench's harness logs the same markers; grading refuses a log with the failure marker.
    log.write_text(f"{APPLY_PATCH_PASS if applied else APPLY_PATCH_FAIL}:\n{apply_output}\n")
    if not applied:
        return _ungraded("patch_failed")
    if run_script(log_dir / "eval.sh", repo, env, timeout, log):
        with log.open("a") as f:
            f.write(f"\n{TESTS_TIMEOUT}: {timeout:g} seconds exceeded\n")
        return _ungraded("tests_timed_out")
    prediction = {"instance_id": task["instance_id"], "model_name_or_path": "polar", "model_patch": patch}
    report = get_eval_report(spec, prediction, str(log), include_tests_status=True)
    (log_dir / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    entry = report[task["instance_id"]]
    if not entry["patch_successfully_applied"]:
        with log.open("a") as f:
            f.write("\neval_error: swebench refused the log (markers missing, or exit code contradicts results)\n")
    return _graded(entry)


def _graded(entry: dict[str, Any]) -> Grade:
    """The grade of swebench's report for one instance."""
    if not entry["patch_successfully_applied"]:  # swebench found no test output it trusts in the log
        return Grade(reward=0.0, resolved=False, reason="eval_error", report=entry)
    return Grade(reward=float(entry["resolved"]), resolved=bool(entry["resolved"]), reason="graded", report=entry)


def sandbox_env(home: Path) -> dict[str, str]:
    """A scrubbed environment: nothing of the caller's but PATH, the grader's virtualenv first."""
    home.mkdir(parents=True, exist_ok=True)
    return {
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)]),
        "PYTHON": sys.executable,  # the eval script runs "${PYTHON:-python}" -m pytest
        "HOME": str(home),
        "TMPDIR": str(home),
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        # The grader's own pytest plugins (pytest-timeout, ...) are not part of a task's environment.
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "GIT_CONFIG_GLOBAL": GIT_ENV["GIT_CONFIG_GLOBAL"],
        "GIT_CONFIG_NOSYSTEM": GIT_ENV["GIT_CONFIG_NOSYSTEM"],
    }


def apply_patch(repo: Path, patch_file: Path, env: dict[str, str]) -> tuple[bool, str]:
    """Apply with ``git apply``, else ``patch --fuzz`` on a clean tree; (applied, what the tools printed)."""
    output = []
    for attempt, command in enumerate(APPLY_COMMANDS):
        if attempt:  # a failed attempt can leave half-applied files behind
            subprocess.run(["git", "checkout", "--", "."], cwd=repo, env=env, capture_output=True, check=False)
            subprocess.run(["git", "clean", "-fdq"], cwd=repo, env=env, capture_output=True, check=False)
        argv = [*command, str(patch_file)]
        if shutil.which(argv[0], path=env["PATH"]) is None:
            output.append(f"$ {shlex.join(argv)}\n{argv[0]} is not on PATH")
            continue
        done = subprocess.run(
            argv, cwd=repo, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, check=False
        )
        output.append(f"$ {shlex.join(argv)}\n{done.stdout}{done.stderr}")
        if done.returncode == 0:
            return True, "\n".join(output)
    return False, "\n".join(output)


def run_script(script: Path, repo: Path, env: dict[str, str], timeout: float, log: Path) -> bool:
    """Run ``bash script`` in ``repo``, output appended to ``log``; True when it was killed at the timeout."""
    with log.open("a") as out:
        proc = subprocess.Popen(
            ["bash", str(script)],
            cwd=repo,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
            return False
        except subprocess.TimeoutExpired:
            return True
        finally:
            stop_tree(proc)  # pytest and anything a patch started in the background


def grade_docker(
    task: dict[str, Any],
    patch: str,
    *,
    timeout: float,
    log_dir: Path,
    session_id: str,
    client: DockerClient,
    run_id: str,
) -> Grade:
    """Grade with swebench's ``run_instance`` in a fresh container of the instance's image; its logs are copied to
    ``log_dir``, and swebench's own copy under ``logs/run_evaluation/`` is removed."""
    from swebench.harness.constants import LOG_INSTANCE, LOG_REPORT, LOG_TEST_OUTPUT, RUN_EVALUATION_LOG_DIR
    from swebench.harness.run_evaluation import run_instance

    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    # swebench names the container sweb.eval.<instance>.<run id> and reuses a report it finds under its run id:
    # a run id of this session's own, so samples of one task graded at once never share a container or a report.
    run_id = f"{run_id}.{hashlib.sha256(session_id.encode()).hexdigest()[:12]}"
    name = session_id.replace("/", "__")  # swebench's folder for the model name
    try:
        spec = make_test_spec(validate(task, "task"))
        result = run_instance(
            spec,
            {"instance_id": spec.instance_id, "model_name_or_path": name, "model_patch": patch},
            client,
            run_id,
            int(timeout),
        )
    except Exception as e:  # noqa: BLE001 - a broken instance or a container failure costs this session only
        (log_dir / "eval.log").write_text(f"eval_error: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        return _ungraded("eval_error")
    finally:
        swebench_run = RUN_EVALUATION_LOG_DIR / run_id
        swebench_dir = swebench_run / name / str(task.get("instance_id"))
        copies = ((LOG_TEST_OUTPUT, "eval.log"), (LOG_INSTANCE, "run_instance.log"), (LOG_REPORT, "report.json"))
        for source, target in copies:
            if (swebench_dir / source).exists():
                shutil.copyfile(swebench_dir / source, log_dir / target)
        shutil.rmtree(swebench_run, ignore_errors=True)  # its parents stay: other gradings may be making theirs
    if result is None:
        instance_log = (log_dir / "run_instance.log").read_text() if (log_dir / "run_instance.log").exists() else ""
        if APPLY_PATCH_FAIL in instance_log:
            return _ungraded("patch_failed")
        return _ungraded("tests_timed_out" if "Test timed out" in instance_log else "eval_error")
    return _graded(result[1][spec.instance_id])


def load_jobs(args: Args) -> tuple[Path, dict[str, dict[str, Any]], list[Job]]:
    """(run folder to write, tasks by instance_id, rows to grade) from RUN_DIR or --predictions/--gold."""
    if args.run_dir is not None:
        tasks = load_tasks(args.run_dir / TASKS, check=False)
        sessions = read_sessions(args.run_dir)
        jobs = [
            Job(
                row["session_id"],
                row["task_id"],
                row["sample_id"],
                row["harness"],
                row["patch"] or "",
                row["status"] in HARNESS_FAILED,
            )
            for row in sessions.iter_rows(named=True)
        ]
        return args.run_dir, {t["instance_id"]: t for t in tasks}, jobs
    assert args.tasks is not None and args.out is not None  # __post_init__
    if args.predictions is None:  # --gold (__post_init__)
        tasks = load_tasks(args.tasks, check=False)
        predictions = [
            {"instance_id": t["instance_id"], "model_name_or_path": "gold", "model_patch": t["patch"]} for t in tasks
        ]
    else:
        predictions = read_predictions(args.predictions)
        tasks = load_tasks(args.tasks, sorted({p["instance_id"] for p in predictions}), check=False)
    save_tasks(tasks, args.out / TASKS)  # makes --out a run folder that join and report can read
    jobs = [
        Job(f"{p['model_name_or_path']}/{p['instance_id']}", p["instance_id"], 0, None, p["model_patch"] or "", False)
        for p in predictions
    ]
    return args.out, {t["instance_id"]: t for t in tasks}, jobs


def read_predictions(path: Path) -> list[dict[str, Any]]:
    """swebench's predictions JSONL; EvalError naming the file, the line and what is wrong."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise EvalError(f"{path}: cannot read the predictions: {e}") from e
    predictions = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            prediction = json.loads(line)
        except ValueError as e:
            raise EvalError(f"{path}:{number}: not a JSON line: {e}") from e
        missing = [k for k in ("instance_id", "model_name_or_path", "model_patch") if k not in prediction]
        if missing:
            raise EvalError(f"{path}:{number}: prediction lacks {missing}")
        predictions.append(prediction)
    return predictions


def main(args: Args) -> int:
    with contextlib.ExitStack() as cleanup:  # the docker client
        return _main(args, cleanup)


def _remove_empty_swebench_folders() -> None:
    """swebench's logs/run_evaluation/ in the current folder, once every grading is done, if nothing is left in it."""
    from swebench.harness.constants import RUN_EVALUATION_LOG_DIR

    for empty in (RUN_EVALUATION_LOG_DIR, RUN_EVALUATION_LOG_DIR.parent):
        with contextlib.suppress(OSError):
            empty.rmdir()


def _main(args: Args, cleanup: contextlib.ExitStack) -> int:
    try:
        out_dir, tasks, jobs = load_jobs(args)
    except (EvalError, OSError) as e:  # a task file, a run folder, a predictions file; --out not writable
        print(f"python -m eval score: {e}", file=sys.stderr)
        return 2
    if args.runner == "docker":
        import docker

        no_daemon = (
            "python -m eval score: --runner docker needs a running Docker daemon and none answered ({}). "
            "Grade with --runner local, or start Docker."
        )
        if not (os.environ.get("DOCKER_HOST") or Path("/var/run/docker.sock").exists()):
            # Asked without an endpoint, the docker client leaves a socket behind for the interpreter to complain of.
            print(no_daemon.format("no DOCKER_HOST and no /var/run/docker.sock"), file=sys.stderr)
            return 1
        try:
            client = docker.from_env()
        except docker.errors.DockerException as e:
            print(no_daemon.format(str(e).splitlines()[0][:200]), file=sys.stderr)
            return 1

        run_id = f"{out_dir.name}-{secrets.token_hex(4)}"  # a rerun, or another folder of this name, grades afresh
        cleanup.callback(client.close)
        cleanup.callback(_remove_empty_swebench_folders)

        def run(job: Job, task: dict[str, Any], log_dir: Path) -> Grade:
            return grade_docker(
                task,
                job.patch,
                timeout=args.timeout,
                log_dir=log_dir,
                session_id=job.session_id,
                client=client,
                run_id=run_id,
            )
    else:

        def run(job: Job, task: dict[str, Any], log_dir: Path) -> Grade:
            return grade(task, job.patch, timeout=args.timeout, log_dir=log_dir)

    def score(job: Job) -> Grade:
        log_dir = out_dir / LOGS / job.session_id
        task = tasks.get(job.task_id)
        if task is None:
            log_dir.mkdir(parents=True, exist_ok=True)
            (log_dir / "eval.log").write_text(f"eval_error: task {job.task_id!r} is not in {out_dir / TASKS}\n")
            return _ungraded("eval_error")
        if not job.patch.strip():  # before either runner: there is nothing to run
            log_dir.mkdir(parents=True, exist_ok=True)
            reason = "session_failed" if job.harness_failed else "empty_patch"
            (log_dir / "eval.log").write_text(f"{reason}: no patch to grade\n")
            (log_dir / "report.json").unlink(missing_ok=True)
            return _ungraded(reason)
        return run(job, task, log_dir)

    jobs = sorted(jobs, key=lambda job: job.session_id)
    grades: list[Grade] = []
    with (
        ThreadPoolExecutor(max_workers=min(args.concurrency, max(len(jobs), 1))) as pool,
        tqdm(total=len(jobs), desc="grading", unit="session") as progress,
    ):
        for result in pool.map(score, jobs):
            grades.append(result)
            progress.update()
            errors = sum(g.reason == "eval_error" for g in grades)
            progress.set_postfix(resolved=sum(g.resolved for g in grades), errors=errors)
    rows = [
        {
            "session_id": job.session_id,
            "task_id": job.task_id,
            "sample_id": job.sample_id,
            "harness": job.harness,
            "reward": g.reward,
            "resolved": g.resolved,
            "reason": g.reason,
            "report": None if g.report is None else json.dumps(g.report, sort_keys=True),
        }
        for job, g in zip(jobs, grades, strict=True)
    ]
    path = write_rewards(pl.DataFrame(rows, schema=REWARDS_SCHEMA), out_dir)
    reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(Counter(g.reason for g in grades).items()))
    print(f"resolved {sum(g.resolved for g in grades)}/{len(grades)} ({reasons}) -> {path}")
    return 0
