"""Old name of ``python -m eval serve-rollouts`` (eval/service/app.py),
kept so that ``python -m eval.rollout_service`` still works."""

import sys

from eval.__main__ import moved

if __name__ == "__main__":
    sys.exit(moved("eval.rollout_service", "serve-rollouts"))
