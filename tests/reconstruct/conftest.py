"""Real captures for the reconstruction tests, generated once per test run.

The reference server (python -m eval serve, ``--script`` mode: scripted answers teacher-forced through the tiny model,
so ids and log-probs are real) sits behind two real ``mitmdump`` processes with the capture addon: one asking for
vLLM token fields, one ``plain`` (records without ids). The official ``openai`` SDK plays the harnesses, one
session per scenario (the API key is the session id). ``Scenario`` names each session; ``oracle`` reads a
record's sampled tokens with a plain JSON parse, independently of the code under test.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import openai
import pytest

from eval.sessions.procs import Mitmdump, Service, free_port
from tests.captures import v1_lines

SCRIPT = [
    {
        "reasoning": "I should look at the folder first.",
        "content": None,
        "tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}],
    },
    {
        "reasoning": "notes.txt is there; read it.",
        "content": "Reading the file.",
        "tool_calls": [{"name": "bash", "arguments": {"command": "cat notes.txt"}}],
    },
    {"content": "notes.txt says the build is green — café ✓.", "tool_calls": []},
    {
        "reasoning": "Count the lines too.",
        "content": None,
        "tool_calls": [{"name": "bash", "arguments": {"command": "wc -l notes.txt"}}],
    },
    {"content": "It has 2 lines.", "tool_calls": []},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command and return its output.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
]
MAIN = "You are a coding agent. Use the bash tool."
SUB = "You are a sub-agent that inspects files for the main agent."
TASK = "What does notes.txt say?"


@dataclasses.dataclass(frozen=True)
class Scenario:
    """Session ids of the captured scenarios (all in ``vllm_dir`` except the plain ones)."""

    streamed: str = "tool-streamed"  # 3 calls: tool call, tool call, answer
    non_streamed: str = "tool-non-streamed"  # the same, not streamed, interleaved in time with the one above
    subagents: str = "subagents"  # main agent (2 calls) and sub-agent (3 calls) interleaved in one session
    compaction: str = "compaction"  # 2 calls, a summary call, then a rewritten history: 2 calls
    retry: str = "retry"  # a call, the identical call again (its answer is the one continued), then the answer
    no_reasoning: str = "no-reasoning"  # the client never sends reasoning back: the template re-renders turns
    max_tokens: str = "max-tokens"  # the first turn cut by max_tokens, "Continue.", then 2 more calls
    plain_streamed: str = "plain-streamed"  # like ``streamed``, through the plain proxy: no ids
    plain_non_streamed: str = "plain-non-streamed"


S = Scenario()


class Agent:
    """A minimal harness: keeps the conversation, runs the (fake) bash tool, sends the results back."""

    def __init__(
        self, client: openai.OpenAI, system: str, task: str, *, stream: bool, send_reasoning: bool = True
    ) -> None:
        self.client = client
        self.stream = stream
        self.send_reasoning = send_reasoning
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": task}]

    def ask(self, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        kwargs = {"model": "tiny", "messages": messages, "tools": TOOLS, "temperature": 0, **extra}
        if not self.stream:
            r = self.client.chat.completions.create(**kwargs)
            m = r.choices[0].message
            calls = [
                {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls or []
            ]
            return {"content": m.content, "reasoning": (m.model_extra or {}).get("reasoning"), "calls": calls}
        content, reasoning, calls = "", "", {}
        for chunk in self.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
            for choice in chunk.choices:
                d = choice.delta
                content += d.content or ""
                reasoning += (d.model_extra or {}).get("reasoning") or ""
                for c in d.tool_calls or []:
                    slot = calls.setdefault(c.index, {"id": "", "name": "", "arguments": ""})
                    slot["id"] += c.id or ""
                    slot["name"] += c.function.name or ""
                    slot["arguments"] += c.function.arguments or ""
        return {"content": content or None, "reasoning": reasoning or None, "calls": list(calls.values())}

    def step(self, **extra: Any) -> dict[str, Any]:
        result = self.ask(self.messages, **extra)
        self.take(result)
        return result

    def take(self, result: dict[str, Any]) -> None:
        message: dict[str, Any] = {"role": "assistant", "content": result["content"]}
        if self.send_reasoning and result["reasoning"]:
            message["reasoning"] = result["reasoning"]
        if result["calls"]:
            message["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in result["calls"]
            ]
        self.messages.append(message)
        for c in result["calls"]:
            output = f"(ran {json.loads(c['arguments'])['command']})"
            self.messages.append({"role": "tool", "tool_call_id": c["id"], "content": output})

    def run(self) -> None:
        while self.step()["calls"]:
            pass


def client(base_url: str, session: str) -> openai.OpenAI:
    """A client for one session; used in a ``with`` block, so its connections close before the tests run (an
    unclosed socket collected during a later test fails that test)."""
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=session, max_retries=0, timeout=60)


def _interleaved(vllm_url: str) -> None:
    with client(vllm_url, S.streamed) as ca, client(vllm_url, S.non_streamed) as cb:
        a, b = Agent(ca, MAIN, TASK, stream=True), Agent(cb, MAIN, TASK, stream=False)
        while True:  # two sessions interleaved call by call
            more_a, more_b = a.step()["calls"], b.step()["calls"]
            if not (more_a or more_b):
                break


def _subagents(vllm_url: str) -> None:
    with client(vllm_url, S.subagents) as c:
        main, sub = Agent(c, MAIN, TASK, stream=True), Agent(c, SUB, "Inspect notes.txt.", stream=False)
        main.step(), sub.step(), main.step(), sub.step(), sub.step()


def _compaction(vllm_url: str) -> None:
    with client(vllm_url, S.compaction) as c:
        agent = Agent(c, MAIN, TASK, stream=True)
        agent.step(), agent.step()
        summary = agent.ask([*agent.messages, {"role": "user", "content": "Summarize the work so far."}])["content"]
        fresh = Agent(c, MAIN, f"{TASK}\n\nSummary of earlier work: {summary}", stream=True)
        fresh.step(), fresh.step()


def _retry_and_max_tokens(vllm_url: str) -> None:
    with client(vllm_url, S.retry) as c:
        agent = Agent(c, MAIN, TASK, stream=False)
        agent.ask(agent.messages)  # timed out, as far as the harness knows: sent again
        agent.run()
    with client(vllm_url, S.max_tokens) as c:
        agent = Agent(c, MAIN, TASK, stream=False)
        agent.step(max_tokens=6)
        agent.messages.append({"role": "user", "content": "Continue."})
        agent.run()


def _no_reasoning(vllm_url: str) -> None:
    with client(vllm_url, S.no_reasoning) as c:
        Agent(c, MAIN, TASK, stream=True, send_reasoning=False).run()


def _plain(plain_url: str) -> None:
    with client(plain_url, S.plain_streamed) as c:
        Agent(c, MAIN, TASK, stream=True).run()
    with client(plain_url, S.plain_non_streamed) as c:
        Agent(c, MAIN, TASK, stream=False).run()


def _play(vllm_url: str, plain_url: str) -> None:
    """The scenarios, concurrently (sessions are independent; each keeps its own call order)."""
    groups = [_interleaved, _subagents, _compaction, _retry_and_max_tokens, _no_reasoning]
    with ThreadPoolExecutor(len(groups) + 1) as pool:
        futures = [pool.submit(g, vllm_url) for g in groups] + [pool.submit(_plain, plain_url)]
        for f in futures:
            f.result()


EXPECTED_CALLS = {
    S.streamed: 3, S.non_streamed: 3, S.subagents: 5, S.compaction: 5, S.retry: 3,
    S.no_reasoning: 3, S.max_tokens: 3, S.plain_streamed: 3, S.plain_non_streamed: 3,
}  # fmt: skip


def read_records(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in v1_lines(directory)]


@dataclasses.dataclass
class Captures:
    vllm_dir: Path
    plain_dir: Path
    model_dir: Path

    def records(self, session: str | None = None) -> list[dict[str, Any]]:
        found = read_records(self.vllm_dir) + read_records(self.plain_dir)
        return sorted((r for r in found if session in (None, r["session_id"])), key=lambda r: r["t_start"])


@pytest.fixture(scope="session")
def captures(tiny_model_dir: Path, run_once) -> Captures:
    folder = run_once("reconstruct-captures", lambda tmp: generate(tiny_model_dir, tmp))
    return Captures(folder / "vllm", folder / "plain", tiny_model_dir)


def generate(tiny_model_dir: Path, tmp: Path) -> Captures:
    """Play every scenario through the real proxies; the capture folders are under ``tmp``."""
    (tmp / "script.json").write_text(json.dumps(SCRIPT))
    out = Captures(tmp / "vllm", tmp / "plain", tiny_model_dir)
    # The three processes start at once (each takes seconds on a loaded machine): mitmdump dials its upstream
    # per request, so it can start before the server listens on the port chosen for it.
    port = free_port()
    serve = [sys.executable, "-m", "eval", "serve", "--model", str(tiny_model_dir), "--port", str(port)]
    serve += ["--host", "127.0.0.1", "--script", str(tmp / "script.json")]
    serve += ["--dtype", "float32"]  # the audits below compare served log-probs with an fp32 model to 1e-3
    upstream = f"http://127.0.0.1:{port}"
    with ThreadPoolExecutor(3) as pool:
        starting = [
            pool.submit(Service, serve, port=port, log=tmp / "server.log"),
            pool.submit(Mitmdump, upstream, out.vllm_dir, log=tmp / "mitm-vllm.log", polar_upstream="vllm"),
            pool.submit(Mitmdump, upstream, out.plain_dir, log=tmp / "mitm-plain.log", polar_upstream="plain"),
        ]
        wait(starting)
    services = [f.result() for f in starting if f.exception() is None]
    try:
        _, vllm, plain = (f.result() for f in starting)  # raises a failed start's error
        _play(vllm.url, plain.url)
        deadline = time.time() + 10  # records land just after each answer
        while time.time() < deadline and len(out.records()) < sum(EXPECTED_CALLS.values()):
            time.sleep(0.05)
    finally:
        for service in reversed(services):
            service.stop()  # mitmdump stops cleanly: every record is on disk
    found = {s: len(out.records(s)) for s in EXPECTED_CALLS}
    assert found == EXPECTED_CALLS, found
    return out


def oracle(record: dict[str, Any]) -> tuple[list[int], list[int], list[float]]:
    """(prompt ids, sampled ids, log-probs) of a vLLM-shaped record, by a plain JSON parse."""
    body = record["response_body"]
    if not record["streamed"]:
        r = json.loads(body)
        choice = r["choices"][0]
        return r["prompt_token_ids"], choice["token_ids"], [t["logprob"] for t in choice["logprobs"]["content"]]
    events = [json.loads(block[6:]) for block in body.split("\n\n") if block.startswith("data: {")]
    prompt = events[0]["prompt_token_ids"]
    ids = [i for e in events for c in e["choices"] for i in c.get("token_ids") or []]
    logprobs = [
        t["logprob"] for e in events for c in e["choices"] for t in (c.get("logprobs") or {}).get("content") or []
    ]
    return prompt, ids, logprobs
