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
