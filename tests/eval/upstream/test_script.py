"""eval.upstream.script: the script file formats, per-session order, and replaying the last message."""

import json

import pytest

from eval.upstream.script import Script

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
    with pytest.raises(ValueError, match=r"script\.json"):
        Script.load(path)


def test_an_object_of_patterns_gives_each_session_the_first_matching_script(tmp_path):
    path = tmp_path / "script.json"
    path.write_text(json.dumps({"*pager-1-*": MESSAGES, "*-0": [{"content": "zero"}], "*-[12]": [{"content": "x"}]}))
    script = Script.load(path)
    assert script.take("r0-polar-toy__pager-1-0")["reasoning"] == "look"  # the first pattern wins
    assert script.take("r0-polar-toy__vat-1-0")["content"] == "zero"
    assert script.take("r0-polar-toy__vat-1-2")["content"] == "x"
    with pytest.raises(KeyError, match="no script for session 'r0-polar-toy__vat-1-3'"):
        script.take("r0-polar-toy__vat-1-3")
    path.write_text(json.dumps({"*": []}))
    with pytest.raises(ValueError, match="pattern '\\*'"):
        Script.load(path)
