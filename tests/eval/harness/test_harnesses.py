"""The real harness CLIs, each through `mitmdump` + the addon to the scripted reference server: a shell tool call
that writes a file, then a final answer; every model call recorded with token ids.

    python -m pytest tests/eval/harness -m slow

The five harnesses run at the same time (each with its own server, since each needs its own tool name in the
script, and its own proxy): one after another they take over four minutes on two cores, mostly loading the
servers and prefilling 2-18 K-token prompts. Claude Code, Qwen Code and Gemini CLI keep only their shell tool:
their full tool lists overrun the tiny model's 32 K context or double the prefill time.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from eval.harness.presets import HarnessRun, run_harness
from eval.sessions.procs import Mitmdump, ReferenceServer
from tests.captures import v1_lines

pytestmark = pytest.mark.slow

PROMPT = "Create proof.txt holding the words 'written by the agent', using the shell."
COMMAND = "printf 'written by the agent' > proof.txt"
FINAL = "Done: proof.txt holds the words."
RUN_TIMEOUT = 240.0  # seconds per harness run, with all five sharing two cores


@dataclasses.dataclass(frozen=True)
class Case:
    api: str  # the wire API the harness speaks, as the addon records it
    tool: str  # its shell tool, as named in the tools it sends
    arguments: dict[str, Any]  # that tool's arguments in its own schema
    tools: tuple[str, ...] | None = None  # keep only these tools (None: all)
    context: int | None = None  # the server's context length (None: the tiny model's 32 K)


CASES = {
    "pi": Case("chat", "bash", {"command": COMMAND}),
    # Its own max_tokens, 32000 whatever the model, against a smaller context: the addon cuts it to fit (issue 15).
    "qwen-code": Case("chat", "run_shell_command", {"command": COMMAND}, ("run_shell_command",), 24576),
    "claude-code": Case("anthropic", "Bash", {"command": COMMAND, "description": "Write proof.txt"}, ("Bash",)),
    "codex": Case("responses", "exec_command", {"cmd": COMMAND}),
    "gemini": Case("google", "run_shell_command", {"command": COMMAND}, ("run_shell_command",)),
}


def script(case: Case) -> list[dict[str, Any]]:
    """Turn 1 a shell tool call, turn 2 the final answer, which the server repeats to any later side call."""
    call = {"name": case.tool, "arguments": case.arguments}
    return [
        {"reasoning": "A shell command writes the file.", "content": None, "tool_calls": [call]},
        {"content": FINAL, "tool_calls": []},
    ]


@dataclasses.dataclass
class RoundTrip:
    run: HarnessRun
    workspace: Path
    records: list[dict[str, Any]]  # the session's records, in order
    upstream_statuses: list[int]  # status of each request the reference server answered, in order
    logs: Path

    def explain(self) -> str:
        return (
            f"exit {self.run.exit_code}, timed out {self.run.timed_out}, {self.run.duration_s} s\n"
            f"stdout: {self.run.stdout[-2000:]}\nstderr: {self.run.stderr[-2000:]}\nlogs: {self.logs}"
        )


def round_trip(harness: str, case: Case, *, model_dir: Path, bin_dir: Path, tmp: Path) -> RoundTrip:
    (tmp / "script.json").write_text(json.dumps(script(case)))
    workspace = tmp / "workspace"
    workspace.mkdir()
    session = f"harness-{harness}"
    with (
        ReferenceServer(
            model_dir, script=tmp / "script.json", log=tmp / "server.log", max_model_len=case.context
        ) as server,
        Mitmdump(server.url, tmp / "captures", log=tmp / "mitmdump.log", polar_model="tiny") as proxy,
    ):
        run = run_harness(
            harness,
            PROMPT,
            workspace=workspace,
            base_url=proxy.url,
            session_id=session,
            timeout=RUN_TIMEOUT,
            tools=case.tools,
            home=tmp / "home",
            bin_dir=bin_dir,
        )
    # Both services have stopped: mitmdump flushed every record on SIGTERM.
    records = [record for line in v1_lines(tmp / "captures") if (record := json.loads(line))["session_id"] == session]
    served = re.findall(r'"POST /v1/chat/completions HTTP/1.1" (\d+)', (tmp / "server.log").read_text())
    return RoundTrip(run, workspace, sorted(records, key=lambda r: r["t_start"]), [int(s) for s in served], tmp)


@pytest.fixture(scope="module")
def round_trips(request, harness_bin, tiny_model_dir, tmp_path_factory) -> Iterator[dict[str, Future[RoundTrip]]]:
    """Starts the round trip of every harness this session selected, all at once; each test waits for its own."""
    selected = [
        item.callspec.params["harness"]
        for item in request.session.items
        if item.module is request.module and "harness" in getattr(getattr(item, "callspec", None), "params", {})
    ]
    with ThreadPoolExecutor(max_workers=len(selected)) as pool:
        yield {
            harness: pool.submit(
                round_trip,
                harness,
                CASES[harness],
                model_dir=tiny_model_dir,
                bin_dir=harness_bin,
                tmp=tmp_path_factory.mktemp(harness),
            )
            for harness in dict.fromkeys(selected)
        }


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def token_ids(record: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) from the upstream's Chat Completions answer, streamed or not. Translated
    records hold that answer too: ``response_body`` is what the upstream sent, before translation."""
    body = record["response_body"]
    if not record["streamed"]:
        answer = json.loads(body)
        return answer["prompt_token_ids"], answer["choices"][0]["token_ids"]
    events = [json.loads(block[6:]) for block in body.split("\n\n") if block.startswith("data: {")]
    completion = [i for e in events for c in e["choices"] for i in c.get("token_ids") or []]
    return events[0]["prompt_token_ids"], completion


