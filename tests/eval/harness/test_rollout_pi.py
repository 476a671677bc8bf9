"""The real Pi CLI rolled out on a toy task and graded: python -m eval rollout --harness pi, then score, resolved.

    python -m pytest tests/eval/harness/test_rollout_pi.py -m slow

The scripted reference server answers Pi's first call with a bash tool call that applies the task's gold patch,
and the second with a final answer; the proxy records both under the session id the rollout gave Pi as its key.
"""

import pytest

import eval.score
from eval.runs import read_rewards, read_sessions
from eval.sessions import rollout
from eval.tasks.load import load_tasks
from tests.captures import read_records, scripted_proxy

pytestmark = pytest.mark.slow

FINAL = "The page count now includes the last, partial page."


@pytest.mark.timeout(300)
def test_pi_rollout_resolves_a_toy_task(harness_bin, tiny_model_dir, tmp_path):
    task = min(load_tasks("toy"), key=lambda t: len(t["patch"]))  # the fewest tokens for the server to stream
    apply_gold = f"git apply <<'EOF_GOLD'\n{task['patch']}EOF_GOLD"
    script = [
        {"content": None, "tool_calls": [{"name": "bash", "arguments": {"command": apply_gold}}]},
        {"content": FINAL, "tool_calls": []},
    ]
    run = tmp_path / "run"
    with scripted_proxy(tiny_model_dir, script, tmp_path) as proxy:
        args = rollout.Args(
            tasks="toy", instance_ids=(task["instance_id"],), harness="pi", proxy=proxy.url, out=run, timeout=240
        )
        assert rollout.main(args) == 0
        session = read_sessions(run).row(0, named=True)
        records = read_records(proxy.captures, session=session["session_id"], expect=2)

    assert (session["task_id"], session["harness"], session["status"]) == (task["instance_id"], "pi", "ok"), session
    assert session["patch"] == task["patch"]
    assert [(r["api"], r["session_source"], r["status"]) for r in records][:2] == [("chat", "api_key", 200)] * 2
    assert eval.score.main(eval.score.Args(run)) == 0
    reward = read_rewards(run).row(0, named=True)
    assert (reward["session_id"], reward["reward"], reward["resolved"], reward["reason"]) == (
        session["session_id"],
        1.0,
        True,
        "graded",
    )
