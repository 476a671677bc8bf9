"""The Anthropic Messages translator (addon/anthropic.py), pure: request mapping, stream and answer translation."""

import json

import pytest

from addon import anthropic, native

OPTIONS = native.Options(model="", upstream="vllm")
BASH = {
    "name": "Bash",
    "description": "Run a command.",
    "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
}
BASH_FUNCTION = {
    "type": "function",
    "function": {"name": "Bash", "parameters": BASH["input_schema"], "description": "Run a command."},
}


def start(body, path="/v1/messages?beta=true", options=OPTIONS):
    return anthropic.start({"model": "claude-sonnet-4-5", "max_tokens": 100, **body}, path, {}, options)


def chat(body, **kwargs):
    return start(body, **kwargs).chat_body


def user(text="hi"):
    return {"role": "user", "content": text}


# --- request --------------------------------------------------------------------------------------


def test_claude_code_request():
    """The shape Claude Code sends (reference/stack.md §3), billing line and all."""
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {
                "type": "text",
                "text": "x-anthropic-billing-header: cc_version=2.1.197.a1f; cc_entrypoint=cli; cch=9f3e1;",
            },
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                    {"type": "text", "text": "fix it"},
                ],
            },
            {"role": "system", "content": "Agents: Explore."},
            {"role": "assistant", "content": [{"type": "text", "text": "On it."}]},
            {"role": "user", "content": [{"type": "text", "text": "go", "cache_control": {"type": "ephemeral"}}]},
        ],
        "tools": [BASH, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": "user_abc_session_1"},
    }
    assert chat(body) == {
        "model": "claude-sonnet-4-5",
        "stream": True,
        "messages": [
            {"role": "system", "content": "You are Claude Code.\n\nBe brief.\n\nAgents: Explore."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                    {"type": "text", "text": "fix it"},
                ],
            },
            {"role": "assistant", "content": "On it."},
            {"role": "user", "content": "go"},
        ],
        "tools": [BASH_FUNCTION],
        "max_tokens": 32000,
        "chat_template_kwargs": {"enable_thinking": True},
    }


def test_billing_line_is_stripped_from_a_string_system_prompt():
    body = {"system": "x-anthropic-billing-header: cch=1;\nYou are Claude Code.", "messages": [user()]}
    assert chat(body)["messages"][0] == {"role": "system", "content": "You are Claude Code."}
    assert chat({"system": "Keep x-anthropic-billing-header: here", "messages": [user()]})["messages"][0][
        "content"
    ].startswith("Keep")


def test_history_with_thinking_and_two_tool_calls():
    ours = native.mint_reasoning("I should list, then read.")
    body = {
        "messages": [
            user("look around"),
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should list, then read.", "signature": ours},
                    {"type": "redacted_thinking", "data": "EoQBCkYIAx..."},
                    {"type": "thinking", "thinking": "someone else's", "signature": "EqQBCkgIBRAB..."},
                    {"type": "text", "text": "Listing."},
                    {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "Read", "input": {"path": "ü.txt", "limit": 5}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "is_error": True,
                        "content": [{"type": "text", "text": "no such file"}],
                    },
                    {"type": "text", "text": "and?"},
                ],
            },
        ],
        "tools": [BASH],
    }
    assert chat(body)["messages"][1:] == [
        {
            "role": "assistant",
            "content": "Listing.",
            "reasoning": "I should list, then read.",  # from our signature; the foreign ones are dropped
            "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}},
                {
                    "id": "toolu_2",
                    "type": "function",
                    "function": {"name": "Read", "arguments": '{"path": "ü.txt", "limit": 5}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "[Tool Error] no such file"},
        {"role": "user", "content": "and?"},
    ]


def test_sglang_reads_reasoning_content():
    ours = {"type": "thinking", "thinking": "hm", "signature": native.mint_reasoning("hm")}
    body = {"messages": [user(), {"role": "assistant", "content": [ours]}, user()]}
    assert chat(body, options=native.Options(model="", upstream="sglang"))["messages"][1]["reasoning_content"] == "hm"


def test_images_become_image_url_parts_and_tool_result_images_follow_the_tool_messages():
    png = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "shot:"}, {"type": "image", "source": png}],
                    },
                    {"type": "image", "source": {"type": "url", "url": "https://example.com/a.jpg"}},
                    {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "notes"}},
                    {"type": "text", "text": "compare"},
                ],
            }
        ]
    }
    assert chat(body)["messages"] == [
        {"role": "tool", "tool_call_id": "t1", "content": "shot:"},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.jpg"}},
                {"type": "text", "text": "notes"},
                {"type": "text", "text": "compare"},
            ],
        },
    ]


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, {"tool_choice": "auto"}),
        ({"type": "any"}, {"tool_choice": "required"}),
        ({"type": "none"}, {"tool_choice": "none"}),
        ({"type": "tool", "name": "Bash"}, {"tool_choice": {"type": "function", "function": {"name": "Bash"}}}),
        ({"type": "auto", "disable_parallel_tool_use": True}, {"tool_choice": "auto", "parallel_tool_calls": False}),
    ],
)
def test_tool_choice(choice, expected):
    body = chat({"messages": [user()], "tools": [BASH], "tool_choice": choice})
    assert {k: body[k] for k in ("tool_choice", "parallel_tool_calls") if k in body} == expected


