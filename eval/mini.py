"""Old name of ``python -m eval mini`` (eval/harness/mini.py),
kept so that ``python -m eval.mini`` still works."""

import sys

from eval.__main__ import moved

if __name__ == "__main__":
    sys.exit(moved("eval.mini", "mini"))
