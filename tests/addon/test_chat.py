import json

import pytest

from addon.chat import error_body, is_chat_path, splice, token_fields


def test_vllm_fields_non_streamed():
    assert token_fields({"messages": []}, "vllm") == {"logprobs": True, "top_logprobs": 0, "return_token_ids": True}


def test_vllm_fields_streamed_adds_usage():
    added = token_fields({"messages": [], "stream": True}, "vllm")
    assert added["stream_options.include_usage"] is True


def test_client_fields_are_never_changed():
    body = {"stream": True, "logprobs": True, "top_logprobs": 5, "stream_options": {"include_usage": False}}
    assert token_fields(body, "vllm") == {"return_token_ids": True}


def test_client_logprobs_false_is_respected():
    added = token_fields({"logprobs": False}, "vllm")
    assert "logprobs" not in added and "top_logprobs" not in added


def test_sglang_stream_uses_sglext():
    added = token_fields({"stream": True}, "sglang")
    assert added["return_output_ids_in_sglext"] and "return_token_ids" not in added
    assert token_fields({}, "sglang")["return_meta_info"] is True


def test_plain_adds_nothing():
    assert token_fields({"stream": True}, "plain") == {}


@pytest.mark.parametrize("text", ['{"stream": true, "messages": []}', '  {\n"stream":true}', "{}", "{ }"])
def test_splice_adds_fields_without_touching_the_rest(text):
    body = json.loads(text)
    added = token_fields(body, "vllm")
    sent, pure = splice(text.encode(), body, added)
    assert pure
    expected = dict(body, logprobs=True, top_logprobs=0, return_token_ids=True)
    if body.get("stream"):
        expected["stream_options"] = {"include_usage": True}
    assert json.loads(sent) == expected
    assert sent.endswith(text.lstrip()[1:].encode())  # the client's bytes follow unchanged


def test_splice_into_clients_own_object_redumps():
    body = {"stream": True, "stream_options": {"continuous_usage_stats": True}}
    sent, pure = splice(json.dumps(body).encode(), body, token_fields(body, "vllm"))
    assert not pure
    assert json.loads(sent)["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}


def test_paths_and_error_shape():
    assert is_chat_path("/v1/chat/completions") and is_chat_path("/chat/completions/?a=1")
    assert not is_chat_path("/v1/completions")
    assert error_body(502, "down")["error"] == {"message": "down", "type": "upstream_error", "param": None, "code": 502}