def test_tool_choice_is_dropped_without_tools():
    """Claude Code sends tools=[] when it compacts; SGLang rejects a tool_choice without tools."""
    for tools in ([], [{"type": "web_search_20250305", "name": "web_search"}]):
        body = chat({"messages": [user()], "tools": tools, "tool_choice": {"type": "auto"}})
        assert "tools" not in body and "tool_choice" not in body


def test_sampling_parameters_and_model():
    body = {
        "messages": [user()],
        "stop_sequences": ["END"],
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 20,
        "metadata": {"user_id": "u"},
    }
    assert chat(body) == {
        "model": "claude-sonnet-4-5",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 100,
        "stop": ["END"],
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 20,
    }
    served = start({"messages": [user()]}, options=native.Options(model="Qwen/Qwen3-4B", upstream="vllm"))
    assert served.chat_body["model"] == "Qwen/Qwen3-4B"
    assert (
        served.answer({"choices": [{"message": {"content": "x"}, "finish_reason": "stop"}]})["model"]
        == "claude-sonnet-4-5"
    )


@pytest.mark.parametrize(
    ("extra", "kwargs"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 2000}}, {"enable_thinking": True}),
        ({"thinking": {"type": "disabled"}}, {"enable_thinking": False}),
        (
            {"thinking": {"type": "adaptive"}, "chat_template_kwargs": {"enable_thinking": False}},
            {"enable_thinking": False},
        ),
        ({"chat_template_kwargs": {"custom": 1}}, {"custom": 1}),
        ({}, None),
    ],
)
def test_thinking_never_overrides_an_explicit_choice(extra, kwargs):
    assert chat({"messages": [user()], **extra}).get("chat_template_kwargs") == kwargs


def test_prefilled_answer_is_continued():
    body = chat({"messages": [user(), {"role": "assistant", "content": "{"}]})
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False


@pytest.mark.parametrize(
    ("body", "path", "match"),
    [
        ({"messages": []}, "/v1/messages", "non-empty"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "/v1/messages", "role"),
        ({"messages": [{"role": "user", "content": 5}]}, "/v1/messages", "string or an array"),
        ({"messages": [{"role": "user", "content": [{"type": "search_result"}]}]}, "/v1/messages", "search_result"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf"}}
                        ],
                    }
                ]
            },
            "/v1/messages",
            "document blocks with a base64 source",
        ),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "server_tool_use"}]}]},
            "/v1/messages",
            "server_tool_use",
        ),
        ({"messages": [user()]}, "/v1/messages/batches", "batches"),
    ],
)
def test_untranslatable_requests(body, path, match):
    with pytest.raises(native.BadRequest, match=match):
        anthropic.start(body, path, {}, OPTIONS)


