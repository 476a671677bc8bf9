"""eval.script: the script file formats, per-session order, and replaying the last message."""

import json

import pytest

from eval.script import Script

MESSAGES = [
    {"content": None, "reasoning": "look", "tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}]},
    {"content": "done"},
]


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_sessions_take_messages_in_order_then_repeat_the_last(tmp_path, fmt):
    path = tmp_path / f"script.{fmt}"
    path.write_text(json.dumps(MESSAGES) if fmt == "json" else "\n".join(map(json.dumps, MESSAGES)) + "\n")
    script = Script.load(path)
    first = script.take("a")
    assert first == {
        "role": "assistant",
        "content": None,
        "reasoning": "look",
        "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}],
    }
    assert script.take("b") == first  # sessions are independent
    assert [script.take("a")["content"] for _ in range(3)] == ["done", "done", "done"]


@pytest.mark.parametrize(
    "items",
    [[], {"content": "x"}, [{"content": 3}], [{"tool_calls": [{"name": "bash"}]}], [{"tool_calls": "ls"}], ["hi"]],
)
def test_malformed_scripts_are_refused(tmp_path, items):
    path = tmp_path / "script.json"
    path.write_text(json.dumps(items))
    with pytest.raises(ValueError, match="script.json"):
        Script.load(path)
