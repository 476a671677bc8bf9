"""addon/apis.py: the wire-API registry, and the pieces the translators share (addon/native.py)."""

import pytest

from addon import apis, native, reroute, session
from reconstruct._extract import EXTRACTORS, NATIVE_CONVERTERS


@pytest.mark.parametrize(
    ("path", "headers", "body", "api"),
    [
        ("/v1/chat/completions", {}, None, "chat"),
        ("/s/run-1/v1/chat/completions/?x=1", {}, None, "chat"),
        ("/v1/messages", {}, None, "anthropic"),
        ("/v1/messages/count_tokens", {}, None, "anthropic"),
        ("/v1/responses", {}, None, "responses"),
        ("/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse", {}, None, "google"),
        ("/", {"anthropic-version": "2023-06-01"}, {"model": "m", "messages": []}, "anthropic"),
        ("/", {"anthropic-version": "2023-06-01"}, None, "other"),  # Claude Code's HEAD / probe
        ("/proxy", {}, {"contents": [], "model": "m", "messages": []}, "google"),
        ("/proxy", {}, {"input": "x", "instructions": "y"}, "responses"),
        ("/proxy", {}, {"model": "m", "messages": []}, "chat"),
        ("/v1/embeddings", {}, {"model": "m", "input": "x"}, "other"),
        ("/v1/completions", {}, {"model": "m", "messages": []}, "other"),
        ("/v1/models", {}, None, "other"),
    ],
)
def test_detect_api_by_path_then_header_then_body(path, headers, body, api):
    assert apis.detect_api(path, headers, body) == api


def test_the_stream_end_is_looked_for_in_the_tail():
    assert apis.stream_ended("anthropic", [b"event: message_stop\ndata: {}\n\n"])
    assert apis.stream_ended("chat", [b"data: {}\n\n", b"data: [DONE]\n\n"])
    assert not apis.stream_ended("chat", [b"data: {}\n\n"])
    assert not apis.stream_ended("other", [b"data: [DONE]\n\n"])


def test_the_other_modules_read_the_registry():
    assert set(reroute.PROVIDER_HOSTS) == {"api.openai.com", "api.anthropic.com", "generativelanguage.googleapis.com"}
    assert set(session.CREDENTIAL_HEADERS) == {"authorization", "x-api-key", "x-goog-api-key"}
    assert all(reroute.is_model_call("POST", api.name) for api in apis.APIS)
    assert not reroute.is_model_call("POST", apis.OTHER) and not reroute.is_model_call("GET", "chat")
    assert set(EXTRACTORS) == set(apis.BY_NAME)
    assert set(NATIVE_CONVERTERS) == set(apis.TRANSLATED) == {"anthropic", "responses", "google"}


def test_chat_delta_reads_either_reasoning_field_of_the_first_choice():
    vllm = {"choices": [{"index": 0, "delta": {"reasoning": "r", "content": "c"}, "token_ids": [1, 2]}]}
    sglang = {"choices": [{"index": 0, "delta": {"reasoning_content": "r", "content": "c"}, "token_ids": [1, 2]}]}
    assert native.chat_delta(vllm) == native.chat_delta(sglang)
    assert native.chat_delta(vllm).token_count == 2
    assert native.chat_delta({"choices": [{"index": 1, "delta": {"content": "n=2"}}]}) is None
    assert native.chat_delta({"choices": [], "usage": {"prompt_tokens": 1}}) is None


def test_tool_calls_gather_pieces_by_index():
    calls = native.ToolCalls()
    pieces = [
        {"index": 0, "id": "call_a", "function": {"name": "run", "arguments": '{"c'}},
        {"index": 1, "id": "call_b", "function": {"name": "read", "arguments": "{}"}},
        {"index": 0, "function": {"arguments": '": 1}'}},
    ]
    for piece in pieces:
        calls.add(piece)
    assert [(c.id, c.name, c.arguments) for c in calls.calls.values()] == [
        ("call_a", "run", '{"c": 1}'),
        ("call_b", "read", "{}"),
    ]
    first = calls.calls[0]
    assert first.unsent() == '{"c": 1}' and first.unsent() == ""


def test_answer_chunk_is_the_answer_as_one_chunk():
    response = {
        "id": "chatcmpl-1",
        "prompt_token_ids": [1, 2],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "reasoning_content": "r", "content": "c", "tool_calls": [{"id": "x"}]},
                "finish_reason": "tool_calls",
                "token_ids": [3],
            }
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1},
    }
    delta = native.chat_delta(native.answer_chunk(response))
    assert (delta.reasoning, delta.content, delta.finish_reason, delta.token_count) == ("r", "c", "tool_calls", 1)
    assert delta.tool_calls == [{"id": "x", "index": 0}]