def test_count_tokens_is_answered_locally():
    body = {"model": "claude-sonnet-4-5", "system": "s" * 40, "messages": [user("u" * 400)], "tools": [BASH]}
    answer = anthropic.start(body, "/v1/messages/count_tokens?beta=true", {}, OPTIONS)
    assert isinstance(answer, native.LocalAnswer) and answer.status == 200
    # One token per four characters: 440 of text, the tool's JSON on top.
    assert answer.body["input_tokens"] == (440 + len(json.dumps([BASH_FUNCTION])) + 3) // 4


# --- stream ---------------------------------------------------------------------------------------

HEAD = {"id": "chatcmpl-7f3a", "object": "chat.completion.chunk", "model": "served"}


def chunk(delta=None, *, finish=None, ids=(), **extra):
    choice = {
        "index": 0,
        "delta": delta or {},
        "logprobs": {"content": [{"token": "x", "logprob": -0.1}]},
        "finish_reason": finish,
    }
    return {**HEAD, "choices": [{**choice, "token_ids": list(ids), **extra}]}


def usage_chunk(prompt=7, completion=9, cached=0):
    details = {"prompt_tokens_details": {"cached_tokens": cached}} if cached else {}
    return {**HEAD, "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion, **details}}


def call_piece(index, *, id=None, name=None, arguments=""):
    function = {"arguments": arguments} | ({"name": name} if name else {})
    return {"index": index, "function": function} | ({"id": id, "type": "function"} if id else {})


REASONING = "List first. Then read ü."
TEXT = "I'll look."
# reasoning -> text -> two tool calls; text split mid-word and mid-UTF-8 character boundaries, arguments
# split mid-key, the second call's name arriving one piece after its id.
CHUNKS = [
    {
        **HEAD,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        "prompt_token_ids": list(range(1, 8)),
    },
    chunk({"reasoning": "List fi"}, ids=[10]),
    chunk({"reasoning": "rst. Then read ü."}, ids=[11]),
    chunk({"content": ""}, ids=[12]),  # held back by a parser: ids only
    chunk({"content": "I'll"}, ids=[13]),
    chunk({"content": " look."}, ids=[14]),
    chunk({"tool_calls": [call_piece(0, id="chatcmpl-tool-aa1", name="Bash", arguments='{"comm')]}, ids=[15]),
    chunk({"tool_calls": [call_piece(0, arguments='and": "ls"}')]}, ids=[16]),
    chunk({"tool_calls": [call_piece(1, id="chatcmpl-tool-bb2")]}, ids=[17]),
    chunk({"tool_calls": [call_piece(1, name="Read", arguments='{"path": "a')]}, ids=[18]),
    chunk({"tool_calls": [call_piece(1, arguments='.txt"}')]}, finish="tool_calls", ids=[19]),
    usage_chunk(),
]


def parse(data):
    """(event name, payload) per SSE event in ``data``."""
    events = []
    for block in data.decode().split("\n\n"):
        if block:
            name, payload = block.split("\n")
            assert name.startswith("event: ") and payload.startswith("data: ")
            events.append((name[7:], json.loads(payload[6:])))
    return events


def assemble(events):
    """The Message a client builds from the events (as the SDK's accumulator does)."""
    message = None
    for name, event in events:
        assert event["type"] == name
        if name == "message_start":
            message = event["message"]
        elif name == "content_block_start":
            assert event["index"] == len(message["content"])
            message["content"].append(dict(event["content_block"], _json=""))
        elif name == "content_block_delta":
            block, delta = message["content"][event["index"]], event["delta"]
            kind = delta.pop("type")
            key = {
                "text_delta": "text",
                "thinking_delta": "thinking",
                "signature_delta": "signature",
                "input_json_delta": "_json",
            }[kind]
            block[key] = (block[key] if kind != "signature_delta" else "") + delta[
                key if kind != "input_json_delta" else "partial_json"
            ]
        elif name == "message_delta":
            message.update(event["delta"])
            message["usage"].update(event["usage"])
    for block in message["content"]:
        raw = block.pop("_json")
        if block["type"] == "tool_use":
            block["input"] = json.loads(raw) if raw else {}
    return message


def run(translation, chunks, complete=True):
    per_chunk = [translation.events(c) for c in chunks]
    return per_chunk, [*per_chunk, translation.finish(complete)]


def test_stream_reasoning_text_two_tool_calls():
    translation = start({"messages": [user()], "stream": True, "tools": [BASH]})
    per_chunk, out = run(translation, CHUNKS)
    events = parse(b"".join(out))
    assert [name for name, _ in events] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_delta",
        "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    # Each event goes out with the chunk that completes it, not at the end.
    assert [name for name, _ in parse(per_chunk[0])] == ["message_start", "ping"]
    assert parse(per_chunk[1])[-1][1]["delta"] == {"type": "thinking_delta", "thinking": "List fi"}
    assert per_chunk[3] == b""
    assert [e["delta"]["type"] for _, e in parse(per_chunk[4]) if _ == "content_block_delta"] == [
        "signature_delta",
        "text_delta",
    ]
    assert parse(per_chunk[8]) == []  # the second call has no name yet: its block cannot start
    assert [name for name, _ in parse(per_chunk[-1])][-2:] == ["message_delta", "message_stop"] and out[-1] == b""

    message = assemble(events)
    assert message == {
        "id": "msg_7f3a",
        "type": "message",
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": REASONING, "signature": native.mint_reasoning(REASONING)},
            {"type": "text", "text": TEXT},
            {"type": "tool_use", "id": "toolu_aa1", "name": "Bash", "input": {"command": "ls"}},
            {"type": "tool_use", "id": "toolu_bb2", "name": "Read", "input": {"path": "a.txt"}},
        ],
        "model": "claude-sonnet-4-5",
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 7,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 9,
        },
    }


