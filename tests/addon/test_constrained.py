"""addon/constrained.py: which request bodies vLLM decodes under a constraint, and the record field that says so."""

import json

import pytest

from addon.constrained import constraints
from tests.addon.test_polar import make_chat_flow, read_records, run_exchange

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"messages": []}, []),
        ({"tools": TOOLS, "tool_choice": "auto"}, []),
        ({"tools": TOOLS, "tool_choice": "none"}, []),
        ({"tools": TOOLS, "tool_choice": "required"}, ["tool_choice"]),
        ({"tool_choice": "required"}, []),  # no tools: vLLM has nothing to force
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "bash"}}}, ["tool_choice"]),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "bash"}}, ["tool_choice"]),  # Responses
        ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, []),
        ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": []}}, ["tool_choice"]),
        ({"response_format": {"type": "text"}}, []),
        ({"response_format": {"type": "json_object"}}, ["response_format"]),
        ({"response_format": JSON_SCHEMA}, ["response_format"]),
        ({"text": {"format": {"type": "json_schema", "name": "c", "schema": SCHEMA}}}, ["text.format"]),
        ({"text": {"format": {"type": "text"}}}, []),
        ({"structured_outputs": {"choice": ["a", "b"]}}, ["structured_outputs"]),
        ({"guided_regex": "[0-9]+", "guided_json": None}, ["guided_regex"]),
        ("not a body", []),
    ],
)  # fmt: skip
def test_constraints(body, expected):
    assert constraints(body) == expected


ANSWER = {
    "id": "c",
    "object": "chat.completion",
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "prompt_token_ids": [1, 2],
}


def test_records_list_the_constraints_of_the_body_sent_upstream(addon, tctx, tmp_path):
    forced = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "required"}
    run_exchange(addon, make_chat_flow(body=forced), [json.dumps(ANSWER).encode()])
    run_exchange(addon, make_chat_flow(), [json.dumps(ANSWER).encode()])
    # A translated Anthropic call: its own tool_choice {"type": "any"} went upstream as "required".
    anthropic_tool = {"name": "bash", "description": "Run it.", "input_schema": {"type": "object"}}
    native = {
        "model": "claude",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [anthropic_tool],
        "tool_choice": {"type": "any"},
    }
    run_exchange(addon, make_chat_flow(body=native, path="/v1/messages"), [json.dumps(ANSWER).encode()])
    addon.done()
    records = read_records(tmp_path / "captures")
    assert [(r["api"], r["constrained"]) for r in records] == [
        ("chat", ["tool_choice"]),
        ("chat", []),
        ("anthropic", ["tool_choice"]),
    ]
    # The translator sends each tool's keys in the order vLLM renders them (issue 15).
    assert list(records[2]["upstream_request"]["tools"][0]["function"]) == ["name", "description", "parameters"]
