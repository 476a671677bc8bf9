"""Gym's interpreter for the tests, and whether the Gym tier requires it.

``make test-gym`` builds the Python 3.13 root filesystem with nemo-gym (``python -m eval.nemo_gym.gym_root``,
which writes tests/.cache/gymvenv/bin/python) and sets ``POLAR_GYM=1``: a Gym test that finds no working
interpreter then fails, saying so, instead of skipping. In ``make test`` such a test runs when the interpreter is
there and skips, saying how to make it, when it is not.
"""

import os
import subprocess
from pathlib import Path

import pytest

from eval.nemo_gym.gym_root import GYM_BIN

REQUIRED = os.environ.get("POLAR_GYM") == "1"
HOW_TO_MAKE = "sudo .venv/bin/python -m eval.nemo_gym.gym_root (make test-gym runs it; about 2 minutes)"


def gym_python() -> Path | None:
    """tests/.cache/gymvenv's interpreter when nemo-gym imports in it, else None (a failure where REQUIRED)."""
    python = GYM_BIN / "python"
    if python.exists():
        done = subprocess.run([python, "-c", "import nemo_gym"], capture_output=True, text=True, timeout=120)
        if done.returncode == 0:
            return python
        why = f"{python} cannot import nemo_gym: {done.stderr[-2000:]}"
    else:
        why = f"no {python}"
    if REQUIRED:
        pytest.fail(f"POLAR_GYM=1 (make test-gym) and {why}; make it with: {HOW_TO_MAKE}")
    return None


def require_gym_python() -> Path:
    """gym_python(), skipping (outside the Gym tier) where there is none."""
    python = gym_python()
    if python is None:
        pytest.skip(f"no nemo-gym interpreter, so Gym's own code is not run; make it with: {HOW_TO_MAKE}")
    return python