def test_stream_split_anywhere_in_the_bytes_gives_the_same_events():
    wire = (
        b"".join(b"data: " + json.dumps(c, ensure_ascii=False).encode() + b"\n\n" for c in CHUNKS) + b"data: [DONE]\n\n"
    )
    whole = start({"messages": [user()], "stream": True})
    expected = b"".join(run(whole, CHUNKS)[1])
    for size in (1, 3, 7, 64):
        decoder, translation = native.ChatStream(), start({"messages": [user()], "stream": True})
        pieces = [wire[i : i + size] for i in range(0, len(wire), size)]
        out = [translation.events(c) for piece in pieces for c in decoder.decode(piece)]
        out += [translation.events(c) for c in decoder.flush()] + [translation.finish(True)]
        assert b"".join(out) == expected


def test_stream_equals_the_non_streamed_answer():
    translation = start({"messages": [user()], "tools": [BASH]})
    response = {
        "id": "chatcmpl-7f3a",
        "object": "chat.completion",
        "prompt_token_ids": [1, 2, 3, 4, 5, 6, 7],
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": TEXT,
                    "reasoning": REASONING,
                    "tool_calls": [
                        {
                            "id": "chatcmpl-tool-aa1",
                            "type": "function",
                            "function": {"name": "Bash", "arguments": '{"command": "ls"}'},
                        },
                        {
                            "id": "chatcmpl-tool-bb2",
                            "type": "function",
                            "function": {"name": "Read", "arguments": '{"path": "a.txt"}'},
                        },
                    ],
                },
                "finish_reason": "tool_calls",
                "token_ids": list(range(10, 19)),
            }
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16},
    }
    streamed = assemble(parse(b"".join(run(start({"messages": [user()], "stream": True}), CHUNKS)[1])))
    assert translation.answer(response) == streamed


