"""``python -m eval SUBCOMMAND ...``: roll out harnesses on tasks through the proxy, grade, join, report.

Each subcommand lives in its own module with an ``Args`` dataclass and a ``main(args)``; ``python -m eval
SUBCOMMAND --help`` shows its options. Modules are imported on use, so ``--help`` stays fast.
"""

from __future__ import annotations

import importlib
import sys

import tyro

SUBCOMMANDS = {
    "rollout": ("eval.rollout", "run harnesses on tasks x samples through the proxy; write sessions.parquet"),
    "score": ("eval.score", "grade a run's patches (or a predictions file) with swebench; write rewards.parquet"),
    "join": ("eval.join", "fill task ids, samples and rewards into a trajectories Parquet"),
    "report": ("eval.report", "pass@1 / pass@k per task and harness, with a plot"),
    "serve-rollouts": ("eval.rollout_service", "HTTP service: submit a task x N samples; get patches, rewards, traces"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:<{width}}  {summary}" for name, (_, summary) in SUBCOMMANDS.items()]
    return "usage: python -m eval SUBCOMMAND [--help] ...\n\nsubcommands:\n" + "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"python -m eval: unknown subcommand {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    args = tyro.cli(module.Args, args=rest, prog=f"python -m eval {name}", description=module.__doc__)
    try:
        return module.main(args) or 0
    except (ValueError, OSError) as e:  # bad input (a task file, a run folder): the message names it
        print(f"python -m eval {name}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
