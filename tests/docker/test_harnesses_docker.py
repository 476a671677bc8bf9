"""Every harness preset in its task's container: ``python -m eval rollout --runtime docker`` on one generated task,
through a real mitmdump + addon that checks signed keys, to the scripted reference server.

    POLAR_TEST_DOCKER=1 python -m pytest tests/docker/test_harnesses_docker.py

The scripts and the Case table are tests/eval/harness/test_harnesses.py's: turn 1 the harness's own shell tool
writes proof.txt in the workspace, turn 2 the final answer. Each harness gets its own server and proxy (its own
tool name in the script, its own context length) and all seven run at the same time, as there (about a minute on
two cores). Each session must end ``ok`` with a patch adding proof.txt and nothing else, every model call recorded
under its session id with token ids, no key refused, and no container left with its session's or its run's label
(the daemon may be running other tests' containers meanwhile).

``shell`` runs the ``mini`` agent by path with the host's interpreter, which the docker runtime binds at its own
path; mini.py comes in as the command's file, with ``--mounts`` (bound read-only at its own path).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from eval.harness.install import install
from eval.harness.presets import MINI, PRESETS
from eval.runs import read_sessions
from eval.sessions import rollout
from eval.sessions.containers import docker
from eval.sessions.procs import Mitmdump, ReferenceServer, check_proxy, new_secret_file
from eval.sessions.runtime import RUN_LABEL, SESSION_LABEL
from tests.captures import v1_lines
from tests.docker.conftest import FAMILY_SPEC, FamilyImages
from tests.eval.harness.test_harnesses import CASES, COMMAND, FINAL, Case, script, token_ids

RUN_TIMEOUT = 420.0  # seconds per session: seven harnesses and their servers share two cores
PROOF = "proof.txt"

MINI_CASE = Case("chat", "bash", {"command": COMMAND})  # mini's one tool
HARNESS_CASES: dict[str, Case] = CASES | {"mini": MINI_CASE, "shell": MINI_CASE}


def shell_command() -> str:
    """mini by path: the host's interpreter and mini.py, both bound at their own paths."""
    run = f"{shlex.quote(sys.executable)} -P {shlex.quote(str(MINI))} --model tiny --workspace ."
    return run + ' --base-url "$OPENAI_BASE_URL" --api-key "$OPENAI_API_KEY" --prompt-file <(printf %s {instruction})'


@dataclasses.dataclass
class Session:
    row: dict[str, Any]  # the session's row of sessions.parquet
    records: list[dict[str, Any]]  # the proxy's records under the session id, oldest first
    upstream_statuses: list[int]  # the status of each request the reference server answered, in order
    health: dict[str, Any]  # the proxy's health after the run
    left: list[str]  # containers labelled with this session or its run after the rollout returned
    wall_s: float  # rollout.main, start to end
    tmp: Path

    def explain(self) -> str:
        logs = self.tmp / "run" / "logs" / self.row["session_id"]
        out = "\n".join(f"{p.name}: {p.read_text()[-2500:]}" for p in sorted(logs.glob("*.txt")))
        return (
            f"status {self.row['status']}, exit {self.row['exit_code']}, error {self.row['error']}\n{out}\n{self.tmp}"
        )


def run_session(
    harness: str, case: Case, task: dict[str, Any], *, model_dir: Path, tmp: Path, runtime: str = "docker"
) -> Session:
    """One ``python -m eval rollout --runtime RUNTIME`` session of ``harness`` on ``task`` against its own scripted
    server behind a mitmdump that takes only keys signed with its secret."""
    (tmp / "script.json").write_text(json.dumps(script(case)))
    secret = new_secret_file(tmp / "secret")
    with (
        ReferenceServer(
            model_dir, script=tmp / "script.json", log=tmp / "server.log", max_model_len=case.context
        ) as server,
        Mitmdump(
            server.url, tmp / "captures", log=tmp / "mitmdump.log", secret_file=secret, polar_model="tiny"
        ) as proxy,
    ):
        args = rollout.Args(
            tasks=FAMILY_SPEC,
            instance_ids=(task["instance_id"],),
            harness=harness,
            out=tmp / "run",
            proxy=proxy.url,
            runtime=runtime,
            session_secret=secret,
            tools=case.tools,
            command=shell_command() if harness == "shell" else None,
            mounts=(MINI,) if harness == "shell" else (),
            timeout=RUN_TIMEOUT,
        )
        start = time.monotonic()
        assert rollout.main(args) == 0
        wall = time.monotonic() - start
        row = read_sessions(tmp / "run").row(0, named=True)
        health = check_proxy(proxy.url)
    left = []
    if runtime == "docker":
        run_tag = row["session_id"].removesuffix(f"-{task['instance_id']}-0")
        for label in (f"{SESSION_LABEL}={row['session_id']}", f"{RUN_LABEL}={run_tag}"):
            left += docker("ps", "-aq", "--filter", f"label={label}").stdout.decode().split()
    # Both services have stopped: mitmdump flushed every record on SIGTERM.
    lines = v1_lines(tmp / "captures")  # type: ignore[no-untyped-call]
    records = [r for line in lines if (r := json.loads(line))["session_id"] == row["session_id"]]
    served = re.findall(r'"POST /v1/chat/completions HTTP/1.1" (\d+)', (tmp / "server.log").read_text())
    return Session(row, sorted(records, key=lambda r: r["t_start"]), [int(s) for s in served], health, left, wall, tmp)