def test_stream_without_a_usage_chunk_counts_token_ids():
    translation = start({"messages": [user()], "stream": True})
    other = {**HEAD, "choices": [{"index": 1, "delta": {"content": "n=2?"}, "token_ids": [9]}]}  # ignored: one answer
    _, out = run(translation, [CHUNKS[0], chunk({"content": "hi"}, ids=[5, 6]), other, chunk(finish="length", ids=[7])])
    message = assemble(parse(b"".join(out)))
    assert message["stop_reason"] == "max_tokens" and message["usage"]["output_tokens"] == 3
    assert message["content"] == [{"type": "text", "text": "hi"}]
    assert message["usage"]["input_tokens"] == 7


def test_usage_counts_cache_reads_apart():
    translation = start({"messages": [user()], "stream": True})
    _, out = run(
        translation, [CHUNKS[0], chunk({"content": "hi"}, finish="stop"), usage_chunk(prompt=7, completion=1, cached=4)]
    )
    usage = assemble(parse(b"".join(out)))["usage"]
    assert usage == {
        "input_tokens": 3,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 4,
        "output_tokens": 1,
    }


@pytest.mark.parametrize(
    ("finish", "matched", "calls", "expected"),
    [
        ("stop", None, False, ("end_turn", None)),
        ("stop", "END", False, ("stop_sequence", "END")),
        ("stop", 151645, False, ("end_turn", None)),  # vLLM: a stop token id
        ("length", None, False, ("max_tokens", None)),
        ("length", None, True, ("max_tokens", None)),  # a call cut short is not a call to run
        ("stop", None, True, ("tool_use", None)),
        ("tool_calls", None, True, ("tool_use", None)),
        (None, None, False, (None, None)),
    ],
)
def test_stop_reasons(finish, matched, calls, expected):
    translation = start({"messages": [user()], "stop_sequences": ["END"]})
    tool_calls = [{"id": "c", "function": {"name": "Bash", "arguments": "{}"}}] if calls else []
    message = {"content": "x", "tool_calls": tool_calls}
    answer = translation.answer({"choices": [{"message": message, "finish_reason": finish, "stop_reason": matched}]})
    assert (answer["stop_reason"], answer["stop_sequence"]) == expected


def test_a_broken_stream_ends_with_an_error_event():
    translation = start({"messages": [user()], "stream": True})
    _, out = run(translation, CHUNKS[:5], complete=False)
    events = parse(b"".join(out))
    assert events[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "polar could not translate the upstream stream"}},
    )
    assert translation.events(CHUNKS[5]) == b"" and translation.finish(False) == b""


def test_a_stream_that_stops_before_its_finish_reason_is_an_error():
    translation = start({"messages": [user()], "stream": True})
    _, out = run(translation, CHUNKS[:5])
    assert parse(out[-1])[-1][1]["error"]["type"] == "api_error"


def test_an_upstream_error_mid_stream_becomes_an_error_event():
    translation = start({"messages": [user()], "stream": True})
    error = {
        "error": {
            "message": (
                "This model's maximum context length is 4096 tokens. However, your request has 5000 input tokens."
            ),
            "code": 400,
        }
    }
    out = translation.events(CHUNKS[0]) + translation.events(error)
    error = {"type": "invalid_request_error", "message": "prompt is too long: 5000 tokens > 4096 maximum"}
    assert parse(out)[-1] == ("error", {"type": "error", "error": error})
    assert translation.events(CHUNKS[1]) == b"" and translation.finish(True) == b""


def test_a_tool_call_that_resumes_after_its_block_closed_is_refused():
    translation = start({"messages": [user()], "stream": True})
    for c in [*CHUNKS[:8], chunk({"tool_calls": [call_piece(1, id="c2", name="Read")]})]:
        translation.events(c)
    with pytest.raises(ValueError, match="tool call 0"):
        translation.events(chunk({"tool_calls": [call_piece(0, arguments="}")]}))


def test_tool_arguments_that_are_no_object_are_refused():
    def called(arguments):
        calls = [{"function": {"name": "f", "arguments": arguments}}]
        return {"choices": [{"message": {"tool_calls": calls}, "finish_reason": "tool_calls"}]}

    translation = start({"messages": [user()]})
    with pytest.raises(ValueError, match="not a JSON object"):
        translation.answer(called("[1]"))
    empty = translation.answer(called(""))
    assert empty["content"][0]["input"] == {} and empty["content"][0]["id"].startswith("toolu_")


