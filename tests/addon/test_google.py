"""addon/google.py: Gemini requests to Chat Completions, and the upstream's answer back, chunk by chunk."""

import base64
import json

import pytest
from google.genai import types

from addon import google, native

OPTIONS = native.Options(model="", upstream="vllm")
STREAM_PATH = "/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse"
PATH = "/v1beta/models/gemini-2.5-pro:generateContent"
THOUGHTS = "The user wants a file. Ünïcode 🙂 too."
SHELL = {
    "name": "run_shell_command",
    "description": "Runs a shell command.",
    "parametersJsonSchema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
}


def start(body, path=STREAM_PATH, options=OPTIONS):
    return google.start(body, path, {"x-goog-api-key": "sess"}, options)


def gemini_cli_body():
    """Shaped like Gemini CLI's main turn after one round of two parallel tool calls."""
    return {
        "contents": [
            {"role": "user", "parts": [{"text": "<session_context>\ncwd: /tmp/w\n</session_context>"}]},
            {"role": "model", "parts": [{"text": "Got it. Thanks for the context!"}]},
            {"role": "user", "parts": [{"text": "Write hi into "}, {"text": "out.txt."}]},
            {
                "role": "model",
                "parts": [
                    {"text": THOUGHTS, "thought": True},  # kept by a client that keeps thoughts; the signature wins
                    {
                        "functionCall": {"name": "run_shell_command", "args": {"command": "echo hi > out.txt"}},
                        "thoughtSignature": google.mint_signature(THOUGHTS),
                    },
                    {"functionCall": {"name": "read_file", "args": {"path": "out.txt"}}},
                ],
            },
            {
                "role": "user",
                "parts": [
                    # Gemini CLI invents ids of its own (name-time-random) that no call carried.
                    {
                        "functionResponse": {
                            "id": "read_file-1-abc",
                            "name": "read_file",
                            "response": {"output": "hi\n"},
                        }
                    },
                    {
                        "functionResponse": {
                            "id": "run_shell_command-1-def",
                            "name": "run_shell_command",
                            "response": {"output": ""},
                        }
                    },
                ],
            },
        ],
        "systemInstruction": {"role": "user", "parts": [{"text": "You are an interactive CLI agent."}]},
        "tools": [
            {
                "functionDeclarations": [
                    SHELL,
                    {
                        "name": "read_file",
                        "parameters": {
                            "type": "OBJECT",
                            "properties": {"path": {"type": "STRING", "description": "File."}},
                            "required": ["path"],
                        },
                    },
                ]
            },
            {"googleSearch": {}},
        ],
        "toolConfig": {"functionCallingConfig": {"mode": "AUTO"}},
        "generationConfig": {
            "temperature": 0,
            "topP": 1,
            "topK": 64,
            "maxOutputTokens": 300,
            "stopSequences": ["</end>"],
            "seed": 7,
            "thinkingConfig": {"includeThoughts": True},
        },
    }


def test_gemini_cli_request_becomes_one_chat_request():
    t = start(gemini_cli_body())
    assert t.stream is True
    assert t.chat_body == {
        "model": "gemini-2.5-pro",
        "stream": True,
        "messages": [
            {"role": "system", "content": "You are an interactive CLI agent."},
            {"role": "user", "content": "<session_context>\ncwd: /tmp/w\n</session_context>"},
            {"role": "assistant", "content": "Got it. Thanks for the context!"},
            {"role": "user", "content": "Write hi into out.txt."},
            {
                "role": "assistant",
                "content": None,
                "reasoning": THOUGHTS,
                "tool_calls": [
                    {
                        "id": "call_3_0",
                        "type": "function",
                        "function": {"name": "run_shell_command", "arguments": '{"command": "echo hi > out.txt"}'},
                    },
                    {
                        "id": "call_3_1",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": '{"path": "out.txt"}'},
                    },
                ],
            },
            # Matched by name and order, not by the ids the client made up.
            {"role": "tool", "tool_call_id": "call_3_1", "content": '{"output": "hi\\n"}'},
            {"role": "tool", "tool_call_id": "call_3_0", "content": '{"output": ""}'},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "run_shell_command",
                    "description": "Runs a shell command.",
                    "parameters": SHELL["parametersJsonSchema"],
                },
            },
            {
                "type": "function",
                "function": {
                    "name": "read_file",
                    "parameters": {
                        "type": "object",
                        "properties": {"path": {"type": "string", "description": "File."}},
                        "required": ["path"],
                    },
                },
            },
        ],
        "tool_choice": "auto",
        "temperature": 0,
        "top_p": 1,
        "top_k": 64,
        "max_tokens": 300,
        "stop": ["</end>"],
        "seed": 7,
        "chat_template_kwargs": {"enable_thinking": True},
    }


