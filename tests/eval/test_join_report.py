"""eval.join on hand-built run tables and trajectories (the end-to-end join is in test_rollout.py), and eval.report's
pass@k on a rewards table with known answers."""

import json
import math
import xml.etree.ElementTree as ElementTree

import polars as pl
import pytest

from eval import join, report
from eval.runs import (
    REWARDS_SCHEMA,
    SESSIONS,
    SESSIONS_SCHEMA,
    VERSION_KEY,
    RunError,
    read_sessions,
    write_rewards,
    write_sessions,
)
from reconstruct import schema
from reconstruct.files import write_versioned_parquet

SVG = "{http://www.w3.org/2000/svg}"


def traces(*rows: tuple[str, str | None, float | None]) -> pl.DataFrame:
    """Trajectory rows (session_id, task_id, reward), two traces per session, the other columns filled plainly."""
    full = [(session, task, reward, chain) for session, task, reward in rows for chain in (0, 1)]
    return schema.conform(
        pl.DataFrame(
            {
                "trace_id": [f"{s}/{c}" for s, _, _, c in full],
                "session_id": [s for s, _, _, _ in full],
                "task_id": [t for _, t, _, _ in full],
                "sample_id": [None] * len(full),
                "chain_index": [c for _, _, _, c in full],
                "prompt_ids": [[1, 2]] * len(full),
                "response_ids": [[3]] * len(full),
                "loss_mask": [[1]] * len(full),
                "logprobs": [[-0.5]] * len(full),
                "token_source": ["captured"] * len(full),
                "n_calls": [1] * len(full),
                "exchange_ids": [["x"]] * len(full),
                "finish_reason": ["stop"] * len(full),
                "drift_turns": [[]] * len(full),
                "model": ["tiny"] * len(full),
                "api": ["chat"] * len(full),
                "messages": ["{}"] * len(full),
                "reward": [r for _, _, r, _ in full],
            },
            schema_overrides={"sample_id": pl.Int32, "reward": pl.Float64, "task_id": pl.String},
        )
    )


def run_tables(run_dir, sessions: list[tuple[str, str, int]], rewards: list[tuple[str, str, int, float]]) -> None:
    write_sessions(
        pl.DataFrame(
            [
                {
                    "session_id": s,
                    "task_id": t,
                    "sample_id": n,
                    "harness": "mini",
                    "model": "tiny",
                    "status": "ok",
                    "exit_code": 0,
                    "started_at": "2026-01-01T00:00:00+00:00",
                    "duration_s": 1.0,
                    "patch": "x",
                    "error": None,
                }
                for s, t, n in sessions
            ],
            schema=SESSIONS_SCHEMA,
        ),
        run_dir,
    )
    write_rewards(
        pl.DataFrame(
            [
                {
                    "session_id": s,
                    "task_id": t,
                    "sample_id": n,
                    "harness": "mini",
                    "reward": r,
                    "resolved": r == 1.0,
                    "reason": "graded",
                    "report": None,
                }
                for s, t, n, r in rewards
            ],
            schema=REWARDS_SCHEMA,
        ),
        run_dir,
    )


def test_join_fills_tasks_and_rewards_of_the_run_and_reports_the_gaps(tmp_path):
    run_tables(
        tmp_path,
        sessions=[("s-a", "task-a", 0), ("s-b", "task-a", 1), ("s-c", "task-b", 0), ("s-untraced", "task-b", 1)],
        rewards=[("s-a", "task-a", 0, 1.0), ("s-b", "task-a", 1, 0.0), ("s-untraced", "task-b", 1, 1.0)],
    )
    before = traces(("s-a", "task-a", None), ("s-b", None, None), ("s-c", None, None), ("other-run", "task-z", 0.5))
    joined, stats = join.join(before, tmp_path)

    assert joined.columns == list(schema.SCHEMA)
    assert joined["trace_id"].to_list() == before["trace_id"].to_list()  # order kept
    rows = {(r["trace_id"]): (r["task_id"], r["sample_id"], r["reward"]) for r in joined.iter_rows(named=True)}
    assert rows == {
        "s-a/0": ("task-a", 0, 1.0),
        "s-a/1": ("task-a", 0, 1.0),
        "s-b/0": ("task-a", 1, 0.0),
        "s-b/1": ("task-a", 1, 0.0),
        "s-c/0": ("task-b", 0, None),  # graded nowhere: the reward stays null
        "s-c/1": ("task-b", 0, None),
        "other-run/0": ("task-z", None, 0.5),  # not this run's: untouched
        "other-run/1": ("task-z", None, 0.5),
    }
    assert stats == join.JoinStats(
        traces=8, run_traces=6, rewarded_traces=4, unrewarded_sessions=["s-c"], untraced_rewards=["s-untraced"]
    )


def test_join_cli_writes_atomically_over_its_input(tmp_path, capsys):
    run_tables(tmp_path, sessions=[("s-a", "task-a", 0)], rewards=[("s-a", "task-a", 0, 1.0)])
    path = schema.write(traces(("s-a", None, None)), tmp_path / "trajectories.parquet")
    assert join.main(join.Args(path, tmp_path, path)) == 0
    assert schema.read(path)["reward"].to_list() == [1.0, 1.0]
    assert "2 traces, 2 of this run's sessions, 2 rewarded" in capsys.readouterr().err


