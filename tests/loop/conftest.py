"""The loop tier: a whole demo killed with SIGKILL mid-phase, then resumed, against an uninterrupted one.

Run by ``make test-loop``, which sets ``POLAR_TEST_LOOP=1``; without that variable this folder is not collected, so
``make test`` (whose 8 minutes it would stretch by three) never runs it. With it, nothing here skips.
"""

import os

if os.environ.get("POLAR_TEST_LOOP") != "1":
    collect_ignore_glob = ["test_*.py"]