def test_served_model_replaces_the_paths_but_the_client_sees_its_own():
    t = start({"contents": [{"parts": [{"text": "hi"}]}]}, PATH, native.Options(model="tiny", upstream="vllm"))
    assert t.chat_body["model"] == "tiny" and t.stream is False and "stream" not in t.chat_body
    assert t.answer(upstream_answer(content="hello"))["modelVersion"] == "gemini-2.5-pro"


def test_system_content_and_instruction_merge_into_one_leading_message():
    body = {
        "systemInstruction": "Be brief.",
        "contents": [
            {"role": "user", "parts": [{"text": "hi"}]},
            {"role": "system", "parts": [{"text": "Late rule."}]},
        ],
    }
    assert start(body).chat_body["messages"] == [
        {"role": "system", "content": "Be brief.\n\nLate rule."},
        {"role": "user", "content": "hi"},
    ]


def test_tool_choice_is_dropped_without_tools_and_any_becomes_required():
    only_search = {
        "contents": [{"parts": [{"text": "hi"}]}],
        "tools": [{"googleSearch": {}}],
        "toolConfig": {"functionCallingConfig": {"mode": "ANY"}},
    }
    assert "tools" not in start(only_search).chat_body and "tool_choice" not in start(only_search).chat_body
    body = {**only_search, "tools": [{"functionDeclarations": [SHELL]}]}
    assert start(body).chat_body["tool_choice"] == "required"
    body["toolConfig"]["functionCallingConfig"]["allowedFunctionNames"] = ["run_shell_command"]
    assert start(body).chat_body["tool_choice"] == {"type": "function", "function": {"name": "run_shell_command"}}


def test_schema_types_are_lower_cased_but_data_is_not():
    schema = {
        "type": "OBJECT",
        "properties": {
            "type": {"type": "STRING", "enum": ["OBJECT", "A"]},
            "items": {"type": "ARRAY", "items": {"type": "INTEGER"}},
        },
        "anyOf": [{"type": "NUMBER"}],
        "required": ["type"],
    }
    assert google._schema(schema) == {
        "type": "object",
        "properties": {
            "type": {"type": "string", "enum": ["OBJECT", "A"]},
            "items": {"type": "array", "items": {"type": "integer"}},
        },
        "anyOf": [{"type": "number"}],
        "required": ["type"],
    }


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"responseMimeType": "application/json"}, {"type": "json_object"}),
        (
            {"responseMimeType": "application/json", "responseSchema": {"type": "OBJECT"}},
            {"type": "json_schema", "json_schema": {"name": "response", "schema": {"type": "object"}}},
        ),
        (
            {"responseMimeType": "application/json", "responseJsonSchema": {"type": "array"}},
            {"type": "json_schema", "json_schema": {"name": "response", "schema": {"type": "array"}}},
        ),
        ({"responseMimeType": "text/plain"}, None),
    ],
)
def test_response_format(config, expected):
    chat = start({"contents": [{"parts": [{"text": "hi"}]}], "generationConfig": config}).chat_body
    assert chat.get("response_format") == expected