def test_join_refuses_a_trace_mapped_to_another_task(tmp_path):
    run_tables(tmp_path, sessions=[("s-a", "task-a", 0)], rewards=[("s-a", "task-a", 0, 1.0)])
    with pytest.raises(RunError, match="session s-a is task 'task-a' here but 'task-q' in the trajectories"):
        join.join(traces(("s-a", "task-q", None)), tmp_path)


def test_join_refuses_two_rewards_for_one_session(tmp_path):
    twice = [("s-a", "task-a", 0, 1.0), ("s-a", "task-a", 0, 0.0)]
    run_tables(tmp_path, sessions=[("s-a", "task-a", 0)], rewards=twice)
    with pytest.raises(RunError, match=r"rewards.parquet: more than one reward for sessions \['s-a'\]"):
        join.join(traces(("s-a", None, None)), tmp_path)


def test_older_sessions_tables_read_with_the_added_columns_null_and_another_version_is_refused(tmp_path):
    run_tables(tmp_path, sessions=[("s-a", "task-a", 0)], rewards=[("s-a", "task-a", 0, 1.0)])
    path = tmp_path / SESSIONS
    current = read_sessions(tmp_path)
    for version, dropped in (
        (1, ["setup_s", "patch_s", "stdout_bytes", "stderr_bytes"]),
        (2, ["stdout_bytes", "stderr_bytes"]),
    ):
        write_versioned_parquet(current.drop(dropped), path, VERSION_KEY, version)
        old = read_sessions(tmp_path)
        assert old.columns == list(SESSIONS_SCHEMA) and old["duration_s"].to_list() == [1.0]
        assert all(old.row(0, named=True)[column] is None for column in dropped)
    write_versioned_parquet(current, path, VERSION_KEY, 4)
    with pytest.raises(RunError, match=r"sessions\.parquet: run table format version '4', expected 3"):
        read_sessions(tmp_path)


def test_pass_at_k_matches_the_codex_paper_estimator():
    # 1 - prod_{i=n-c+1}^{n} (1 - k / i), the paper's numerically stable form.
    for n, c, k in [(10, 3, 1), (10, 3, 5), (20, 1, 10), (5, 0, 2), (5, 5, 5), (200, 17, 100)]:
        stable = 1.0 if n - c < k else 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
        assert report.pass_at_k(n, c, k) == pytest.approx(stable, rel=1e-12)
    assert report.pass_at_k(4, 1, 1) == 0.25
    assert report.pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)
    with pytest.raises(ValueError, match="k <= n"):
        report.pass_at_k(2, 1, 3)


def rewards_table(results: dict[tuple[str, str], list[bool]]) -> pl.DataFrame:
    """(harness, task) -> resolved per sample."""
    return pl.DataFrame(
        [
            {
                "session_id": f"{h}-{t}-{i}",
                "task_id": t,
                "sample_id": i,
                "harness": h,
                "reward": float(ok),
                "resolved": ok,
                "reason": "graded",
                "report": None,
            }
            for (h, t), oks in results.items()
            for i, ok in enumerate(oks)
        ],
        schema=REWARDS_SCHEMA,
    )


def test_report_pass_at_k_per_task_and_overall_by_harness(tmp_path, capsys):
    write_rewards(
        rewards_table(
            {
                ("mini", "t1"): [True, False, False, False],  # c=1, n=4: pass@1 0.25, pass@2 0.5, pass@4 1
                ("mini", "t2"): [False, False, False, False],  # 0, 0, 0
                ("pi", "t1"): [True, True, False, False],  # 0.5, 5/6, 1
                ("pi", "t2"): [True, False],  # n=2: 0.5, 1, no pass@4
            }
        ),
        tmp_path / "run",
    )
    assert report.main(report.Args((tmp_path / "run",), k=(1, 2, 4, 16))) == 0

    numbers = json.loads((tmp_path / "run" / "report.json").read_text())
    per_task = {
        (r["harness"], r["task_id"]): (r["n"], r["c"], r["pass@1"], r["pass@2"], r["pass@4"])
        for r in numbers["per_task"]
    }
    assert per_task == {
        ("mini", "t1"): (4, 1, 0.25, 0.5, 1.0),
        ("mini", "t2"): (4, 0, 0.0, 0.0, 0.0),
        ("pi", "t1"): (4, 2, 0.5, pytest.approx(5 / 6), 1.0),
        ("pi", "t2"): (2, 1, 0.5, 1.0, None),
    }
    overall = {r["harness"]: r for r in numbers["overall"]}
    assert (overall["mini"]["pass@1"], overall["mini"]["pass@2"], overall["mini"]["pass@4"]) == (0.125, 0.25, 0.5)
    assert overall["pi"]["pass@1"] == 0.5 and overall["pi"]["pass@2"] == pytest.approx(11 / 12)
    assert overall["pi"]["pass@4"] == 1.0  # only t1 has 4 samples
    assert (overall["pi"]["tasks"], overall["pi"]["samples"], overall["pi"]["resolved"]) == (2, 6, 3)
    assert "pass@16" not in numbers["overall"][0]  # no task has 16 samples

    svg = ElementTree.parse(tmp_path / "run" / "report.svg").getroot()
    titles = [title.text for title in svg.iter(f"{SVG}title")]  # one per bar
    assert titles == [
        "mini pass@1 = 0.125", "pi pass@1 = 0.500", "mini pass@2 = 0.250", "pi pass@2 = 0.917",
        "mini pass@4 = 0.500", "pi pass@4 = 1.000",
    ]  # fmt: skip
    out = capsys.readouterr().out
    assert "pass@k per task" in out and "report.svg" in out


