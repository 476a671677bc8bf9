"""A round's sessions spread over a Ray cluster: ``python -m eval rollout ... --ray ADDRESS``.

    ray start --head --num-cpus 16                       # on the first node; `ray start --address HEAD:6379` on others
    python -m eval rollout --tasks T --harness mini --samples 8 --ray auto --upstream http://127.0.0.1:8000 \\
        --concurrency 64 --out runs/r1

- **A capture proxy per node.** :class:`CaptureProxy` is a Ray actor pinned to its node that owns one ``mitmdump``
  with the addon in front of ``--upstream`` (``127.0.0.1`` there is that node's own inference server) and answers
  only once ``GET /polar/health`` says it records (:class:`eval.sessions.procs.Mitmdump`). It holds no CPU. It checks
  session keys against a secret of its own (addon/session.py): a session gets its key signed for its node's proxy,
  and nothing else can write into that proxy's captures.
- **Sessions are Ray tasks** of one CPU each, placed by Ray's scheduler where a CPU is free. A session runs its
  harness against the proxy of the node it landed on, in ``--runtime`` (eval/sessions/runtime.py), then grades its patch
  there: ``eval.score.grade`` after ``local`` (the checkout is already on that node's disk), swebench's
  ``run_instance`` in a fresh container after ``docker`` (the node's daemon must have the task images).
- **The run folder is a one-machine run's**: ``tasks.jsonl``, ``sessions.parquet`` (written by
  eval/sessions/rollout.py), ``rewards.parquet``, ``logs/<session_id>/``, and every node's captures under
  ``captures/<node>/``. Record ids are random per record (addon/record.py), so the gathered folders hold no two records
  with one id. A capture file already there is never replaced (issue 37): one of the same bytes is kept as it is, and a
  round's file whose name holds other bytes is written beside it as ``<stem>-<n>.jsonl``, said on stderr (reconstruct
  reads every ``*.jsonl``).
- **Lost attempts.** A session whose worker or node died is run again, under a new session id, on whatever node has
  a free CPU (at most ``MAX_ATTEMPTS`` times). So is a finished session whose node died before the round's captures
  were gathered: its records died with the node. Each lost attempt is a row of ``lost.parquet``; its session id
  never reaches ``sessions.parquet`` or ``rewards.parquet``, and ``python -m reconstruct --skip-sessions
  RUN_DIR/lost.parquet`` leaves out the records it left in a surviving proxy's captures.

Captures travel to the driver through Ray's object store when the round ends, one node at a time.

This module never imports eval/sessions/rollout.py (which imports it): the driver passes it the session runner and the
session id maker as arguments.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl
import ray
import ray.exceptions
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from eval.errors import EvalError
from eval.runs import FORMAT_VERSION, LOGS, REWARDS_SCHEMA, VERSION_KEY, RunError, write_rewards
from eval.score import HARNESS_FAILED, Grade, grade, grade_docker
from eval.sessions.procs import Mitmdump, check_proxy, new_secret_file
from reconstruct.files import conform_table, read_versioned_parquet, write_new, write_versioned_parquet

__all__ = ["CAPTURES", "LOST", "LOST_SCHEMA", "MAX_ATTEMPTS", "CaptureProxy", "read_lost", "run_round", "write_lost"]

CAPTURES = "captures"
LOST = "lost.parquet"
MAX_ATTEMPTS = 3  # attempts per session; more lost workers than that is a broken cluster, not bad luck
LOST_SCHEMA = pl.Schema(
    {
        "session_id": pl.String,  # the lost attempt's id: its records, if any survived, carry it
        "task_id": pl.String,
        "sample_id": pl.Int32,
        "node_id": pl.String,  # where it ran; null when the worker died before saying
        "reason": pl.String,  # the Ray error that ended it, or "node_died" for captures lost with their node
    }
)
# Ray's errors for a task whose worker, node or result went away: the session is run again. Any other error is a
# bug in the session code (a session never raises for a failed harness or grade) and stops the round.
WORKER_LOST = (
    ray.exceptions.WorkerCrashedError,
    ray.exceptions.NodeDiedError,
    ray.exceptions.LocalRayletDiedError,
    ray.exceptions.ObjectLostError,
)


RollOut = Callable[[Any, Any, Path, Path], dict[str, Any]]  # eval.sessions.rollout.roll_out(job, args, work_root, logs)
SessionId = Callable[[str, str, int], str]  # eval.sessions.rollout.session_id(run_tag, instance_id, sample)


@ray.remote(num_cpus=0, max_restarts=0)
class CaptureProxy:
    """One ``mitmdump`` with the capture addon on this actor's node, recording into a folder of its own."""

    def __init__(self, upstream: str) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="polar-ray-proxy-"))
        self.captures = self.root / CAPTURES
        # Its own secret: only this node's sessions, given keys signed with it, can write into its captures.
        self.secret = new_secret_file(self.root / "secret")
        self.mitm = Mitmdump(upstream, self.captures, log=self.root / "mitmdump.log", secret_file=self.secret)

    def url(self) -> str:
        return self.mitm.url

    def secret_file(self) -> str:
        return str(self.secret)

    def health(self) -> dict[str, Any]:
        return check_proxy(self.mitm.url)

    def stop(self) -> None:
        self.mitm.stop()

    def finish(self) -> dict[str, bytes]:
        """Stop mitmdump (the addon flushes its writer on SIGTERM); every capture file, by its path in the folder."""
        self.mitm.stop()
        files = {str(p.relative_to(self.captures)): p.read_bytes() for p in self.captures.rglob("*") if p.is_file()}
        shutil.rmtree(self.root, ignore_errors=True)
        return files