def test_reasoning_round_trip():
    """The signature minted in an answer comes back next turn as the upstream's ``reasoning``."""
    first = start({"messages": [user()], "tools": [BASH]})
    answer = first.answer(
        {
            "choices": [
                {
                    "message": {
                        "content": None,
                        "reasoning": REASONING,
                        "tool_calls": [
                            {"id": "call_1", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}
                        ],
                    },
                    "finish_reason": "tool_calls",
                }
            ]
        }
    )
    assert [b["type"] for b in answer["content"]] == ["thinking", "tool_use"]
    result = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": answer["content"][1]["id"], "content": "a.txt"}],
    }
    second = chat({"messages": [user(), {"role": "assistant", "content": answer["content"]}, result], "tools": [BASH]})
    assert second["messages"][1] == {
        "role": "assistant",
        "content": None,
        "reasoning": REASONING,
        "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}
        ],
    }
    assert second["messages"][2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "a.txt"}


# --- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [(400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
     (422, "invalid_request_error"), (429, "rate_limit_error"), (500, "api_error"), (502, "api_error"),
     (503, "overloaded_error"), (504, "timeout_error")],
)  # fmt: skip
def test_error_types(status, kind):
    assert anthropic.error_body(status, "boom") == {"type": "error", "error": {"type": kind, "message": "boom"}}


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (  # vLLM, prompt alone too long
            (
                "This model's maximum context length is 32768 tokens. However, your request has 40000 input tokens. "
                "Please reduce the length of the input messages."
            ),
            "prompt is too long: 40000 tokens > 32768 maximum",
        ),
        (  # vLLM 0.32 (also eval/upstream/server.py), prompt alone too long
            (
                "This model's maximum context length is 2048 tokens. However, your prompt contains at least 2049 "
                "input tokens, which exceeds this limit even without any output tokens. Please reduce the length of "
                "the input prompt. (parameter=input_tokens, value=2049)"
            ),
            "prompt is too long: 2049 tokens > 2048 maximum",
        ),
        (  # vLLM (older wording), the prompt fits but not with max_tokens
            (
                "This model's maximum context length is 32768 tokens. However, you requested 42000 tokens "
                "(10000 in the messages, 32000 in the completion)."
            ),
            (
                "input length and `max_tokens` exceed context limit: 10000 + 32000 > 32768, "
                "decrease input length or `max_tokens` and try again"
            ),
        ),
        (
            (
                "'max_tokens' or 'max_completion_tokens' is too large: 32000. This model's maximum context length is "
                "32768 tokens and your request has 900 input tokens (32000 > 32768 - 900)."
            ),
            (
                "input length and `max_tokens` exceed context limit: 900 + 32000 > 32768, "
                "decrease input length or `max_tokens` and try again"
            ),
        ),
        (  # SGLang
            (
                "Requested token count exceeds the model's maximum context length of 4096 tokens. "
                "You requested a total of 5000 tokens: 4000 tokens from the input messages "
                "and 1000 tokens for the completion."
            ),
            (
                "input length and `max_tokens` exceed context limit: 4000 + 1000 > 4096, "
                "decrease input length or `max_tokens` and try again"
            ),
        ),
        (
            "The decoder prompt (length 33000) is longer than the maximum model length of 32768.",
            "prompt is too long: 33000 tokens > 32768 maximum",
        ),
        (
            "The input (50000 tokens) is longer than the model's context length (40960 tokens).",
            "prompt is too long: 50000 tokens > 40960 maximum",
        ),
        ("'messages' must be a non-empty array", "'messages' must be a non-empty array"),
    ],
)
def test_context_length_errors_read_as_anthropic_words_them(message, expected):
    assert anthropic.error_body(400, message)["error"] == {"type": "invalid_request_error", "message": expected}
    assert start({"messages": [user()]}).error(400, message) == anthropic.error_body(400, message)
