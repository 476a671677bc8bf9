"""Old name of ``python -m eval demo-report`` (eval/demo/report.py),
kept so that ``python -m eval.demo_report`` still works."""

import sys

from eval.__main__ import moved

if __name__ == "__main__":
    sys.exit(moved("eval.demo_report", "demo-report"))
