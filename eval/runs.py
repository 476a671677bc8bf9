"""A run folder's tables: the one source of truth for their columns, written and read here only.

    RUN_DIR/
      tasks.jsonl          the instances rolled out (SWE-bench 5.x shape), so ``score`` can run alone
      sessions.parquet     one row per task x sample: what the harness did and the patch it left
      rewards.parquet      one row per graded session: reward and why
      logs/<session_id>/   harness stdout/stderr, eval script output, swebench report

``sessions.parquet`` is written by ``python -m eval rollout`` and ``rewards.parquet`` by ``python -m eval score``;
``python -m reconstruct --sessions RUN_DIR/sessions.parquet`` maps sessions to tasks in the trajectories, and
``python -m eval join`` fills their rewards. The format version is stored in the Parquet key-value metadata under
``polar.run.version``: 1 for rewards, 3 for sessions (2 added ``setup_s`` and ``patch_s``, 3 ``stdout_bytes``,
``stderr_bytes`` and the status ``patch_too_large``; an older sessions table reads with the added columns null).
Writes are atomic (``reconstruct.files``: temporary file, then rename).
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from eval.errors import EvalError
from reconstruct.files import conform_table, read_versioned_parquet, write_versioned_parquet

FORMAT_VERSION = 1
SESSIONS_VERSION = 3
VERSION_KEY = "polar.run.version"

TASKS = "tasks.jsonl"
SESSIONS = "sessions.parquet"
REWARDS = "rewards.parquet"
LOGS = "logs"

SESSION_STATUSES = ("ok", "no_edit", "crashed", "timeout", "setup_failed", "patch_too_large")

SESSIONS_SCHEMA = pl.Schema(
    {
        "session_id": pl.String,  # the API key the harness sent; the capture records carry it
        "task_id": pl.String,  # the instance_id
        "sample_id": pl.Int32,  # 0 .. samples-1 per task
        "harness": pl.String,  # preset name, a key of eval/harness/presets.py's PRESETS
        "model": pl.String,  # model name the harness was told to use
        "status": pl.String,  # one of SESSION_STATUSES
        "exit_code": pl.Int32,  # null when killed at the timeout or never started
        "started_at": pl.String,  # UTC, ISO 8601, to the millisecond: the session's start, before its setup
        "setup_s": pl.Float64,  # checkout or container start, until the harness is launched (or setup failed)
        "duration_s": pl.Float64,  # harness wall time, from its launch
        "patch_s": pl.Float64,  # taking the patch after the harness exited; null when it never ran
        "patch": pl.String,  # `git diff --cached --binary` of the workspace, harness folders dropped; "" if none
        "error": pl.String,  # why a session is not "ok" (last lines of stderr, setup failure); null when ok
        "stdout_bytes": pl.Int64,  # all the harness printed (logs/<session_id>/stdout.txt: the last --limits.output)
        "stderr_bytes": pl.Int64,  # null when it never ran
    }
)

ADDED_IN_2 = {"setup_s": pl.Float64, "patch_s": pl.Float64}
ADDED_IN_3 = {"stdout_bytes": pl.Int64, "stderr_bytes": pl.Int64}

REWARD_REASONS = ("graded", "empty_patch", "patch_failed", "tests_timed_out", "eval_error", "session_failed")

REWARDS_SCHEMA = pl.Schema(
    {
        "session_id": pl.String,  # joins sessions.parquet (for --predictions/--gold: "<model>/<instance_id>")
        "task_id": pl.String,
        "sample_id": pl.Int32,
        "harness": pl.String,  # null when graded from a predictions file
        "reward": pl.Float64,  # 1.0 resolved, 0.0 otherwise
        "resolved": pl.Boolean,
        "reason": pl.String,  # one of REWARD_REASONS
        "report": pl.String,  # swebench's report for the instance as JSON text; null when not graded
    }
)


class RunError(EvalError):
    """A run table that does not match its schema; the message names the file and the column."""


def _write(df: pl.DataFrame, schema: pl.Schema, path: Path, version: int = FORMAT_VERSION) -> Path:
    table = conform_table(df, schema, source=str(path), kind="run", error=RunError)
    return write_versioned_parquet(table, path, VERSION_KEY, version)


def _read(path: Path, schema: pl.Schema, version: int = FORMAT_VERSION) -> pl.DataFrame:
    table = read_versioned_parquet(path, VERSION_KEY, version, kind="run table", error=RunError)
    return conform_table(table, schema, source=str(path), kind="run", error=RunError)


def write_sessions(df: pl.DataFrame, run_dir: Path) -> Path:
    bad = set(df["status"].to_list()) - set(SESSION_STATUSES) if "status" in df.columns else set()
    if bad:
        raise RunError(f"{Path(run_dir) / SESSIONS}: status {sorted(bad)} not in {SESSION_STATUSES}")
    return _write(df, SESSIONS_SCHEMA, Path(run_dir) / SESSIONS, SESSIONS_VERSION)


def read_sessions(run_dir: Path) -> pl.DataFrame:
    path = Path(run_dir) / SESSIONS
    try:
        version = pl.read_parquet_metadata(path).get(VERSION_KEY)
    except (OSError, pl.exceptions.ComputeError):
        version = None  # read_versioned_parquet names the problem
    if version in ("1", "2"):  # before the output sizes (and, in 1, the setup and patch times)
        table = read_versioned_parquet(path, VERSION_KEY, int(version), kind="run table", error=RunError)
        added = {**ADDED_IN_2, **ADDED_IN_3} if version == "1" else ADDED_IN_3
        table = table.with_columns(pl.lit(None, dtype).alias(name) for name, dtype in added.items())
        return conform_table(table, SESSIONS_SCHEMA, source=str(path), kind="run", error=RunError)
    return _read(path, SESSIONS_SCHEMA, SESSIONS_VERSION)


def write_rewards(df: pl.DataFrame, run_dir: Path) -> Path:
    bad = set(df["reason"].to_list()) - set(REWARD_REASONS) if "reason" in df.columns else set()
    if bad:
        raise RunError(f"{Path(run_dir) / REWARDS}: reason {sorted(bad)} not in {REWARD_REASONS}")
    return _write(df, REWARDS_SCHEMA, Path(run_dir) / REWARDS)


def read_rewards(run_dir: Path) -> pl.DataFrame:
    return _read(Path(run_dir) / REWARDS, REWARDS_SCHEMA)
