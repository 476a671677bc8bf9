"""eval.upstream.toolparse: the same events whatever the chunking, markers never leaked half-seen."""

import json

import pytest

from eval.upstream.toolparse import Content, OutputParser, Reasoning, StopStrings, ToolCall

ANSWER = (
    '<think>\nneed the files ü\n</think>\n\nI will list them.\n<tool_call>\n{"name": "bash", "arguments": '
    '{"command": "ls -la"}}\n</tool_call>\n<tool_call>\n{"name": "read", "arguments": {"path": "a.py"}}\n</tool_call>'
)


def parse(chunks: list[str], *, parse_tools: bool = True) -> list:
    parser = OutputParser(parse_tools=parse_tools)
    events = [e for chunk in chunks for e in parser.feed(chunk)] + parser.flush()
    merged: list = []  # adjacent text of one kind joined, so chunkings compare equal
    for e in events:
        if merged and type(e) is type(merged[-1]) and not isinstance(e, ToolCall):
            merged[-1] = type(e)(merged[-1].text + e.text)
        else:
            merged.append(e)
    return merged


EXPECTED = [
    Reasoning("need the files ü"),
    Content("I will list them."),
    ToolCall("bash", '{"command": "ls -la"}'),
    ToolCall("read", '{"path": "a.py"}'),
]


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(ANSWER)])
def test_events_do_not_depend_on_chunking(size):
    assert parse([ANSWER[i : i + size] for i in range(0, len(ANSWER), size)]) == EXPECTED


def test_a_possible_marker_is_held_back_until_decided():
    parser = OutputParser(parse_tools=True)
    assert parser.feed("Hello <tool_c") == [Content("Hello ")]
    assert parser.feed("ompass>") == [Content("<tool_compass>")]  # not a marker after all
    assert parser.feed("\n\n") == []  # trailing newlines wait for more text
    assert parser.feed("x") == [Content("\n\nx")]
    assert parser.flush() == []


def test_tool_markup_is_content_without_tools():
    text = '<tool_call>\n{"name": "bash", "arguments": {}}\n</tool_call>'
    assert parse([text], parse_tools=False) == [Content(text)]


def test_bad_tool_call_stays_content():
    text = "<tool_call>\nnot json\n</tool_call>"
    assert parse(["Hi ", text]) == [Content("Hi " + text)]
    assert parse(['<tool_call>{"arguments": {}}</tool_call>']) == [Content('<tool_call>{"arguments": {}}</tool_call>')]


def test_unclosed_tool_call_at_the_end():
    assert parse(['<tool_call>\n{"name": "ls", "arguments": {"a": 1}}\n']) == [ToolCall("ls", json.dumps({"a": 1}))]
    assert parse(['ok <tool_call>\n{"name": "ls", "argu']) == [Content('ok <tool_call>\n{"name": "ls", "argu')]
    assert parse(["ok <tool_"]) == [Content("ok <tool_")]


def test_missing_arguments_are_an_empty_object():
    assert parse(['<tool_call>{"name": "now"}</tool_call>']) == [ToolCall("now", "{}")]


def test_unclosed_reasoning_is_reasoning():
    assert parse(["<think>\nstill thinking\n\n"]) == [Reasoning("still thinking")]


@pytest.mark.parametrize("size", [1, 2, 5])
def test_stop_strings_cut_text_and_hold_prefixes(size):
    text = "alpha STOP beta"
    stops, out, hit = StopStrings(["STOP", "xyz"]), "", False
    for i in range(0, len(text), size):
        piece, hit = stops.feed(text[i : i + size])
        out += piece
        if hit:
            break
    assert (out, hit) == ("alpha ", True)


def test_stop_string_prefix_is_released_at_the_end():
    stops = StopStrings(["STOP"])
    assert stops.feed("end ST") == ("end ", False)
    assert stops.flush() == "ST"