@pytest.fixture(scope="module")
def sessions(
    request: pytest.FixtureRequest,
    family_images: FamilyImages,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Future[Session]]]:
    """Starts the session of every harness this run selected, all at once; each test waits for its own."""
    params = [
        getattr(getattr(item, "callspec", None), "params", {})
        for item in request.session.items
        if isinstance(item, pytest.Function) and item.module is request.module
    ]
    selected: list[str] = [p["harness"] for p in params if "harness" in p]
    if any(PRESETS[h].npm for h in selected):
        install()  # once, before the sessions: each would wait on the install lock anyway
    task = family_images[0]
    with ThreadPoolExecutor(max_workers=len(selected)) as pool:
        yield {
            harness: pool.submit(
                run_session,
                harness,
                HARNESS_CASES[harness],
                task,
                model_dir=tiny_model_dir,
                tmp=tmp_path_factory.mktemp(harness),
            )
            for harness in dict.fromkeys(selected)
        }


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_every_preset_has_a_case() -> None:
    assert set(HARNESS_CASES) == set(PRESETS)


@pytest.mark.timeout(2 * RUN_TIMEOUT + 300)  # the first test also waits for the images, the install and the servers
@pytest.mark.parametrize("harness", list(HARNESS_CASES))
def test_harness_session_in_docker(harness: str, sessions: dict[str, Future[Session]], tokenizer: Any) -> None:
    case = HARNESS_CASES[harness]
    s = sessions[harness].result()
    print(f"\n{harness}: harness {s.row['duration_s']} s, rollout {s.wall_s:.1f} s")
    assert (s.row["harness"], s.row["status"], s.row["exit_code"]) == (harness, "ok", 0), s.explain()
    patch = s.row["patch"]
    assert patch.startswith(f"diff --git a/{PROOF} b/{PROOF}\nnew file mode 100644"), patch
    assert patch.rstrip().endswith("+written by the agent\n\\ No newline at end of file"), patch
    assert len(re.findall(r"^diff --git ", patch, flags=re.M)) == 1, patch  # nothing of the harness's own
    assert s.left == [], "the session's container outlived the rollout"
    assert s.health["signed_keys"] is True and s.health["refused_keys"] == 0, s.health

    records = s.records
    assert records, s.explain()
    assert all(r["api"] == case.api and r["session_source"] == "api_key" for r in records)
    assert all(r["complete"] and r["error"] is None for r in records), [r["error"] for r in records]
    forwarded = [r for r in records if r["api"] == "chat" or r["upstream_request"] is not None]
    assert [r["status"] for r in forwarded] == s.upstream_statuses
    if case.context is not None:
        assert all(r["clamped"]["sent"] == case.context < r["clamped"]["asked"] for r in forwarded), s.explain()
    answered = [token_ids(r) for r in forwarded if r["status"] == 200]
    assert all(prompt and completion for prompt, completion in answered)
    texts = [tokenizer.decode(completion, skip_special_tokens=True) for _, completion in answered]
    call = next((i for i, text in enumerate(texts) if case.tool in text and json.dumps(COMMAND)[1:-1] in text), None)
    assert call is not None, texts
    final = next((i for i in range(call + 1, len(texts)) if texts[i].strip() == FINAL), None)
    assert final is not None, texts
    prompt, completion = answered[call]
    assert answered[final][0][: len(prompt) + len(completion)] == prompt + completion
