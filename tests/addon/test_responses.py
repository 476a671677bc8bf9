"""addon/responses.py: the Responses request mapping and the chunk-by-chunk answer, pure (no proxy)."""

import json
import typing

import pytest
from openai.types.responses import Response, ResponseStreamEvent

from addon import native, responses

OPTIONS = native.Options(model="", upstream="vllm")
# The SDK's event models by type (its union's discriminator is the SDK's own, not pydantic's).
EVENTS = {
    typing.get_args(e.model_fields["type"].annotation)[0]: e
    for e in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}
THOUGHT = "The user wants a file; ls first — then write it. ✓"
SHELL = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a command.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
}
CHAT_SHELL = {"type": "function", "function": {k: SHELL[k] for k in ("name", "description", "parameters")}}


def translate(body, options=OPTIONS):
    return responses.start(body, "/v1/responses", {}, options)


def codex_body(**overrides):
    """A Codex 0.171-shaped second turn: developer + user messages, one earlier turn of reasoning and calls."""
    body = {
        "model": "gpt-5-codex",
        "instructions": "You are Codex.",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "Sandbox: workspace-write."}],
            },
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<env>cwd=/w</env>"}]},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Write "}, {"type": "input_text", "text": "hi."}],
            },
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": native.mint_reasoning(THOUGHT)},
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_a",
                "name": "exec_command",
                "arguments": '{"cmd":"ls"}',
            },
            {
                "type": "function_call",
                "id": "fc_2",
                "call_id": "call_b",
                "name": "exec_command",
                "arguments": '{"cmd":"pwd"}',
            },
            {"type": "function_call_output", "call_id": "call_a", "output": "a.txt"},
            {"type": "function_call_output", "call_id": "call_b", "output": "/w"},
            {
                "type": "reasoning",
                "id": "rs_2",
                "summary": [{"type": "summary_text", "text": "s"}],
                "encrypted_content": "gAAAAB-openai-only",
            },
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Writing it."}]},
            {
                "type": "local_shell_call",
                "id": "ls_1",
                "call_id": "call_c",
                "status": "completed",
                "action": {"type": "exec", "command": ["touch", "hi"], "env": {}},
            },
            {"type": "local_shell_call_output", "id": "call_c", "output": ""},
            {"role": "developer", "content": "Approval policy changed."},
        ],
        "tools": [
            SHELL,
            {"type": "web_search"},
            {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": []},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "thread-1",
        "client_metadata": {"x": "y"},
    }
    return {**body, **overrides}


def test_codex_request_maps_to_one_chat_request():
    chat = translate(codex_body()).chat_body
    assert chat == {
        "model": "gpt-5-codex",
        "stream": True,
        "messages": [
            {"role": "system", "content": "You are Codex.\n\nSandbox: workspace-write.\n\nApproval policy changed."},
            {"role": "user", "content": "<env>cwd=/w</env>"},
            {"role": "user", "content": "Write hi."},
            {
                "role": "assistant",
                "content": None,
                "reasoning": THOUGHT,
                "tool_calls": [
                    {
                        "id": "call_a",
                        "type": "function",
                        "function": {"name": "exec_command", "arguments": '{"cmd":"ls"}'},
                    },
                    {
                        "id": "call_b",
                        "type": "function",
                        "function": {"name": "exec_command", "arguments": '{"cmd":"pwd"}'},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_a", "content": "a.txt"},
            {"role": "tool", "tool_call_id": "call_b", "content": "/w"},
            # OpenAI's own encrypted_content is opaque: dropped. The message and the shell call are one turn.
            {
                "role": "assistant",
                "content": "Writing it.",
                "tool_calls": [
                    {
                        "id": "call_c",
                        "type": "function",
                        "function": {"name": "local_shell", "arguments": '{"command": ["touch", "hi"], "env": {}}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_c", "content": ""},
        ],
        "tools": [CHAT_SHELL],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "chat_template_kwargs": {"enable_thinking": True},
    }


def test_tool_choice_goes_with_the_last_function_tool():
    chat = translate(codex_body(tools=[{"type": "web_search"}], tool_choice="required")).chat_body
    assert "tools" not in chat and "tool_choice" not in chat and "parallel_tool_calls" not in chat
    chat = translate(codex_body(tool_choice={"type": "function", "name": "exec_command"})).chat_body
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "exec_command"}}
    assert (
        "tool_choice" not in translate(codex_body(tool_choice={"type": "web_search"})).chat_body
    )  # names a dropped tool


def test_generation_settings_map():
    body = {
        "model": "m",
        "input": "hi",
        "max_output_tokens": 64,
        "temperature": 0.2,
        "top_p": 0.9,
        "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}},
        "reasoning": {"effort": "high"},
        "chat_template_kwargs": {"enable_thinking": False},  # the client's own choice stands
    }
    chat = translate(body, native.Options(model="served", upstream="vllm")).chat_body
    assert chat == {
        "model": "served",
        "stream": False,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 64,
        "temperature": 0.2,
        "top_p": 0.9,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
        },
        "chat_template_kwargs": {"enable_thinking": False},
    }
    chat = translate({**body, "text": {"format": {"type": "json_object"}}, "chat_template_kwargs": None}).chat_body
    assert chat["response_format"] == {"type": "json_object"} and chat["chat_template_kwargs"] == {
        "enable_thinking": True
    }
    chat = translate(
        {**body, "text": {"format": {"type": "text"}}, "reasoning": {"effort": "none"}, "chat_template_kwargs": None}
    ).chat_body
    assert "response_format" not in chat and chat["chat_template_kwargs"] == {"enable_thinking": False}


def test_images_stay_parts():
    content = [
        {"type": "input_text", "text": "what is this?"},
        {"type": "input_image", "image_url": "data:image/png;base64,AA=="},
    ]
    chat = translate({"input": [{"role": "user", "content": content}]}).chat_body
    assert chat["messages"][0]["content"] == [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA==", "detail": "auto"}},
    ]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "keeps none"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "keeps none"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "'web_search_call'"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "'input_file'"),
        ({"input": {"role": "user"}}, "string or an array"),
        ({"input": ["hi"]}, r"'input\[0\]': expected an object, but got a string"),
        (
            {"input": [{"role": "user", "content": 5}]},
            r"'input\[0\]\.content': expected a string or an array of objects",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "role 'tool'"),
        ({"input": "hi", "instructions": ["x"]}, "'instructions'"),
    ],
)
def test_untranslatable_requests_are_refused(body, words):
    with pytest.raises(native.BadRequest, match=words):
        translate(body)


def test_only_the_responses_path_is_translated():
    # The addon detects Responses by an "input" field when the path says nothing; embeddings have one too.
    with pytest.raises(native.BadRequest, match="not a Responses call"):
        responses.start({"model": "m", "input": "hi"}, "/v1/embeddings", {}, OPTIONS)
    assert responses.start({"input": "hi"}, "/openai/v1/responses?api-version=preview", {}, OPTIONS).chat_body[
        "messages"
    ]


def test_error_body_is_openai_shaped_and_context_overflow_makes_codex_compact():
    overflow = responses.error_body(
        400, "This model's maximum context length is 2048 tokens. However, you requested 4000 tokens."
    )
    assert (
        overflow["error"]["code"] == "context_length_exceeded" and overflow["error"]["type"] == "invalid_request_error"
    )
    assert responses.error_body(502, "refused") == {
        "error": {"message": "refused", "type": "server_error", "param": None, "code": None}
    }
    assert responses.error_body(429, "slow down")["error"]["type"] == "rate_limit_error"


# --- the answer ---------------------------------------------------------------------------------------------

HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "served"}


def chunk(delta=None, finish=None, **extra):
    """A vLLM-shaped chunk, with the token fields the translator must ignore."""
    choice = {
        "index": 0,
        "delta": delta or {},
        "logprobs": {"content": [{"token": "x", "logprob": -0.1}]},
        "finish_reason": finish,
        "token_ids": [7],
    }
    return {**HEAD, "choices": [choice], **extra}


USAGE = {**HEAD, "choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 12, "total_tokens": 42}}
# Reasoning, then text, then two calls whose arguments arrive in pieces, as vLLM's tool parsers send them.
CHUNKS = [
    chunk({"role": "assistant", "content": ""}, prompt_token_ids=[1, 2, 3]),
    chunk({"reasoning": THOUGHT[:20]}),
    chunk({"reasoning": THOUGHT[20:]}),
    chunk({"content": "Let me "}),
    chunk({"content": "look."}),
    chunk(
        {
            "tool_calls": [
                {"index": 0, "id": "call_1", "type": "function", "function": {"name": "exec_command", "arguments": ""}}
            ]
        }
    ),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"cmd": '}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"ls"}'}}]}),
    chunk(
        {
            "tool_calls": [
                {
                    "index": 1,
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "exec_command", "arguments": '{"cmd": "pwd"}'},
                }
            ]
        }
    ),
    chunk({}, "tool_calls"),
    USAGE,
]
MESSAGE = {
    "role": "assistant",
    "reasoning": THOUGHT,
    "content": "Let me look.",
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "exec_command", "arguments": '{"cmd": "ls"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "exec_command", "arguments": '{"cmd": "pwd"}'}},
    ],
}


