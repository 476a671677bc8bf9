"""Write the Gym agent's example inputs and their rollouts with the real pipeline, on CPU, in about a minute.

    .venv/bin/python -m eval.nemo_gym.make_examples [--out eval/nemo_gym/responses_api_agents/polar_swe_agent/data]

The tiny offline model (eval.upstream.models) serves a script (python -m eval serve --script) behind mitmdump +
addon/polar.py; the rollout service (eval/service/app.py) runs the ``mini`` harness on five toy tasks; each Gym row goes
through the same submission and verify-response code that app.py's /run uses (polar_gym.py). The scripted tool call
applies the gold patch on the first three tasks (reward 1) and writes a stray file on the other two (reward 0). Token
ids and log-probs are the model's own (teacher-forced), so tests can decode them with the same tokenizer, whose hash
goes into example_rollouts.meta.json with its chat template's (which renders the prompt ids; a file of its own,
chat_template.jinja, that tokenizer.json does not cover). Neither covers the harness's prompt: make test-gym
(tests/gym) runs these rows again and compares the ids.

It replaces no file (issue 37): if one of the three is already in --out it stops with exit status 2 naming it, before
any work, and one that appears meanwhile is left as it is, with the same error. To make the committed examples
again, remove them first.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import tyro

from eval.errors import EvalError
from eval.service.app import Args as ServiceArgs
from eval.service.app import serve
from eval.sessions.procs import Mitmdump, ReferenceServer, free_port
from eval.sessions.rollout import instruction
from eval.tasks.load import load_tasks
from eval.upstream.models import build_tiny
from reconstruct.files import write_atomic

AGENT = Path(__file__).resolve().parent / "responses_api_agents" / "polar_swe_agent"
sys.path.insert(0, str(AGENT))
from polar_gym import ServiceClient, submission, verify_response  # noqa: E402

N_EXAMPLES, N_RESOLVED = 5, 3
FILES = ("example.jsonl", "example_rollouts.jsonl", "example_rollouts.meta.json")


@dataclasses.dataclass
class Args:
    """Make data/example.jsonl and data/example_rollouts.jsonl again (into a folder that holds neither)."""

    out: Path = AGENT / "data"
    """Folder for example.jsonl, example_rollouts.jsonl and example_rollouts.meta.json."""


def script(tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One bash call that applies the gold patch on the first N_RESOLVED tasks (told apart by commit), then an
    answer."""
    arms = "".join(
        f"{t['base_commit']}) git apply <<'EOF_GOLD'\n{t['patch']}EOF_GOLD\n;;\n" for t in tasks[:N_RESOLVED]
    )
    command = f'case "$(git rev-parse HEAD)" in\n{arms}*) printf "looked at it\\n" > NOTES.txt\n;;\nesac'
    return [
        {
            "reasoning": "Apply the fix.",
            "content": None,
            "tool_calls": [{"name": "bash", "arguments": {"command": command}}],
        },
        {"content": "Done: the fix is in.", "tool_calls": []},
    ]


def row(task: dict[str, Any]) -> dict[str, Any]:
    """A Gym dataset row: the prompt the harness gets (for reading; the harness builds its own), the instance."""
    return {
        "responses_create_params": {
            "input": [{"role": "user", "content": instruction(task)}],
            "metadata": {"instance_id": task["instance_id"], "harness": "mini"},
        },
        "agent_ref": {"type": "responses_api_agents", "name": "polar_swe_agent"},
        "instance": task,
    }


def exists_error(path: Path) -> EvalError:
    return EvalError(f"{path} exists: remove it to make the examples again, or give --out a new folder")


def main(args: Args) -> int:
    for path in (args.out / name for name in FILES):
        if path.exists():  # before the minute of work, not after it
            raise exists_error(path)
    tasks = sorted(load_tasks("toy"), key=lambda t: len(t["patch"]))[:N_EXAMPLES]  # short patches: fast teacher forcing
    rows = [row(t) for t in tasks]
    with tempfile.TemporaryDirectory(prefix="polar-gym-examples-") as tmp_name:
        tmp = Path(tmp_name)
        model = build_tiny(tmp / "tiny")
        (tmp / "script.json").write_text(json.dumps(script(tasks)))
        with (
            ReferenceServer(model, script=tmp / "script.json", log=tmp / "server.log") as server,
            Mitmdump(server.url, tmp / "captures", log=tmp / "mitmdump.log") as proxy,
        ):
            service_args = ServiceArgs(proxy=proxy.url, captures=tmp / "captures", root=tmp / "jobs", port=free_port())
            http, _ = serve(service_args)
            threading.Thread(target=http.serve_forever, daemon=True).start()
            client = ServiceClient(f"http://127.0.0.1:{service_args.port}", poll_s=0.5)

            def rollout(i: int) -> dict[str, Any]:
                gym_row = rows[i] | {"_ng_task_index": i, "_ng_rollout_index": 0}  # what Gym's collection adds
                job = submission(gym_row, harness="mini", model="tiny", timeout=300)
                answer = verify_response(gym_row, client.run(job, deadline_s=900), model="tiny")
                answer["polar"]["trajectories"] = None  # a temporary path: meaningless once committed
                print(f"{tasks[i]['instance_id']}: reward {answer['reward']}, mask {answer['polar']['mask_reasons']}")
                return answer

            with ThreadPoolExecutor(service_args.workers) as pool:
                rollouts = list(pool.map(rollout, range(len(rows))))
            http.shutdown()
        tokenizer_sha = hashlib.sha256((model / "tokenizer.json").read_bytes()).hexdigest()
        template_sha = hashlib.sha256((model / "chat_template.jinja").read_bytes()).hexdigest()
    meta = {
        "model": "python -m eval models tiny",
        "tokenizer_sha256": tokenizer_sha,
        "chat_template_sha256": template_sha,
        "command": "python -m eval.nemo_gym.make_examples",
    }
    contents = [
        "".join(json.dumps(r) + "\n" for r in rows),
        "".join(json.dumps(r) + "\n" for r in rollouts),
        json.dumps(meta, indent=1) + "\n",
    ]
    for name, text in zip(FILES, contents, strict=True):
        try:
            write_atomic(args.out / name, text.encode(), replace=False)
        except FileExistsError as e:  # a file made there while the examples were being made
            raise exists_error(args.out / name) from e
    print(f"wrote {args.out}/example.jsonl, example_rollouts.jsonl, example_rollouts.meta.json")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(tyro.cli(Args, description=__doc__)))
    except EvalError as e:  # as python -m eval prints its commands' errors
        print(f"python -m eval.nemo_gym.make_examples: error: {e}", file=sys.stderr)
        sys.exit(2)
