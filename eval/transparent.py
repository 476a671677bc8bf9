"""Old name of ``python -m eval transparent`` (eval/harness/transparent.py),
kept so that ``python -m eval.transparent`` still works."""

import sys

from eval.__main__ import moved

if __name__ == "__main__":
    sys.exit(moved("eval.transparent", "transparent"))