def test_thinking_budget_zero_switches_thinking_off():
    body = {"contents": [{"parts": [{"text": "hi"}]}], "generationConfig": {"thinkingConfig": {"thinkingBudget": 0}}}
    assert start(body).chat_body["chat_template_kwargs"] == {"enable_thinking": False}
    assert "chat_template_kwargs" not in start({"contents": body["contents"]}).chat_body


def test_snake_case_field_names_count_too():
    """Google accepts both spellings; google-genai 2.x sends thinkingConfig's fields in snake_case."""
    body = {
        "contents": [{"parts": [{"text": "hi"}]}],
        "system_instruction": {"parts": [{"text": "Be brief."}]},
        "generation_config": {"max_output_tokens": 9, "thinkingConfig": {"include_thoughts": True}},
    }
    t = start(body)
    assert (
        t.include_thoughts
        and t.chat_body["max_tokens"] == 9
        and t.chat_body["chat_template_kwargs"] == {"enable_thinking": True}
    )
    assert t.chat_body["messages"][0] == {"role": "system", "content": "Be brief."}


def test_images_become_image_parts_and_tool_results_come_first():
    parts = [
        {"text": "Look:"},
        {"inlineData": {"mimeType": "image/png", "data": "iVBO"}},
        {"functionResponse": {"name": "x", "response": {}}},
    ]
    messages = start({"contents": [{"role": "user", "parts": parts}]}).chat_body["messages"]
    assert messages == [
        {"role": "tool", "tool_call_id": "call_0_r0", "content": "{}"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
            ],
        },
    ]


def test_foreign_signatures_are_dropped_and_ours_decode_in_either_alphabet():
    sdk_resent = base64.urlsafe_b64encode(base64.b64decode(google.mint_signature(THOUGHTS))).decode()
    for signature, reasoning in [
        (sdk_resent, THOUGHTS),
        ("CiQB0e2Kb3fOreign==", None),
        ("skip_thought_signature_validator", None),
        (native.mint_reasoning("raw"), None),
    ]:
        body = {
            "contents": [
                {"parts": [{"text": "q"}]},
                {"role": "model", "parts": [{"text": "a", "thoughtSignature": signature}]},
            ]
        }
        assert start(body).chat_body["messages"][1].get("reasoning") == reasoning


@pytest.mark.parametrize(
    ("body", "path", "match"),
    [
        (
            {"contents": [{"parts": [{"text": "hi"}]}], "generationConfig": {"candidateCount": 2}},
            STREAM_PATH,
            "candidateCount",
        ),
        ({"contents": [{"parts": [{"text": "hi"}]}]}, "/v1beta/models/m:streamGenerateContent", "alt=sse"),
        ({"contents": [{"parts": [{"text": "hi"}]}]}, "/v1beta/models/m:countTokens", "generateContent"),
        ({"contents": []}, STREAM_PATH, "contents"),
        ({"contents": [{"role": "critic", "parts": []}]}, STREAM_PATH, "role"),
        ({"contents": [{"parts": [{"fileData": {"fileUri": "gs://b/f"}}]}]}, STREAM_PATH, "fileData"),
        ({"contents": [{"parts": "hi"}]}, STREAM_PATH, "parts"),
        (
            {"contents": [{"parts": [{"text": "hi"}]}], "cachedContent": "cachedContents/x"},
            STREAM_PATH,
            "cachedContent",
        ),
    ],
)
def test_untranslatable_requests_are_refused(body, path, match):
    with pytest.raises(native.BadRequest, match=match):
        start(body, path)


@pytest.mark.parametrize(
    ("status", "name"),
    [
        (400, "INVALID_ARGUMENT"),
        (429, "RESOURCE_EXHAUSTED"),
        (500, "INTERNAL"),
        (503, "UNAVAILABLE"),
        (504, "DEADLINE_EXCEEDED"),
        (418, "INVALID_ARGUMENT"),
        (599, "INTERNAL"),
    ],
)
def test_error_body_names_the_status(status, name):
    assert google.error_body(status, "nope") == {"error": {"code": status, "message": "nope", "status": name}}


