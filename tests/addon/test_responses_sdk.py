"""The official `openai` SDK's Responses client through a real `mitmdump` + addon to the reference server.

The SDK's own stream parser must accept the translated events, the response it assembles must equal the
non-streamed answer, and the records must chain token by token across a reasoning + tool-call round trip.
"""

import json

import openai
import pytest

from addon import native
from tests.captures import read_records, scripted_proxy, tokens_of

pytestmark = pytest.mark.slow

THOUGHT = "The user wants a file; a shell command writes it."
SCRIPT = [
    {
        "reasoning": THOUGHT,
        "content": None,
        "tool_calls": [{"name": "exec_command", "arguments": {"cmd": "echo hi > out.txt"}}],
    },
    {"content": "Done: out.txt holds hi.", "tool_calls": []},
]
TOOLS = [
    {
        "type": "function",
        "name": "exec_command",
        "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
        "strict": False,
    },
    {"type": "web_search"},  # hosted: dropped on the way upstream
]
REQUEST = {
    "model": "gpt-5-codex",  # what the harness asks for; the proxy serves it with polar_model=tiny
    "instructions": "You are a coding agent.",
    "tools": TOOLS,
    "reasoning": {"summary": "auto"},
    "include": ["reasoning.encrypted_content"],
    "store": False,
    "temperature": 0,
}
FIRST_INPUT = [{"role": "user", "content": [{"type": "input_text", "text": "Write hi into out.txt."}]}]


@pytest.fixture(scope="module")
def proxy(tiny_model_dir, tmp_path_factory):
    with scripted_proxy(tiny_model_dir, SCRIPT, tmp_path_factory.mktemp("responses-sdk"), polar_model="tiny") as mitm:
        yield mitm


def client(proxy, session):
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=session, max_retries=0, timeout=60)


def call(c, *, stream, input):
    """One turn as a harness makes it: streamed through the SDK's own accumulator, or not."""
    if not stream:
        return c.responses.create(input=input, **REQUEST), None
    with c.responses.stream(input=input, **REQUEST) as events:
        kinds = [event.type for event in events]
        return events.get_final_response(), kinds


def two_turns(c, *, stream):
    """A tool call with reasoning, its output and the reasoning item sent back, then the final answer."""
    first, kinds = call(c, stream=stream, input=FIRST_INPUT)
    calls = [item for item in first.output if item.type == "function_call"]
    history = [*FIRST_INPUT, *(item.model_dump(exclude_none=True) for item in first.output)]
    history += [{"type": "function_call_output", "call_id": fc.call_id, "output": "(no output)"} for fc in calls]
    second, _ = call(c, stream=stream, input=history)
    return first, second, kinds


def comparable(response):
    """Ids are minted per response (and call ids per upstream answer); the rest must match. The SDK's stream
    helper also adds its ``parsed`` fields, which a plain create does not."""

    def strip(value):
        if isinstance(value, dict):
            return {
                k: strip(v)
                for k, v in value.items()
                if k not in ("id", "call_id", "created_at", "parsed", "parsed_arguments")
            }
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(response.model_dump(exclude_none=True))


def test_reasoning_and_tool_call_round_trip_streamed_equals_non_streamed(proxy):
    with client(proxy, "sess-resp-s") as s, client(proxy, "sess-resp-n") as n:
        streamed, plain = two_turns(s, stream=True), two_turns(n, stream=False)
    for s, n in zip(streamed[:2], plain[:2], strict=True):
        assert comparable(s) == comparable(n)

    first, second, kinds = streamed
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert {"response.reasoning_text.delta", "response.function_call_arguments.delta"} <= set(kinds)
    assert first.model == "gpt-5-codex" and first.status == "completed" and first.usage.output_tokens > 0
    reasoning, fc = first.output
    assert reasoning.type == "reasoning" and native.read_reasoning(reasoning.encrypted_content) == THOUGHT
    assert (
        fc.type == "function_call"
        and fc.name == "exec_command"
        and json.loads(fc.arguments) == {"cmd": "echo hi > out.txt"}
    )
    assert second.output_text == "Done: out.txt holds hi." and second.status == "completed"

    for session, stream in (("sess-resp-s", True), ("sess-resp-n", False)):
        records = read_records(proxy.captures, session=session, expect=2)
        assert [(r["api"], r["status"], r["complete"], r["streamed"]) for r in records] == [
            ("responses", 200, True, stream)
        ] * 2
        sent = [r["upstream_request"] for r in records]
        assert sent[0]["model"] == "tiny" and [t["function"]["name"] for t in sent[0]["tools"]] == ["exec_command"]
        # The reasoning item came back as encrypted_content and went upstream as the reasoning it encodes.
        assert sent[1]["messages"][2] == {
            "role": "assistant",
            "content": None,
            "reasoning": THOUGHT,
            "tool_calls": [
                {
                    "id": fc_id(records[0], stream),
                    "type": "function",
                    "function": {"name": "exec_command", "arguments": '{"cmd": "echo hi > out.txt"}'},
                }
            ],
        }
        (prompt0, ids0, logprobs0), (prompt1, ids1, _) = tokens_of(records[0]), tokens_of(records[1])
        assert len(ids0) == len(logprobs0) > 0 and ids1
        assert prompt1[: len(prompt0) + len(ids0)] == prompt0 + ids0  # turn 2 re-renders turn 1 as sampled


def fc_id(record, stream):
    """The tool-call id the upstream minted in a recorded answer."""
    if not stream:
        return json.loads(record["response_body"])["choices"][0]["message"]["tool_calls"][0]["id"]
    chunks = [json.loads(b[6:]) for b in record["response_body"].split("\n\n") if b.startswith("data: {")]
    return next(t["id"] for c in chunks for ch in c["choices"] for t in ch["delta"].get("tool_calls") or [])


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "non-streamed"])
def test_upstream_context_overflow_is_an_openai_error_that_makes_codex_compact(proxy, stream):
    with client(proxy, f"sess-resp-overflow-{stream}") as c, pytest.raises(openai.APIStatusError) as raised:
        # A history longer than the model's context: the upstream refuses, as vLLM does. (An output cap beyond it
        # the addon cuts to fit, tests/addon/test_clamp.py.)
        c.responses.create(input="overflow " * 40_000, max_output_tokens=16, stream=stream, **REQUEST)
    assert raised.value.status_code == 400
    assert (
        raised.value.body["code"] == "context_length_exceeded" and raised.value.body["type"] == "invalid_request_error"
    )
    assert "maximum context length" in raised.value.body["message"]


def test_server_state_is_refused_in_openai_shape(proxy):
    with client(proxy, "sess-resp-stateful") as c, pytest.raises(openai.BadRequestError) as raised:
        c.responses.create(input=FIRST_INPUT, previous_response_id="resp_123", **REQUEST)
    assert "keeps none" in raised.value.body["message"] and raised.value.body["type"] == "invalid_request_error"