def test_report_pools_runs_and_counts_ungraded_sessions(tmp_path, capsys):
    run_tables(tmp_path / "a", sessions=[("s1", "t1", 0), ("s2", "t1", 1)], rewards=[("s1", "t1", 0, 1.0)])
    run_tables(tmp_path / "b", sessions=[("s3", "t1", 0)], rewards=[("s3", "t1", 0, 0.0)])
    report.main(report.Args((tmp_path / "a", tmp_path / "b"), plot=tmp_path / "chart.svg"))
    numbers = json.loads((tmp_path / "a" / "report.json").read_text())
    assert [(r["harness"], r["n"], r["c"], r["pass@1"]) for r in numbers["per_task"]] == [("mini", 2, 1, 0.5)]
    assert (tmp_path / "chart.svg").exists()
    out = capsys.readouterr().out
    assert "1 sessions have no row in rewards.parquet" in out
    assert "2 run folders pooled" in out and f"report {tmp_path / 'a'} --against {tmp_path / 'b'}" in out


def test_report_onto_a_folder_with_another_report_keeps_it_and_writes_a_numbered_one(tmp_path, capsys):
    """Issue 37: a report already in the folder is kept; the same report again is not written twice."""
    run = tmp_path / "run"
    write_rewards(rewards_table({("mini", "t1"): [True, False]}), run)
    report.main(report.Args((run,)))
    first = {name: (run / name).read_bytes() for name in ("report.json", "report.svg")}
    report.main(report.Args((run,)))  # the same numbers: nothing new to keep
    assert sorted(p.name for p in run.glob("report*")) == ["report.json", "report.svg"]

    write_rewards(rewards_table({("mini", "t1"): [True, True]}), run)  # graded again: other numbers
    capsys.readouterr()
    report.main(report.Args((run,)))
    assert {name: (run / name).read_bytes() for name in first} == first
    assert json.loads((run / "report-1.json").read_text())["overall"][0]["pass@1"] == 1.0
    assert ElementTree.parse(run / "report-1.svg").getroot().tag == f"{SVG}svg"
    out = capsys.readouterr().out
    assert f"numbers: {run / 'report-1.json'}" in out and f"kept the earlier report ({run / 'report.json'}" in out


def test_report_against_another_run_pairs_the_tasks_and_tests_the_difference(tmp_path, capsys):
    def graded(folder: str, outcomes: dict[str, list[bool]]) -> None:
        rows = [(f"{folder}-{t}-{i}", t, i, float(ok)) for t, oks in outcomes.items() for i, ok in enumerate(oks)]
        run_tables(tmp_path / folder, [(s, t, i) for s, t, i, _ in rows], rows)

    # 12 tasks that both runs measured, 10 of them better after, 2 alike; one task in each run only.
    before = {f"t{i:02d}": [False, False] for i in range(10)} | {"t10": [True, True], "t11": [False, False]}
    after = {f"t{i:02d}": [True, False] for i in range(10)} | {"t10": [True, True], "t11": [False, False]}
    graded("sft", {**before, "gone": [True]})
    graded("grpo", {**after, "new": [False]})
    assert report.main(report.Args((tmp_path / "grpo",), against=tmp_path / "sft")) == 0

    paired = json.loads((tmp_path / "grpo" / "report.json").read_text())["paired"]
    assert paired["against"] == str(tmp_path / "sft") and paired["tasks"] == 12 and paired["differing"] == 10
    assert (paired["only_before"], paired["only_after"]) == (["gone"], ["new"])
    assert paired["delta"] == pytest.approx(10 * 0.5 / 12, abs=1e-4)
    assert paired["p_value"] == pytest.approx(2 / 2**10) and paired["method"] == "exact"  # all 10 signs alike
    assert paired["fisher_p"] == pytest.approx(report_fisher(12, 24, 2, 24)) and paired["fisher_p"] > paired["p_value"]
    assert paired["ci95"][0] > 0 and {r["task_id"]: r["difference"] for r in paired["per_task"]}["t00"] == 0.5
    out = capsys.readouterr().out
    assert "paired, per task" in out and "sign-flip test p = 0.00195 (exact)" in out and "only in" in out


def report_fisher(a: int, n_a: int, b: int, n_b: int) -> float:
    from eval.stats import fisher_exact

    return fisher_exact(a, n_a, b, n_b)