def test_context_length_error_reads_like_geminis():
    t = start({"contents": [{"parts": [{"text": "hi"}]}]})
    message = t.error(400, "This model's maximum context length is 2048 tokens.")["error"]["message"]
    assert (
        message.startswith("The input token count exceeds the maximum number of tokens allowed.") and "2048" in message
    )


# --- the answer, streamed ---------------------------------------------------------------------


def chunk(delta=None, finish=None, **extra):
    choice = {
        "index": 0,
        "delta": delta or {},
        "logprobs": {"content": [{"token": "x", "logprob": -0.1}]},
        "finish_reason": finish,
        "token_ids": [5],
    }
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice], **extra}


USAGE = {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52}
CALL_1 = '{"command": "echo hi > out.txt"}'
CALL_2 = '{"path": "out.txt"}'
THOUGHTS_THEN_TEXT_THEN_TWO_CALLS = [
    chunk({"role": "assistant", "content": ""}, prompt_token_ids=[1, 2, 3]),
    chunk({"reasoning": THOUGHTS[:9]}),
    chunk({"reasoning": THOUGHTS[9:]}),
    chunk({"content": "I'll write it."}),
    chunk(
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "run_shell_command", "arguments": ""},
                }
            ]
        }
    ),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": CALL_1[:13]}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": CALL_1[13:]}}]}),
    chunk(
        {
            "tool_calls": [
                {
                    "index": 1,
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": CALL_2[:-1]},
                }
            ]
        }
    ),
    chunk({"tool_calls": [{"index": 1, "function": {"arguments": CALL_2[-1:]}}]}, finish="tool_calls"),
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [], "usage": USAGE},
]


def sse_bytes(chunks):
    return (
        b"".join(b"data: " + json.dumps(c, ensure_ascii=False).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    )


def events_of(data):
    """The GenerateContentResponse events in native SSE bytes, checked by the SDK's own model."""
    blocks = [b for b in data.decode().split("\n\n") if b]
    assert all(b.startswith("data: ") for b in blocks)
    events = [json.loads(b[6:]) for b in blocks]
    for event in events:
        if "error" not in event:
            types.GenerateContentResponse.model_validate(event)
    return events


def translate_stream(t, data, split):
    """Feed the upstream bytes in pieces of ``split`` bytes, as the addon's tee does; the bytes per piece."""
    decoder = native.ChatStream()
    out = [b"".join(t.events(c) for c in decoder.decode(data[i : i + split])) for i in range(0, len(data), split)]
    out.append(b"".join(t.events(c) for c in decoder.flush()) + t.finish(complete=True))
    return out


def parts_of(events):
    return [p for e in events for c in e.get("candidates", []) for p in (c.get("content") or {}).get("parts", [])]


@pytest.mark.parametrize("split", [1, 3, 7, 64, 100_000])
def test_stream_of_thoughts_text_and_two_calls(split):
    """Split anywhere (mid-UTF-8, mid-separator, mid-JSON): the same events come out."""
    t = start(gemini_cli_body())
    events = events_of(b"".join(translate_stream(t, sse_bytes(THOUGHTS_THEN_TEXT_THEN_TWO_CALLS), split)))
    assert parts_of(events) == [
        {"text": THOUGHTS[:9], "thought": True},
        {"text": THOUGHTS[9:], "thought": True},
        {"text": "I'll write it.", "thoughtSignature": google.mint_signature(THOUGHTS)},
        {"functionCall": {"name": "run_shell_command", "args": {"command": "echo hi > out.txt"}}},
        {"functionCall": {"name": "read_file", "args": {"path": "out.txt"}}},
    ]
    last = events[-1]
    assert last["candidates"][0]["finishReason"] == "STOP"
    assert last["usageMetadata"] == {"promptTokenCount": 40, "candidatesTokenCount": 12, "totalTokenCount": 52}
    assert all("finishReason" not in e["candidates"][0] for e in events[:-1])
    assert {(e["modelVersion"], e["responseId"]) for e in events} == {("gemini-2.5-pro", t.response_id)}


def test_each_part_goes_out_as_its_chunk_arrives():
    t = start(gemini_cli_body())
    out = [t.events(c) for c in THOUGHTS_THEN_TEXT_THEN_TWO_CALLS]
    assert out[0] == b""  # the role chunk carries nothing to say
    assert [len(parts_of(events_of(b))) for b in out[1:4]] == [1, 1, 1]
    assert out[4] == out[5] == b""  # a call goes out once its arguments are complete JSON, not before
    assert parts_of(events_of(out[6])) == [
        {"functionCall": {"name": "run_shell_command", "args": {"command": "echo hi > out.txt"}}}
    ]
    assert out[7] == b"" and parts_of(events_of(out[8]))[0]["functionCall"]["name"] == "read_file"
    assert events_of(out[9])[-1]["candidates"][0]["finishReason"] == "STOP"  # the usage chunk closes the answer
    assert t.finish(complete=True) == b""


def test_truncated_answer_is_max_tokens_and_drops_the_unfinished_call():
    t = start(gemini_cli_body())
    data = b"".join(
        t.events(c)
        for c in [
            chunk({"content": "Let me"}),
            chunk(
                {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "read_file", "arguments": '{"pa'}}]},
                finish="length",
            ),
            {"choices": [], "usage": USAGE},
        ]
    )
    events = events_of(data)
    assert parts_of(events) == [{"text": "Let me"}] and events[-1]["candidates"][0]["finishReason"] == "MAX_TOKENS"


