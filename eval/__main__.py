"""``python -m eval VERB ...``: every eval command, from the rollout pipeline to the demo.

Each verb lives in its own module with an ``Args`` type (a dataclass, or a union of them for sub-verbs) and a
``main(args)``; ``python -m eval VERB --help`` shows its options. Modules are imported on use, so ``--help`` stays
fast. A command's own errors (:class:`eval.errors.EvalError`: a bad option, task file or run folder; a proxy that
does not record; npm missing) print as one line; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
import sys

import tyro

from eval.errors import EvalError
from eval.harness.install import NpmMissing
from eval.sessions.procs import ProxyNotRecording

VERBS = {
    # the pipeline
    "rollout": ("eval.sessions.rollout", "run harnesses on tasks x samples through the proxy; write sessions.parquet"),
    "score": ("eval.score", "grade a run's patches (or a predictions file) with swebench; write rewards.parquet"),
    "join": ("eval.join", "fill task ids, samples and rewards into a trajectories Parquet"),
    "report": ("eval.report", "pass@1 / pass@k per task and harness, with a plot"),
    "tasks": ("eval.tasks.cli", "the generated task family: list, validate with swebench, export as JSONL"),
    "images": ("eval.sessions.images", "the Docker images tasks run in: build (no registry needed), list, prune"),
    # the harnesses
    "harness": ("eval.harness.presets", "install the pinned harness CLIs; run one harness through the proxy"),
    "transparent": ("eval.harness.transparent", "run a harness on its provider's own URL through a regular proxy"),
    "mini": ("eval.harness.mini", "the small built-in bash-tool agent (the mini harness)"),
    # the reference upstream
    "serve": ("eval.upstream.server", "the reference server: an offline, vLLM-shaped chat server on transformers"),
    "models": ("eval.upstream.models", "build the offline models the reference server and the tests run on"),
    # around the loop
    "serve-rollouts": ("eval.service.app", "HTTP service: submit a task x N samples; get patches, rewards, traces"),
    "loop": ("eval.loop.run", "the RL loop from one config (presets: cpu, the demo; gpu): rounds measured, resumable"),
    "loop-report": ("eval.loop.report", "recount a loop run's summary.json, report.html and TensorBoard scalars"),
}
ERRORS = (EvalError, ProxyNotRecording, NpmMissing)  # what the user can fix; the message names it


def usage() -> str:
    width = max(map(len, VERBS))
    lines = [f"  {name:<{width}}  {summary}" for name, (_, summary) in VERBS.items()]
    return "usage: python -m eval VERB [--help] ...\n\nverbs:\n" + "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in VERBS:
        print(f"python -m eval: unknown verb {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(VERBS[name][0])
    args = tyro.cli(module.Args, args=rest, prog=f"python -m eval {name}", description=module.__doc__)
    try:
        return module.main(args) or 0
    except ERRORS as e:
        print(f"python -m eval {name}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
