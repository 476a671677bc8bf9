"""pass@1 and pass@k per task and overall, by harness, from graded runs; tables and a bar chart.

    python -m eval report RUN_DIR [RUN_DIR ...] [--k 1 5 10] [--plot PATH] [--against OTHER_RUN_DIR]

Reads RUN_DIR/rewards.parquet of every run (``python -m eval score RUN_DIR``); runs of one harness pool their
samples per task (two rounds of a loop are compared with ``--against``, not pooled: the report says so). pass@k
is the unbiased estimator of Chen et al. 2021 (https://arxiv.org/abs/2107.03374, §2.1): with n graded samples of
a task of which c resolved, pass@k = 1 - C(n-c, k) / C(n, k); overall = the mean over the tasks
that have at least k samples (a task with fewer has no pass@k). Prints a table per harness and task
and an overall one; writes the numbers to ``report.json`` and a grouped bar chart (overall pass@k by harness)
to ``report.svg``, both in the first RUN_DIR. The chart is plain SVG: matplotlib is not a dependency.

``--against OTHER_RUN_DIR`` compares the runs with another run folder measured on the same tasks (the stage before,
another checkpoint), task by task (eval/stats.py ``paired``): each task's pass rate on each side (every harness's
samples pooled), joined on task_id; the mean per-task difference (RUN_DIRS - OTHER) with a 95 % interval by
bootstrap over tasks (seed 0) and the clustered standard error; the exact sign-flip permutation test over tasks
(McNemar's exact test at one sample a task; Monte Carlo with a fixed seed only where the exact support is too
large); and Fisher's exact test on the pooled counts beside it. Tasks on one side only are named and left out.
The numbers go into report.json as ``paired``.

An earlier report is never replaced (issue 37): when ``report.json`` or the chart (``--plot`` too) already holds
other bytes, both get the first number that is free for both (``report-1.json``, ``report-1.svg``), and the paths
printed say so; a file identical to the one there is left as it is. So reporting again after more grading keeps
every earlier report, and reporting again with nothing new adds no file.
"""

from __future__ import annotations

import dataclasses
import json
import math
from html import escape
from pathlib import Path

import polars as pl
import tyro
from rich.console import Console
from rich.table import Table

from eval.runs import REWARDS, SESSIONS, read_rewards, read_sessions
from eval.stats import Counts, paired
from reconstruct.files import write_new

__all__ = ["Args", "main", "pass_at_k", "pass_table", "svg_chart", "task_counts"]

console = Console()
NO_HARNESS = "predictions"  # rewards graded from a predictions file carry no harness