def test_unparseable_call_is_a_malformed_function_call():
    t = start(gemini_cli_body())
    data = t.events(
        chunk(
            {"tool_calls": [{"index": 0, "function": {"name": "read_file", "arguments": "{path: x}"}}]},
            finish="tool_calls",
        )
    )
    events = events_of(data + t.finish(complete=True))
    assert parts_of(events) == [] and events[-1]["candidates"][0]["finishReason"] == "MALFORMED_FUNCTION_CALL"


def test_thoughts_alone_still_return_their_signature_on_a_final_part():
    t = start(
        {"contents": [{"parts": [{"text": "hi"}]}]}
    )  # no includeThoughts: no thought parts, the signature all the same
    assert t.events(chunk({"reasoning": "hmm"}, finish="stop")) == b""
    events = events_of(t.finish(complete=True))
    assert parts_of(events) == [{"text": "", "thoughtSignature": google.mint_signature("hmm")}]
    assert events[-1]["usageMetadata"] == {"promptTokenCount": 0, "candidatesTokenCount": 0, "totalTokenCount": 0}


@pytest.mark.parametrize(("cut", "complete"), [(0, False), (4, False), (8, False), (8, True)])
def test_broken_stream_ends_with_an_error_event(cut, complete):
    """Broken off, or ended cleanly without a finish reason: the SDK raises either way."""
    t = start(gemini_cli_body())
    data = b"".join(t.events(c) for c in THOUGHTS_THEN_TEXT_THEN_TWO_CALLS[:cut])
    data += t.finish(complete=complete)
    assert events_of(data)[-1] == {
        "error": {
            "code": 500,
            "message": "the upstream stream broke off before the answer was complete",
            "status": "INTERNAL",
        }
    }
    assert t.finish(complete=False) == b"" and t.events(chunk({"content": "late"})) == b""


def test_upstream_error_mid_stream_keeps_its_code():
    t = start(gemini_cli_body())
    t.events(chunk({"content": "a"}))
    events = events_of(t.events({"error": {"message": "overloaded", "code": 503}}))
    assert events == [{"error": {"code": 503, "message": "overloaded", "status": "UNAVAILABLE"}}]
    assert t.finish(complete=True) == b""


