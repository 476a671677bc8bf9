"""The loop's cpu preset through Pi as shipped (its own system prompt, tools and requests) on the tiny model, with the
scripted replies of tests/eval/loop/test_demo.py: every phase runs, SFT gets traces at Pi's prompt length, and the
reconstruction stats of each split show Pi's calls and prompt tokens."""

import json
import subprocess

import pytest

from tests.eval.loop.test_demo import (
    DEMO_TIMEOUT,
    HELDOUT_SAMPLES,
    OTHER_HELDOUT_SAMPLES,
    ROOT,
    SAMPLES,
    STAGES,
    demo_command,
)

pytestmark = pytest.mark.slow


@pytest.mark.timeout(DEMO_TIMEOUT)
def test_the_loop_runs_through_pi_and_its_stats_show_pis_prompts(harness_bin, tiny_model_dir, tmp_path):
    cmd = [*demo_command(tiny_model_dir, tmp_path), "--set", "harness=pi"]
    done = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (run,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["order"] == STAGES and summary["config"]["harness"] == "pi"

    # max_len followed the harness: Pi's traces are longer than mini's 1024 tokens, and SFT trained on them.
    (sft,) = [p for p in summary["phases"] if p["phase"] == "train sft"]
    assert "--max-len 3072" in sft["commands"][0]
    teacher = summary["stages"]["teacher"]
    assert (teacher["resolved"], teacher["graded"]) == (1, 1)
    assert teacher["prompt_tokens_mean"] > 1024 and summary["train"]["sft"]["sessions"] == 1

    for stage in STAGES:
        trained, heldout = summary["stages"][stage], summary["stages"][stage]["heldout"]
        assert (trained["resolved"], trained["graded"]) == (2, SAMPLES)
        assert (heldout["resolved"], heldout["graded"]) == (
            0,
            OTHER_HELDOUT_SAMPLES if stage == "base" else HELDOUT_SAMPLES,
        )
        for numbers in (trained, heldout):  # each split's reconstruction: Pi's system prompt opens every trace
            assert numbers["calls_in_traces"] <= numbers["calls_captured"]
            assert numbers["prompt_tokens_mean"] > 1024, (stage, numbers)
    report = (run / "report.html").read_text()
    assert "held-out: prompt tokens per trace, mean / max" in report
