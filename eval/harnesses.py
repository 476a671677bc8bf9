"""Old name of ``python -m eval harness`` (eval/harness/presets.py),
kept so that ``python -m eval.harnesses`` still works."""

import sys

from eval.__main__ import moved

if __name__ == "__main__":
    sys.exit(moved("eval.harnesses", "harness"))
