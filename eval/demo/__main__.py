"""``python -m eval.demo ...``, the demo's first name: the same as ``python -m eval demo ...`` (eval/demo/loop.py)."""

import sys

from eval.__main__ import main

sys.exit(main(["demo", *sys.argv[1:]]))
