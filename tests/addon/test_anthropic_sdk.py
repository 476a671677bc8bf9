"""The official `anthropic` SDK against a real `mitmdump` with the addon, the reference server behind it.

The addon translates each Messages call into Chat Completions; the SDK's own parsers (its stream
accumulator included) must take the answers as Anthropic's, and the records must keep token ids.
"""

import itertools
import re

import anthropic
import pytest

from addon import native
from tests.captures import read_records, scripted_proxy, tokens_of

pytestmark = pytest.mark.slow

MODEL = "claude-sonnet-4-5"  # what the harness asks for; the proxy asks the upstream for "tiny"
SCRIPT = [
    {
        "reasoning": "The user wants a file; a shell command writes it.",
        "content": None,
        "tool_calls": [{"name": "Bash", "arguments": {"command": "echo hi > out.txt"}}],
    },
    {"reasoning": "It ran.", "content": "Done: out.txt holds hi.", "tool_calls": []},
]
TOOLS = [
    {
        "name": "Bash",
        "description": "Run a shell command.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 2},  # a server tool: dropped
]
SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.a1f; cc_entrypoint=cli; cch=9f3e1;"},
    {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
]
RAW_EVENTS = {
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
}
FIRST_TURN = [{"role": "user", "content": [{"type": "text", "text": "Write hi into out.txt."}]}]


@pytest.fixture(scope="module")
def proxy(tiny_model_dir, tmp_path_factory):
    with scripted_proxy(tiny_model_dir, SCRIPT, tmp_path_factory.mktemp("anthropic_sdk"), polar_model="tiny") as mitm:
        yield mitm


def client(proxy, session):
    """The API key is the session id: the proxy files the calls under it, and the script advances per session."""
    return anthropic.Anthropic(base_url=proxy.url, api_key=session, max_retries=0, timeout=60)


def create(endpoint, *, stream, **kwargs):
    """One message, streamed (read to its end) or not; ``endpoint`` is ``c.messages`` or ``c.beta.messages`` (not
    named ``messages``: that is a field of the request in ``kwargs``)."""
    if stream:
        with endpoint.stream(**kwargs) as events:
            return events.get_final_message()
    return endpoint.create(**kwargs)


def two_turns(c, *, stream):
    """The scripted session, as Claude Code runs it (beta endpoint): a tool call with thinking, its result, an
    answer."""
    messages, answers = list(FIRST_TURN), []
    for _ in SCRIPT:
        kwargs = {
            "model": MODEL,
            "max_tokens": 200,
            "system": SYSTEM,
            "messages": messages,
            "tools": TOOLS,
            "thinking": {"type": "adaptive"},
            "metadata": {"user_id": "user_1"},
            "betas": ["interleaved-thinking-2025-05-14"],
        }
        message = create(c.beta.messages, stream=stream, **kwargs)
        answers.append(message)
        calls = [b for b in message.content if b.type == "tool_use"]
        result = [{"type": "tool_result", "tool_use_id": b.id, "content": "(no output)"} for b in calls]
        messages = [
            *messages,
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
        ]
        messages.append({"role": "user", "content": result or "ok"})
    return answers


def without_ids(message):
    """Message and tool-use ids come from the upstream's, which differ per call; all else must match
    (``parsed_output`` is the SDK's own addition to streamed text blocks)."""
    dumped = message.model_dump(exclude={"id"})
    dumped["content"] = [{k: v for k, v in b.items() if k not in ("id", "parsed_output")} for b in dumped["content"]]
    return dumped


def test_streamed_and_non_streamed_round_trips(proxy):
    with client(proxy, "sess-anthropic-s") as c:
        streamed = two_turns(c, stream=True)
    with client(proxy, "sess-anthropic-n") as c:
        buffered = two_turns(c, stream=False)
    assert [without_ids(m) for m in streamed] == [without_ids(m) for m in buffered]

    first, second = buffered
    thinking, call = first.content
    assert first.model == MODEL and first.stop_reason == "tool_use" and first.id.startswith("msg_")
    assert thinking.thinking == SCRIPT[0]["reasoning"] and thinking.signature == native.mint_reasoning(
        SCRIPT[0]["reasoning"]
    )
    assert call.name == "Bash" and call.input == {"command": "echo hi > out.txt"} and call.id.startswith("toolu_")
    assert second.stop_reason == "end_turn" and [b.type for b in second.content] == ["thinking", "text"]
    assert second.content[1].text == SCRIPT[1]["content"]
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0

    for session, stream in (("sess-anthropic-s", True), ("sess-anthropic-n", False)):
        records = read_records(proxy.captures, session=session, expect=2)
        assert [(r["api"], r["status"], r["complete"], r["streamed"]) for r in records] == [
            ("anthropic", 200, True, stream)
        ] * 2
        assert records[0]["request"]["model"] == MODEL and records[0]["path"].startswith("/v1/messages?beta=true")
        upstream = [r["upstream_request"] for r in records]
        assert upstream[0]["model"] == "tiny" and [t["function"]["name"] for t in upstream[0]["tools"]] == ["Bash"]
        assert upstream[0]["messages"][0] == {"role": "system", "content": "You are a coding agent."}  # no billing line
        # The signature sent back arrives upstream as the reasoning the model produced.
        assistant, tool = upstream[1]["messages"][2:4]
        assert (
            assistant["reasoning"] == SCRIPT[0]["reasoning"]
            and assistant["tool_calls"][0]["function"]["name"] == "Bash"
        )
        assert tool == {"role": "tool", "tool_call_id": assistant["tool_calls"][0]["id"], "content": "(no output)"}
        # Token fidelity: turn 2's prompt re-renders turn 1 exactly as sampled.
        (prompt0, ids0, _), (prompt1, ids1, _) = tokens_of(records[0]), tokens_of(records[1])
        assert ids0 and ids1 and prompt1[: len(prompt0) + len(ids0)] == prompt0 + ids0


def test_messages_stream_events_arrive_in_anthropic_order(proxy):
    """The non-beta endpoint, event by event: one scripted turn of thinking and a tool call."""
    kwargs = {"model": MODEL, "max_tokens": 200, "system": SYSTEM, "messages": FIRST_TURN, "tools": TOOLS}
    with client(proxy, "sess-anthropic-events") as c, c.messages.stream(**kwargs) as stream:
        # The SDK adds its own convenience events (text, thinking, input_json, ...); the wire's are these.
        raw = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream if e.type in RAW_EVENTS]
        message = stream.get_final_message()
    assert [name for name, _ in itertools.groupby(raw)] == [
        ("message_start", None),
        ("content_block_start", None),
        ("content_block_delta", "thinking_delta"), ("content_block_delta", "signature_delta"),
        ("content_block_stop", None),
        ("content_block_start", None), ("content_block_delta", "input_json_delta"), ("content_block_stop", None),
        ("message_delta", None),
        ("message_stop", None),
    ]  # fmt: skip
    assert [b.type for b in message.content] == ["thinking", "tool_use"] and message.stop_reason == "tool_use"
    assert message.content[1].input == SCRIPT[0]["tool_calls"][0]["arguments"]


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_context_overflow_comes_back_in_anthropic_shape(proxy, stream):
    """A history beyond the context comes back in Claude Code's own wording, which makes it compact. (A max_tokens
    beyond the context never reaches the upstream: the addon cuts it to fit, tests/addon/test_clamp.py.)"""
    kwargs = {"model": MODEL, "max_tokens": 100, "messages": [{"role": "user", "content": "hello " * 40_000}]}
    with client(proxy, f"sess-anthropic-overflow-{stream}") as c, pytest.raises(anthropic.APIStatusError) as raised:
        create(c.messages, stream=stream, **kwargs)
    assert raised.value.status_code == 400 and isinstance(raised.value, anthropic.BadRequestError)
    body = raised.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert re.match(r"prompt is too long: \d+ tokens > 32768 maximum", body["error"]["message"]), body


def test_count_tokens_is_answered_by_the_proxy(proxy):
    with client(proxy, "sess-anthropic-count") as c:
        counted = c.messages.count_tokens(model=MODEL, system=SYSTEM, messages=FIRST_TURN, tools=TOOLS[:1])
    assert 20 < counted.input_tokens < 200  # an estimate: about 60 from 240 characters
    (record,) = read_records(proxy.captures, session="sess-anthropic-count", expect=1)
    assert record["status"] == 200 and record["upstream_request"] is None and record["response_body"] is not None
