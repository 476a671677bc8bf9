"""A rollout-service job's results, read from its folder: one record per session, with its reward and traces.

    from eval.service.results import copy_session_records, session_results
    copy_session_records(captures_dir, job_dir / "run", job_dir / "captures.jsonl", job_dir / "captures.summary.json")
    sessions = session_results(job_dir, job, traces=True)   # job: the job.json dict (eval/service/app.py)

Everything here reads the tables the batch phases wrote (eval/runs.py, reconstruct/schema.py); nothing is
recomputed, so the service and ``python -m eval ...`` by hand give the same answers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl

from eval.runs import REWARDS, SESSIONS, read_rewards, read_sessions
from reconstruct import CaptureError, discover, schema
from reconstruct.files import write_atomic

__all__ = ["TRACE_FIELDS", "copy_session_records", "session_results"]

TRACE_FIELDS = ("trace_id", "chain_index", "n_calls", "finish_reason", "token_source", "drift_turns",
                "prompt_ids", "response_ids", "loss_mask", "logprobs", "messages")  # fmt: skip


def copy_session_records(captures: Path, run_dir: Path, out: Path, summary: Path) -> dict[str, dict[str, int]]:
    """Copy the capture lines of the run's sessions, byte for byte, into ``out``; per session, count its model
    calls and the incomplete ones (stream broken, client gone, upstream error) into ``summary`` and return that."""
    wanted = set(read_sessions(run_dir)["session_id"].to_list())
    needles = [s.encode() for s in wanted]
    counts = {sid: {"calls": 0, "incomplete_calls": 0} for sid in wanted}
    try:
        files = discover([captures])
    except CaptureError:  # nothing captured yet (the harnesses never reached the proxy): an empty copy
        files = []

    def copy(tmp: Path) -> None:
        with open(tmp, "wb") as dest:
            for path in files:
                with open(path, "rb") as src:
                    for line in src:
                        if not any(n in line for n in needles):  # cheap test first: most lines are other sessions'
                            continue
                        try:
                            record = json.loads(line)
                        except json.JSONDecodeError:  # a torn last line: reconstruction counts those on its own
                            continue
                        if record.get("session_id") not in wanted:
                            continue
                        dest.write(line if line.endswith(b"\n") else line + b"\n")
                        if record.get("api") != "other":
                            counts[record["session_id"]]["calls"] += 1
                            bad = not record.get("complete") or record.get("error") or record.get("status") != 200
                            counts[record["session_id"]]["incomplete_calls"] += bool(bad)

    write_atomic(out, copy)
    summary.write_text(json.dumps(counts, indent=1, sort_keys=True))
    return counts


def session_results(job_dir: Path, job: dict[str, Any], *, traces: bool) -> list[dict[str, Any]]:
    """One dict per session of the job, in sample order; empty while the rollout phase has not written its table.

    Fields: the sessions-table row (status, patch, error, ...), ``reward``/``resolved``/``reason`` (reward 0 and
    reason ``eval_error`` plus ``grade_error`` when grading failed; null while not graded yet), ``calls`` and
    ``incomplete_calls`` (from the captures), ``n_traces``, and with ``traces`` the traces' TRACE_FIELDS
    (``messages`` parsed from its JSON text).
    """
    run = job_dir / "run"
    if not (run / SESSIONS).exists():
        return []
    sessions = read_sessions(run).sort("sample_id")
    rewards = read_rewards(run) if (run / REWARDS).exists() else None
    grade_error = job["phase_errors"].get("score")
    summary_path = job_dir / "captures.summary.json"
    counts = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    traj_path = job_dir / "trajectories.parquet"
    trajectories = schema.read(traj_path) if traj_path.exists() else None
    results = []
    for row in sessions.iter_rows(named=True):
        sid = row["session_id"]
        result = dict(row) | {"reward": None, "resolved": None, "reason": None, "grade_error": grade_error}
        graded = rewards.filter(pl.col("session_id") == sid) if rewards is not None else None
        if graded is not None and graded.height:
            result |= {k: graded[k][0] for k in ("reward", "resolved", "reason")}
        elif grade_error is not None:
            result |= {"reward": 0.0, "resolved": False, "reason": "eval_error"}
        result |= counts.get(sid, {"calls": None, "incomplete_calls": None})
        mine = (
            trajectories.filter(pl.col("session_id") == sid).sort("chain_index") if trajectories is not None else None
        )
        result["n_traces"] = mine.height if mine is not None else None
        if traces:
            result["traces"] = [
                {k: json.loads(t[k]) if k == "messages" else t[k] for k in TRACE_FIELDS}
                for t in (mine.iter_rows(named=True) if mine is not None else [])
            ]
        results.append(result)
    return results
