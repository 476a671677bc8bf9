"""Fill a run's task ids, samples and rewards into a trajectories Parquet, so GRPO can train on it.

    python -m eval join trajectories.parquet RUN_DIR -o trajectories.rewarded.parquet

The task mapping is the one ``python -m reconstruct --sessions RUN_DIR/sessions.parquet`` applies
(reconstruct.read_session_tasks), so both agree; a trace already mapped to a different task is refused. Rewards
come from RUN_DIR/rewards.parquet (``python -m eval score RUN_DIR``) by session id, the same reward on every trace
of a session (the outcome reward is broadcast, as in Polar). Traces of sessions outside the run keep what they
had. Reports traces of the run that got no reward (it stays null) and rewarded sessions with no trace (nothing
was captured for them). Output written atomically (reconstruct.schema.write); it may be the input file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import polars as pl
import tyro
from rich.console import Console

from eval.runs import REWARDS, SESSIONS, RunError, read_rewards
from reconstruct import read_session_tasks, schema

__all__ = ["Args", "JoinStats", "join", "main"]

console = Console(stderr=True)


@dataclasses.dataclass
class Args:
    """Join a run's tasks and rewards onto trajectories."""

    trajectories: tyro.conf.Positional[Path]
    """Trajectory Parquet from python -m reconstruct."""
    run_dir: tyro.conf.Positional[Path]
    """Run folder holding sessions.parquet and rewards.parquet."""
    output: Annotated[Path, tyro.conf.arg(aliases=("-o",))]
    """Trajectory Parquet to write (may be the input)."""


@dataclasses.dataclass(frozen=True)
class JoinStats:
    traces: int  # in the file
    run_traces: int  # of sessions in the run's sessions table
    rewarded_traces: int
    unrewarded_sessions: list[str]  # in the run and traced, but no reward row: their reward stays null
    untraced_rewards: list[str]  # rewarded, but no trace of theirs in the file


def join(trajectories: pl.DataFrame, run_dir: Path) -> tuple[pl.DataFrame, JoinStats]:
    """``trajectories`` (the trajectory schema) with the run's task_id, sample_id and reward filled in."""
    tasks = read_session_tasks(run_dir / SESSIONS)
    rewards = read_rewards(run_dir).select("session_id", "reward")
    duplicated = rewards.filter(pl.col("session_id").is_duplicated())["session_id"].unique().sort().to_list()
    if duplicated:
        raise RunError(f"{run_dir / REWARDS}: more than one reward for sessions {duplicated[:5]}")
    run = pl.DataFrame(
        {
            "session_id": list(tasks),
            "run_task_id": [task for task, _ in tasks.values()],
            "run_sample_id": [sample for _, sample in tasks.values()],
            "in_run": [True] * len(tasks),
        },
        schema={"session_id": pl.String, "run_task_id": pl.String, "run_sample_id": pl.Int32, "in_run": pl.Boolean},
    )
    df = trajectories.join(run, on="session_id", how="left", maintain_order="left")
    df = df.join(rewards.rename({"reward": "run_reward"}), on="session_id", how="left", maintain_order="left")
    in_run = pl.col("in_run").fill_null(False)

    clash = df.filter(in_run & pl.col("task_id").is_not_null() & (pl.col("task_id") != pl.col("run_task_id")))
    if clash.height:
        first = clash.row(0, named=True)
        raise RunError(
            f"{run_dir / SESSIONS}: session {first['session_id']} is task {first['run_task_id']!r} here but "
            f"{first['task_id']!r} in the trajectories ({clash.height} traces disagree)"
        )
    joined = df.with_columns(
        task_id=pl.when(in_run).then(pl.col("run_task_id")).otherwise(pl.col("task_id")),
        sample_id=pl.when(in_run).then(pl.col("run_sample_id")).otherwise(pl.col("sample_id")),
        reward=pl.when(in_run).then(pl.col("run_reward")).otherwise(pl.col("reward")),
    )
    traced = set(trajectories["session_id"].to_list())
    stats = JoinStats(
        traces=trajectories.height,
        run_traces=joined.filter(in_run).height,
        rewarded_traces=joined.filter(in_run & pl.col("run_reward").is_not_null()).height,
        unrewarded_sessions=sorted(set(joined.filter(in_run & pl.col("run_reward").is_null())["session_id"])),
        untraced_rewards=sorted(set(rewards["session_id"].to_list()) - traced),
    )
    return joined.select(list(schema.SCHEMA)), stats


def main(args: Args) -> int:
    joined, stats = join(schema.read(args.trajectories), args.run_dir)
    schema.write(joined, args.output)
    console.print(f"{stats.traces} traces, {stats.run_traces} of this run's sessions, {stats.rewarded_traces} rewarded")
    if stats.unrewarded_sessions:
        console.print(
            f"[yellow]{len(stats.unrewarded_sessions)} sessions have traces but no reward (left null): "
            f"{', '.join(stats.unrewarded_sessions[:5])}{' ...' if len(stats.unrewarded_sessions) > 5 else ''}[/]"
        )
    if stats.untraced_rewards:
        console.print(
            f"[yellow]{len(stats.untraced_rewards)} rewarded sessions have no trace (nothing captured?): "
            f"{', '.join(stats.untraced_rewards[:5])}{' ...' if len(stats.untraced_rewards) > 5 else ''}[/]"
        )
    print(f"trajectories: {args.output}")
    return 0