def grade_session(
    task: dict[str, Any], row: dict[str, Any], timeout: float, log_dir: Path, *, docker_run: str | None = None
) -> Grade:
    """The grade ``python -m eval score`` gives a session row: no patch is graded as nothing to run. With
    ``docker_run`` (a run id), in a fresh container of the task's image, as ``--runner docker`` grades."""
    if not (row["patch"] or "").strip():
        reason = "session_failed" if row["status"] in HARNESS_FAILED else "empty_patch"
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / "eval.log").write_text(f"{reason}: no patch to grade\n")
        return Grade(reward=0.0, resolved=False, reason=reason, report=None)
    if docker_run is None:
        return grade(task, row["patch"], timeout=timeout, log_dir=log_dir)
    import docker

    client = docker.from_env()
    try:
        return grade_docker(
            task, row["patch"], timeout=timeout, log_dir=log_dir, session_id=row["session_id"], client=client,
            run_id=docker_run,
        )  # fmt: skip
    finally:
        client.close()


@ray.remote(num_cpus=1, max_retries=0)
def _session(job: Any, args: Any, proxies: dict[str, tuple[str, str]], roll_out: RollOut) -> dict[str, Any]:
    """One session on this node: harness through the node's proxy (in ``args.runtime``), then grading (in a fresh
    container with the docker runtime); the row, grade and logs."""
    node = ray.get_runtime_context().get_node_id()
    if node not in proxies:
        raise EvalError(f"no capture proxy on node {node}: it joined the cluster after the round started")
    url, secret = proxies[node]
    with tempfile.TemporaryDirectory(prefix="polar-ray-session-") as tmp:
        logs = Path(tmp) / LOGS
        # A one-machine session on this node, its key signed for this node's proxy.
        here = dataclasses.replace(args, proxy=url, session_secret=Path(secret), ray=None)
        row = roll_out(job, here, Path(tmp) / "work", logs)
        docker_run = job.run_tag if args.runtime == "docker" else None
        result = grade_session(job.task, row, args.grade_timeout, logs / job.session_id, docker_run=docker_run)
        files = {str(p.relative_to(logs)): p.read_bytes() for p in logs.rglob("*") if p.is_file()}
    return {"node": node, "row": row, "grade": result, "logs": files}


