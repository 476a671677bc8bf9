"""Old name of ``python -m eval models`` (eval/upstream/models.py),
kept so that ``python -m eval.models`` still works."""

import sys

from eval.__main__ import moved

if __name__ == "__main__":
    sys.exit(moved("eval.models", "models"))