# --- the answer, not streamed -------------------------------------------------------------------


def upstream_answer(content=None, reasoning=None, calls=(), finish="stop", usage=USAGE):
    tool_calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(calls)
    ]
    message = {"role": "assistant", "content": content, "reasoning": reasoning, "tool_calls": tool_calls}
    choice = {"index": 0, "message": message, "finish_reason": finish, "token_ids": [5, 6], "logprobs": {"content": []}}
    return {
        "id": "chatcmpl-9",
        "object": "chat.completion",
        "choices": [choice],
        "usage": usage,
        "prompt_token_ids": [1],
    }


def test_answer_is_a_full_generate_content_response_equal_to_the_stream():
    t = start(gemini_cli_body(), PATH)
    body = t.answer(
        upstream_answer(
            "I'll write it.", THOUGHTS, [("run_shell_command", CALL_1), ("read_file", CALL_2)], "tool_calls"
        )
    )
    types.GenerateContentResponse.model_validate(body)
    assert body == {
        "candidates": [
            {
                "content": {
                    "role": "model",
                    "parts": [
                        {"text": THOUGHTS, "thought": True},
                        {"text": "I'll write it.", "thoughtSignature": google.mint_signature(THOUGHTS)},
                        {"functionCall": {"name": "run_shell_command", "args": {"command": "echo hi > out.txt"}}},
                        {"functionCall": {"name": "read_file", "args": {"path": "out.txt"}}},
                    ],
                },
                "finishReason": "STOP",
                "index": 0,
            }
        ],
        "usageMetadata": {"promptTokenCount": 40, "candidatesTokenCount": 12, "totalTokenCount": 52},
        "modelVersion": "gemini-2.5-pro",
        "responseId": t.response_id,
    }
    streamed = parts_of(
        events_of(b"".join(translate_stream(start(gemini_cli_body()), sse_bytes(THOUGHTS_THEN_TEXT_THEN_TWO_CALLS), 5)))
    )
    thought = "".join(p["text"] for p in streamed if p.get("thought"))
    assert [{"text": thought, "thought": True}] + [p for p in streamed if not p.get("thought")] == body["candidates"][
        0
    ]["content"]["parts"]


def test_answer_usage_reports_reasoning_and_cached_tokens():
    usage = {
        **USAGE,
        "completion_tokens_details": {"reasoning_tokens": 5},
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    body = start({"contents": [{"parts": [{"text": "hi"}]}]}, PATH).answer(
        upstream_answer("ok", usage=usage, finish="length")
    )
    assert body["usageMetadata"] == {
        "promptTokenCount": 40,
        "candidatesTokenCount": 7,
        "totalTokenCount": 52,
        "thoughtsTokenCount": 5,
        "cachedContentTokenCount": 32,
    }
    assert body["candidates"][0]["finishReason"] == "MAX_TOKENS"


def test_reasoning_round_trip_through_the_sdks_own_types():
    """What the SDK makes of our answer, sent back as history, gives the upstream the sampled reasoning."""
    t = start(gemini_cli_body(), PATH)
    answer = types.GenerateContentResponse.model_validate(
        t.answer(upstream_answer(None, THOUGHTS, [("run_shell_command", CALL_1)], "tool_calls"))
    )
    kept = [
        p for p in answer.candidates[0].content.parts if not p.thought
    ]  # Gemini CLI drops thought parts from history
    model_turn = types.Content(role="model", parts=kept).model_dump(mode="json", by_alias=True, exclude_none=True)
    reply = {"role": "user", "parts": [{"functionResponse": {"name": "run_shell_command", "response": {"output": ""}}}]}
    messages = start({"contents": [{"parts": [{"text": "Write hi."}]}, model_turn, reply]}).chat_body["messages"]
    assert (
        messages[1]["reasoning"] == THOUGHTS and messages[1]["tool_calls"][0]["function"]["name"] == "run_shell_command"
    )
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1_0", "content": '{"output": ""}'}