def _start_proxies(upstream: str, proxy_check: bool) -> tuple[dict[str, Any], dict[str, tuple[str, str]]]:
    """A proxy actor on every alive node; (actors, (url, secret file)) by node id, once each answers as a recording
    addon."""
    alive = ray.nodes()  # type: ignore[no-untyped-call]  # ray 2.60 leaves it unannotated
    nodes = [n["NodeID"] for n in alive if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
    if not nodes:
        raise EvalError("the Ray cluster has no alive node with a CPU to run sessions on")
    actors = {
        node: CaptureProxy.options(  # type: ignore[attr-defined]
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
        ).remote(upstream)
        for node in nodes
    }
    urls = {}
    for node, actor in actors.items():
        try:
            urls[node] = (ray.get(actor.url.remote()), ray.get(actor.secret_file.remote()))
            if proxy_check:
                ray.get(actor.health.remote())
        except ray.exceptions.RayError as e:
            raise EvalError(f"the capture proxy on node {node} (upstream {upstream}) did not start: {e}") from e
    return actors, urls


def run_round(
    jobs: list[Any],
    args: Any,
    run_dir: Path,
    *,
    run_tag: str,
    roll_out: RollOut,
    session_id: SessionId,
) -> list[dict[str, Any]]:
    """Run ``jobs`` on the connected Ray cluster; write rewards, lost attempts, logs and captures into ``run_dir``.
    Returns the sessions-table rows in job order (the caller writes ``sessions.parquet``)."""
    actors, urls = _start_proxies(args.upstream, args.proxy_check)
    pending = list(range(len(jobs)))  # indexes into jobs, in order
    attempts = [0] * len(jobs)
    current = list(jobs)  # each job's latest attempt (its own session id)
    running: dict[Any, int] = {}
    done: dict[int, dict[str, Any]] = {}
    lost: list[dict[str, Any]] = []

    def lose(i: int, node: str | None, reason: str) -> None:
        job = current[i]
        lost.append(
            {"session_id": job.session_id, "task_id": job.task["instance_id"], "sample_id": job.sample}
            | {"node_id": node, "reason": reason}
        )
        attempts[i] += 1
        if attempts[i] >= MAX_ATTEMPTS:
            raise EvalError(f"session {job.session_id}: {MAX_ATTEMPTS} attempts lost their worker ({reason})")
        retry_tag = f"{run_tag}-r{attempts[i]}"
        current[i] = dataclasses.replace(job, session_id=session_id(retry_tag, job.task["instance_id"], job.sample))
        pending.append(i)

    try:
        while True:
            while pending and len(running) < args.concurrency:
                i = pending.pop(0)
                running[_session.remote(current[i], args, urls, roll_out)] = i
            if running:
                [ref], _ = ray.wait(list(running), num_returns=1)
                i = running.pop(ref)
                try:
                    done[i] = ray.get(ref)
                except WORKER_LOST as e:
                    lose(i, None, type(e).__name__)
                continue
            # Every session has a result: those whose node died since took their records with it.
            for node in [node for node in urls if not _alive(actors[node])]:
                del urls[node]
                for i in [i for i, result in done.items() if result["node"] == node]:
                    del done[i]
                    lose(i, node, "node_died")
            if not pending:
                break
            if not urls:
                raise EvalError("every node's capture proxy died: no node is left to run the lost sessions on")
        _gather_captures(actors, urls, run_dir / CAPTURES)
    finally:  # mitmdump first: killing an actor leaves its child process running
        stops = [actor.stop.remote() for actor in actors.values()]
        ray.wait(stops, num_returns=len(stops), timeout=60)
        for actor in actors.values():
            ray.kill(actor)

    for result in done.values():
        for name, data in result["logs"].items():
            path = run_dir / LOGS / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    rewards = sorted(map(_reward_row, done.values()), key=lambda r: r["session_id"])  # as eval score sorts them
    write_rewards(pl.DataFrame(rewards, schema=REWARDS_SCHEMA), run_dir)
    write_lost(lost, run_dir)
    return [done[i]["row"] for i in range(len(jobs))]


def _alive(actor: Any) -> bool:
    try:
        ray.get(actor.url.remote(), timeout=60)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False
    return True


def _gather_captures(actors: dict[str, Any], urls: dict[str, tuple[str, str]], folder: Path) -> None:
    for node in urls:
        try:
            files = ray.get(actors[node].finish.remote())
        except ray.exceptions.RayActorError as e:  # between the last check and now: its sessions cannot be rerun
            raise EvalError(f"node {node} died as the round ended; its sessions' captures are lost: {e}") from e
        for name, data in files.items():
            path = folder / node[:16] / name
            # A new name, not a refusal: the proxy's own copy is gone, so refusing would lose the round's records.
            [written] = write_new({path: data}).values()
            if written != path:
                print(f"{path} holds other bytes: kept it, and wrote this round's file as {written}", file=sys.stderr)


def _reward_row(result: dict[str, Any]) -> dict[str, Any]:
    row, g = result["row"], result["grade"]
    report = None if g.report is None else json.dumps(g.report, sort_keys=True)
    keys = ("session_id", "task_id", "sample_id", "harness")
    return {k: row[k] for k in keys} | {
        "reward": g.reward,
        "resolved": g.resolved,
        "reason": g.reason,
        "report": report,
    }


def write_lost(rows: list[dict[str, Any]], run_dir: Path) -> Path:
    """``lost.parquet``: every attempt that was run again (empty when none was)."""
    return write_versioned_parquet(pl.DataFrame(rows, schema=LOST_SCHEMA), run_dir / LOST, VERSION_KEY, FORMAT_VERSION)


def read_lost(run_dir: Path) -> pl.DataFrame:
    path = run_dir / LOST
    table = read_versioned_parquet(path, VERSION_KEY, FORMAT_VERSION, kind="run table", error=RunError)
    return conform_table(table, LOST_SCHEMA, source=str(path), kind="run", error=RunError)
