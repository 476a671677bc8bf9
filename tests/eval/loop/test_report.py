"""The demo's note says what its numbers can and cannot show."""

from eval.loop import report


def numbers(timed_out: int) -> dict:
    def stage(name: str, resolved: int) -> dict:
        statuses = {"ok": 32 - timed_out, "timeout": timed_out} if timed_out else {"ok": 32}
        return {
            "stage": name,
            "graded": 32,
            "resolved": resolved,
            "pass_rate": resolved / 32,
            "ci95": report.wilson(resolved, 32),
            "statuses": statuses,
        }

    before, after = stage("base", 0), stage("sft", 12)
    return {
        "stages": {"base": before, "sft": after},
        "order": ["base", "sft"],
        "tests": [report.compare(before, after, "SFT")],
        "train": {},
    }


def test_the_note_flags_sessions_killed_at_the_timeout():
    assert "session timeout" not in report.note(numbers(timed_out=0))
    note = report.note(numbers(timed_out=7))
    assert "killed at the session timeout, counted as failures: base 7, sft 7" in note
    assert "--session-timeout" in note


def test_newcombes_interval_matches_the_published_example():
    # Newcombe (1998), Statistics in Medicine 17:873, table II, example (a): 56/70 against 48/80.
    lo, hi = report.newcombe(56, 70, 48, 80)
    assert (round(lo, 4), round(hi, 4)) == (0.0524, 0.3339)
    lo, hi = report.newcombe(0, 64, 0, 64)  # no success on either side: the interval still has width
    assert lo < 0 < hi


def test_held_out_gains_are_tested_apart_from_the_trained_tasks():
    base, sft = numbers(timed_out=0)["stages"].values()
    test = report.compare(
        {**base, "resolved": 3, "pass_rate": 3 / 32}, {**sft, "resolved": 15, "pass_rate": 15 / 32}, "SFT", "held-out"
    )
    assert test["split"] == "held-out" and test["p_value"] < 0.05 and test["ci95_delta"][0] > 0
    rows = report.verdict_rows({"tests": [test], "train": {}})
    assert rows[0][0].startswith("held-out tasks: SFT") and "[+" in rows[0][1]


def test_stages_with_per_task_counts_are_compared_task_by_task_with_fisher_beside():
    tasks = [f"t{i}" for i in range(20)]
    before = {t: [0, 1] for t in tasks}
    after = {t: [1 if i < 8 else 0, 1] for i, t in enumerate(tasks)}  # 8 tasks gained, none lost

    def stage(name: str, counts: dict[str, list[int]]) -> dict:
        resolved = sum(c for c, _ in counts.values())
        return {"stage": name, "graded": 20, "resolved": resolved, "pass_rate": resolved / 20,
                "per_task_counts": counts}  # fmt: skip

    test = report.compare(stage("sft", before), stage("grpo3", after), "GRPO's own gain", "held-out")
    assert test["test"] == "paired" and test["p_value"] == 2 / 2**8  # McNemar's exact p: 8 discordant, all gains
    assert test["fisher_p"] == report.fisher_exact(8, 20, 0, 20) and test["paired"]["tasks"] == 20
    assert test["verdict"] == "improved (paired p = 0.0078, Fisher p = 0.0033)"
    assert test["ci95_delta"][0] > 0 and test["delta"] == 0.4
    rows = report.verdict_rows({"tests": [test], "train": {}})
    assert "20 tasks paired (8 differ)" in rows[0][1]


def test_a_round_with_dynamic_sampling_says_what_it_drew():
    record = {"groups_asked": 16, "max_draws": 64, "pool": 64, "draws": 48, "sessions": 192, "informative": 11,
              "kept": [f"t{i}" for i in range(11)], "reached": False, "pool_pass_rate": 0.2344,
              "batches": [{"folder": "sft", "tasks": [], "informative": 4}] * 3}  # fmt: skip
    train = {"grpo1": {"steps": 3, "groups": 11, "groups_with_signal": 11, "per_step": [], "sampling": record}}
    rows = report.verdict_rows({"tests": [], "train": train})
    assert rows[-1][0] == "dynamic sampling for grpo1"
    assert rows[-1][1] == (
        "11 informative groups in 48 tasks drawn (192 sessions, 3 batch(es), at most 64 of a pool of 64), pool pass "
        "rate 23%; trained on 11 of 16 groups asked (the draw limit came first)"
    )


def test_every_round_is_tested_against_the_stage_it_started_from_the_sft_stage_and_the_base_model():
    pairs = [p[:2] for p in report.compared(["base", "sft", "grpo1", "grpo2", "grpo3"])]
    assert pairs[:3] == [("base", "sft"), ("sft", "grpo3"), ("base", "grpo3")]  # the headline gains first
    assert sorted(pairs[3:]) == sorted(
        [
            ("sft", "grpo1"),
            ("base", "grpo1"),
            ("grpo1", "grpo2"),
            ("sft", "grpo2"),
            ("base", "grpo2"),
            ("grpo2", "grpo3"),
        ]
    )
    without_sft = [p[:2] for p in report.compared(["base", "grpo1", "grpo2"])]  # sft = "none": GRPO from the base
    assert without_sft == [("base", "grpo2"), ("base", "grpo1"), ("grpo1", "grpo2")]
