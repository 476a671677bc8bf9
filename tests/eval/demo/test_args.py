"""The demo's settings refuse what cannot run, before any model is built."""

import pytest

from eval import taskgen
from eval.demo.loop import Args


def test_a_script_replays_through_the_reference_server_only(tmp_path):
    python = tmp_path / "python"
    python.touch()
    with pytest.raises(ValueError, match="--script replays through the reference server"):
        Args(upstream="vllm", vllm_python=python, script=tmp_path / "script.json")


def test_vllm_needs_its_venv(tmp_path):
    with pytest.raises(ValueError, match="make demo UPSTREAM=vllm builds it"):
        Args(upstream="vllm", vllm_python=tmp_path / "missing" / "python")
    assert Args(upstream="reference", vllm_python=tmp_path / "missing" / "python").upstream == "reference"


def test_by_default_it_teaches_and_trains_on_the_training_split_and_measures_the_held_out_one():
    args = Args()
    teach, tasks, heldout = set(args.teach), set(args.tasks), set(args.heldout)
    assert (len(teach), len(tasks), len(heldout)) == (64, 16, 64) and not teach & tasks
    assert {taskgen.instance_split(i) for i in teach | tasks} == {"train"}
    assert {taskgen.instance_split(i) for i in heldout} == {"heldout"}
    assert len(Args(heldout_sessions=64, heldout_samples=2).heldout) == 32


def test_a_generated_training_task_cannot_be_held_out():
    unused = taskgen.generate(0)["train"][100]["instance_id"]  # neither taught nor trained on by default
    with pytest.raises(ValueError, match=r"--heldout polar-gen__.*: a generated task of the other split"):
        Args(heldout=(unused,))


def test_max_len_follows_the_harness_unless_given():
    assert Args(harness="mini").trace_tokens == 1024
    assert Args(harness="pi").trace_tokens == 3072
    assert Args(harness="pi", max_len=2048).trace_tokens == 2048
