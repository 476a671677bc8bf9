"""eval.harness.mini's command runner, and the agent failing cleanly without a model. Its scripted sessions through
the real proxy and reference server (tool errors, exit codes, reasoning sent back) run in tests/eval/test_rollout.py,
as rollouts."""

import time

import pytest

from eval.harness.mini import Args, run_command
from eval.harness.presets import run_harness


def test_run_command_reports_exit_code_cuts_long_output_and_kills_at_the_timeout(tmp_path):
    assert run_command("echo hi; exit 3", tmp_path, 10, 100) == "exit code: 3\nhi\n"
    long = run_command("yes x | head -c 5000", tmp_path, 10, 100)
    assert long.startswith("exit code: 0\nx\nx") and "[... 4900 characters cut ...]" in long
    started = time.monotonic()
    # A background child holding the output open must die with the command.
    hung = run_command("sleep 30 & sleep 30", tmp_path, 1, 100)
    assert hung.startswith("killed after 1 s (timeout)")
    assert time.monotonic() - started < 10


@pytest.mark.slow
def test_mini_exits_1_when_the_model_is_unreachable(tmp_path):
    run = run_harness("mini", "anything", workspace=tmp_path, base_url="http://127.0.0.1:9", session_id="s", timeout=60)
    assert run.exit_code == 1
    assert "mini: model call 1 failed" in run.stderr


def test_args_refuse_a_missing_workspace(tmp_path):
    with pytest.raises(ValueError, match="is not a folder"):
        Args(base_url="http://x/v1", api_key="s", model="m", workspace=tmp_path / "nope", prompt_file=tmp_path / "p")