@pytest.mark.timeout(2 * RUN_TIMEOUT + 120)  # the first test also waits for the CLIs' install and the servers
@pytest.mark.parametrize("harness", list(CASES))
def test_scripted_round_trip(harness, round_trips, tokenizer):
    case = CASES[harness]
    trip = round_trips[harness].result()
    assert trip.run.exit_code == 0, trip.explain()
    proof = trip.workspace / "proof.txt"
    assert proof.exists(), trip.explain()
    assert proof.read_text() == "written by the agent"

    records = trip.records
    assert records, trip.explain()
    assert all(r["api"] == case.api and r["session_source"] == "api_key" for r in records)
    assert all(r["complete"] and r["error"] is None for r in records), [r["error"] for r in records]
    # Every call that reached the upstream has its record, with the status the upstream gave it; a call the
    # harness retries (Claude Code shrinks max_tokens after a context-length 400) is a call of its own.
    forwarded = [r for r in records if r["api"] == "chat" or r["upstream_request"] is not None]
    assert [r["status"] for r in forwarded] == trip.upstream_statuses
    if case.context is not None:  # every call asked more than the context and was cut to it, never refused
        assert all(r["clamped"]["sent"] == case.context < r["clamped"]["asked"] for r in forwarded), trip.explain()

    answered = [token_ids(r) for r in forwarded if r["status"] == 200]
    assert all(prompt and completion for prompt, completion in answered)
    texts = [tokenizer.decode(completion, skip_special_tokens=True) for _, completion in answered]
    # Turn 1 (the tool call), then turn 2 (the final answer), each with the ids the model produced.
    call = next((i for i, text in enumerate(texts) if case.tool in text and json.dumps(COMMAND)[1:-1] in text), None)
    assert call is not None, texts
    final = next((i for i in range(call + 1, len(texts)) if texts[i].strip() == FINAL), None)
    assert final is not None, texts
    # Token fidelity across the round trip: turn 2's prompt starts with turn 1's prompt and exactly the tokens
    # sampled in turn 1, reasoning included (for translated APIs it rides in the signature the addon minted).
    prompt, completion = answered[call]
    assert answered[final][0][: len(prompt) + len(completion)] == prompt + completion
