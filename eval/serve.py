"""Old name of ``python -m eval serve`` (eval/upstream/server.py),
kept so that ``python -m eval.serve`` still works."""

import sys

from eval.__main__ import moved

if __name__ == "__main__":
    sys.exit(moved("eval.serve", "serve"))
