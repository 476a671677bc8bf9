"""The Gym tier: NeMo Gym 0.7.0's own servers (``gym env start``) and rollout collection (``gym eval run``) against
the agent in eval/nemo_gym, in the Python 3.13 root filesystem ``python -m eval.nemo_gym.gym_root`` builds.

Run by ``make test-gym``, which builds it and sets ``POLAR_GYM=1``; without that variable this folder is not
collected, so ``make test`` never starts Gym. With it nothing in the tier skips: a missing interpreter fails
(tests/gym/helpers.py), and tests/conftest.py turns any other skip into a failure.
"""

import os
from pathlib import Path

import pytest

if os.environ.get("POLAR_GYM") != "1":
    collect_ignore_glob = ["test_*.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(item.path).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.timeout(900))  # Ray, Gym's server venvs, six rollouts on two CPUs