def upstream_bytes(chunks):
    return (
        b"".join(b"data: " + json.dumps(c, ensure_ascii=False).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    )


def play(translation, data, sizes):
    """Network pieces of ``sizes`` bytes through the addon's decoder and ``events``; the events per piece."""
    decoder, out, at = native.ChatStream(), [], 0
    for size in sizes:
        piece, at = data[at : at + size], at + size
        out.append(b"".join(translation.events(c) for c in decoder.decode(piece)))
    out.append(b"".join(translation.events(c) for c in decoder.flush()) + translation.finish(complete=True))
    return out


def parse(sse):
    """The events of a Responses SSE text, checked against the official SDK's event types."""
    events = []
    for block in sse.decode("utf-8").split("\n\n"):
        if block:
            name, data = block.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert name == f"event: {event['type']}"
            EVENTS[event["type"]].model_validate(event)  # every required field, every literal
            events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def without_ids(value):
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k not in ("id", "created_at")}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


@pytest.mark.parametrize("piece", [1, 7, 64, 100_000], ids=lambda n: f"pieces-of-{n}")
def test_stream_translates_reasoning_text_and_two_calls(piece):
    translation = translate(codex_body())
    data = upstream_bytes(CHUNKS)
    out = play(translation, data, [piece] * (len(data) // piece + 1))  # 1-byte pieces split every UTF-8 character
    events = parse(b"".join(out))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # reasoning
        *["response.reasoning_text.delta"] * 2,
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",  # message
        "response.content_part.added",
        *["response.output_text.delta"] * 2,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # call 1
        *["response.function_call_arguments.delta"] * 2,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",  # call 2
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["model"] == "gpt-5-codex"
    reasoning, message, call1, call2 = final["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert native.read_reasoning(reasoning["encrypted_content"]) == THOUGHT
    assert message["content"][0]["text"] == "Let me look." and message["status"] == "completed"
    assert (call1["call_id"], call1["name"], call1["arguments"]) == ("call_1", "exec_command", '{"cmd": "ls"}')
    assert (call2["call_id"], call2["arguments"]) == ("call_2", '{"cmd": "pwd"}')
    assert final["usage"] == {
        "input_tokens": 30,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 12,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 42,
    }
    Response.model_validate(final)


def test_each_chunk_is_answered_as_it_arrives():
    translation = translate(codex_body())
    due = [
        "response.created",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
    ]
    for c, event in zip(CHUNKS[:9], due, strict=True):
        assert f"event: {event}\n".encode() in translation.events(c)
    assert translation.events(CHUNKS[9]) == translation.events(USAGE) == b""  # the end waits for usage and finish


def test_non_streamed_answer_equals_the_streamed_final_response():
    streamed = translate(codex_body())
    final = parse(b"".join(play(streamed, upstream_bytes(CHUNKS), [10**6])))[-1]["response"]
    plain = translate(codex_body(stream=False))
    assert plain.stream is False
    body = plain.answer(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "served",
            "prompt_token_ids": [1],
            "choices": [{"index": 0, "message": MESSAGE, "finish_reason": "tool_calls", "token_ids": [7]}],
            "usage": USAGE["usage"],
        }
    )
    assert body["id"].startswith("resp_") and body["object"] == "response"
    Response.model_validate(body)
    assert without_ids(body) == without_ids(final)


def test_reasoning_round_trip():
    """What the harness gets back and re-sends arrives upstream as the reasoning the model produced."""
    first = translate(codex_body(input="Write hi."))
    output = first.answer({"choices": [{"message": MESSAGE, "finish_reason": "tool_calls"}]})["output"]
    results = [{"type": "function_call_output", "call_id": c["call_id"], "output": "ok"} for c in output[2:]]
    second = translate(codex_body(input=[{"role": "user", "content": "Write hi."}, *output, *results]))
    user, assistant, *tools = second.chat_body["messages"][1:]
    assert user == {"role": "user", "content": "Write hi."} and assistant == MESSAGE
    assert [t["tool_call_id"] for t in tools] == ["call_1", "call_2"]
    # Without include, the harness still holds the raw reasoning text: that round-trips too.
    plain = translate({"input": "x"}).answer({"choices": [{"message": MESSAGE, "finish_reason": "stop"}]})
    assert "encrypted_content" not in plain["output"][0]
    again = translate({"input": plain["output"]}).chat_body["messages"]
    assert again[0]["reasoning"] == THOUGHT


def test_length_gives_response_incomplete():
    translation = translate(codex_body(max_output_tokens=3))
    out = b"".join(
        translation.events(c)
        for c in [CHUNKS[0], chunk({"content": "Let"}), chunk({"content": " me"}, "length"), USAGE]
    )
    events = parse(out + translation.finish(True))
    last = events[-1]
    assert last["type"] == "response.incomplete" and last["response"]["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    assert last["response"]["status"] == "incomplete" and last["response"]["output"][0]["status"] == "incomplete"


@pytest.mark.parametrize("cut", [0, 4, 7], ids=["before-any-chunk", "mid-text", "mid-call"])
@pytest.mark.parametrize("complete", [False, True], ids=["addon-saw-the-break", "no-finish-reason"])
def test_broken_stream_gives_response_failed(cut, complete):
    translation = translate(codex_body())
    out = b"".join(translation.events(c) for c in CHUNKS[:cut])
    events = parse(out + translation.finish(complete))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["error"]["code"] == "server_error"


def test_a_tool_name_in_pieces_is_joined():
    translation = translate(codex_body())
    pieces = [
        {"index": 0, "id": "call_1", "function": {"name": "exec_"}},
        {"index": 0, "function": {"name": "command", "arguments": "{}"}},
    ]
    out = b"".join(translation.events(chunk({"tool_calls": [p]})) for p in pieces) + translation.events(
        chunk({}, "tool_calls")
    )
    (call,) = parse(out + translation.finish(True))[-1]["response"]["output"]
    assert (call["name"], call["arguments"]) == ("exec_command", "{}")


def test_a_tool_call_resumed_after_another_output_is_refused():
    translation = translate(codex_body())
    translation.events(CHUNKS[5])
    translation.events(chunk({"content": "x"}))
    with pytest.raises(ValueError, match="tool call 0"):
        translation.events(CHUNKS[6])


def test_error_keeps_the_status_message():
    translation = translate(codex_body())
    assert translation.error(503, "busy") == {
        "error": {"message": "busy", "type": "server_error", "param": None, "code": None}
    }
