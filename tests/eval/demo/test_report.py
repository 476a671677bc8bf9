"""The demo's note says what its numbers can and cannot show."""

from eval.demo import report


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
