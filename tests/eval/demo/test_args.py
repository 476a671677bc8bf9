"""The demo's settings refuse what cannot run, before any model is built."""

import pytest

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