@dataclasses.dataclass
class Args:
    """Report pass@k of graded runs."""

    run_dirs: tyro.conf.Positional[tuple[Path, ...]]
    """Run folders, each with rewards.parquet."""
    k: tuple[int, ...] = (1, 5, 10)
    """The k of pass@k; a k above every task's sample count is left out."""
    plot: Path | None = None
    """Bar chart to write (SVG); default: report.svg in the first run folder."""
    against: Path | None = None
    """A run folder measured on the same tasks to compare with, task by task: the paired difference (the runs
    minus this one) with its 95 % interval, the exact sign-flip test over tasks, and Fisher's test beside it."""

    def __post_init__(self) -> None:
        if not self.run_dirs:
            raise ValueError("give at least one run folder")
        if not self.k or min(self.k) < 1:
            raise ValueError(f"--k must be positive integers, got {self.k}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n, c of them correct, is
    correct; exact integer arithmetic (n up to thousands would overflow the paper's float product form)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_table(rewards: pl.DataFrame, ks: tuple[int, ...]) -> pl.DataFrame:
    """One row per (harness, task_id): n, c and ``pass@k`` for each k (null where n < k)."""
    per_task = (
        rewards.with_columns(pl.col("harness").fill_null(NO_HARNESS))
        .group_by("harness", "task_id")
        .agg(n=pl.len(), c=pl.col("resolved").fill_null(False).sum())
        .sort("harness", "task_id")
    )
    counts = list(zip(per_task["n"].to_list(), per_task["c"].to_list(), strict=True))
    return per_task.with_columns(
        pl.Series(f"pass@{k}", [pass_at_k(n, c, k) if n >= k else None for n, c in counts], dtype=pl.Float64)
        for k in ks
    )


def overall(per_task: pl.DataFrame, ks: tuple[int, ...]) -> pl.DataFrame:
    """One row per harness: tasks, samples, resolved, and the mean pass@k over tasks that have one."""
    counts = [pl.len().alias("tasks"), pl.col("n").sum().alias("samples"), pl.col("c").sum().alias("resolved")]
    return per_task.group_by("harness").agg(*counts, *[pl.col(f"pass@{k}").mean() for k in ks]).sort("harness")


def svg_chart(summary: pl.DataFrame, ks: tuple[int, ...], title: str) -> str:
    """Grouped bars: one group per k, one bar per harness, height = overall pass@k (0..1)."""
    harnesses = summary["harness"].to_list()
    colors = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1"]
    bar, gap, height, left, top = 28, 24, 240, 48, 40
    width = left + len(ks) * (len(harnesses) * bar + gap) + 160
    parts = [
        (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + top + 50}" '
            'font-family="sans-serif" font-size="12">'
        ),
        f'<text x="{left}" y="20" font-size="14">{escape(title)}</text>',
    ]
    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = top + height * (1 - tick)
        parts.append(f'<line x1="{left}" x2="{width - 160}" y1="{y}" y2="{y}" stroke="#ddd"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4}" text-anchor="end">{tick:.2f}</text>')
    for g, k in enumerate(ks):
        x0 = left + gap / 2 + g * (len(harnesses) * bar + gap)
        for h, value in enumerate(summary[f"pass@{k}"].to_list()):
            x = x0 + h * bar
            if value is None:  # no task of this harness has k samples
                continue
            y, color, label = top + height * (1 - value), colors[h % len(colors)], escape(harnesses[h])
            parts.append(
                f'<rect x="{x}" y="{y}" width="{bar - 4}" height="{height * value}" fill="{color}">'
                f"<title>{label} pass@{k} = {value:.3f}</title></rect>"
            )
            parts.append(
                f'<text x="{x + bar / 2 - 2}" y="{y - 3}" text-anchor="middle" font-size="9">{value:.2f}</text>'
            )
        x_mid, y_label = x0 + len(harnesses) * bar / 2, top + height + 18
        parts.append(f'<text x="{x_mid}" y="{y_label}" text-anchor="middle">pass@{k}</text>')
    for h, name in enumerate(harnesses):
        y = top + 14 * h
        parts.append(f'<rect x="{width - 150}" y="{y}" width="10" height="10" fill="{colors[h % len(colors)]}"/>')
        parts.append(f'<text x="{width - 135}" y="{y + 9}">{escape(name)}</text>')
    return "\n".join([*parts, "</svg>"]) + "\n"


def task_counts(rewards: pl.DataFrame) -> dict[str, Counts]:
    """Task id -> (resolved, graded samples), every harness's samples pooled."""
    per_task = rewards.group_by("task_id").agg(n=pl.len(), c=pl.col("resolved").fill_null(False).sum())
    return {r["task_id"]: (int(r["c"]), int(r["n"])) for r in per_task.iter_rows(named=True)}


def paired_report(rewards: pl.DataFrame, against: Path, runs: str) -> dict[str, object]:
    """Print the task-by-task comparison of ``rewards`` with the run folder ``against``; return its numbers."""
    after, before = task_counts(rewards), task_counts(read_rewards(against))
    result = paired(before, after)
    table = Table(title=f"paired, per task: {runs} against {against}")
    for column in ("task", f"{against}", f"{runs}", "difference"):
        table.add_column(column)
    per_task = []
    for task in sorted(before.keys() & after.keys()):
        (cb, nb), (ca, na) = before[task], after[task]
        per_task.append({"task_id": task, "before": [cb, nb], "after": [ca, na], "difference": ca / na - cb / nb})
        table.add_row(task, f"{cb} / {nb}", f"{ca} / {na}", f"{ca / na - cb / nb:+.3f}")
    console.print(table)
    lo, hi = result.ci95
    console.print(
        f"paired over {result.tasks} tasks ({result.differing} differ): mean pass rate {result.before:.3f} -> "
        f"{result.after:.3f}, difference {result.delta:+.3f}, 95 % CI [{lo:+.3f}, {hi:+.3f}] (bootstrap over tasks), "
        f"clustered SE {result.se:.3f}; sign-flip test p = {result.p_value:.3g} ({result.method}); Fisher's exact "
        f"test on the pooled counts {result.pooled_before[0]}/{result.pooled_before[1]} -> "
        f"{result.pooled_after[0]}/{result.pooled_after[1]}: p = {result.fisher_p:.3g}",
        soft_wrap=True,
        highlight=False,
    )
    for side, missing in ((str(against), result.only_before), (runs, result.only_after)):
        if missing:
            console.print(f"[yellow]{len(missing)} task(s) only in {side}, left out: {', '.join(missing)}[/]")
    return {"against": str(against), **result.as_dict(), "per_task": per_task}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(args: Args) -> int:
    rewards = pl.concat([read_rewards(run) for run in args.run_dirs])
    for run in args.run_dirs:  # sessions that were never graded would silently shrink n
        if (run / SESSIONS).exists():
            ungraded = read_sessions(run).join(read_rewards(run), on="session_id", how="anti").height
            if ungraded:
                message = f"[yellow]{run}: {ungraded} sessions have no row in {REWARDS}: not counted[/]"
                console.print(message, soft_wrap=True)
    max_n = max(pass_table(rewards, (1,))["n"].to_list(), default=0)
    ks = tuple(k for k in sorted(set(args.k)) if k <= max_n) or (1,)
    per_task = pass_table(rewards, ks)
    summary = overall(per_task, ks)

    table = Table(title="pass@k per task")
    for column in ("harness", "task", "resolved / n", *[f"pass@{k}" for k in ks]):
        table.add_column(column)
    for row in per_task.iter_rows(named=True):
        table.add_row(row["harness"], row["task_id"], f"{row['c']} / {row['n']}", *[_fmt(row[f"pass@{k}"]) for k in ks])
    console.print(table)
    table = Table(title=f"overall ({', '.join(str(run) for run in args.run_dirs)})")
    for column in ("harness", "tasks", "resolved / samples", *[f"pass@{k}" for k in ks]):
        table.add_column(column)
    for row in summary.iter_rows(named=True):
        cells = [_fmt(row[f"pass@{k}"]) for k in ks]
        table.add_row(row["harness"], str(row["tasks"]), f"{row['resolved']} / {row['samples']}", *cells)
    console.print(table)
    if len(args.run_dirs) > 1 and args.against is None:  # a user comparing two rounds types this first
        first, *rest = args.run_dirs
        console.print(
            f"{len(args.run_dirs)} run folders pooled: their samples count together per harness and task. To compare "
            f"runs task by task: python -m eval report {first} --against {rest[0]}",
            highlight=False,
            soft_wrap=True,
        )

    out_dir = args.run_dirs[0]
    runs = [str(run) for run in args.run_dirs]
    numbers: dict[str, object] = {"runs": runs, "overall": summary.to_dicts(), "per_task": per_task.to_dicts()}
    if args.against is not None:
        numbers["paired"] = paired_report(rewards, args.against, ", ".join(runs))
    numbers_path, plot = out_dir / "report.json", args.plot or out_dir / "report.svg"
    chart = svg_chart(summary, ks, f"pass@k by harness ({summary['samples'].sum()} graded samples)")
    written = write_new({numbers_path: (json.dumps(numbers, indent=1) + "\n").encode(), plot: chart.encode()})
    if written[numbers_path] != numbers_path:  # the set moves together, so one file says whether it did
        print(f"kept the earlier report ({numbers_path}, {plot}): this one has the first number free for both")
    print(f"numbers: {written[numbers_path]}")
    print(f"plot:    {written[plot]}")
    return 0
