"""reconstruct/_extract.py: records → calls per API, failed exchanges, ids the upstream lost, native APIs."""

import copy
import json

import pytest
from transformers import AutoTokenizer

from reconstruct import register_native
from reconstruct._calls import Problem
from reconstruct._extract import EXTRACTORS, IDS_DISAGREE, NATIVE_CONVERTERS, extract
from reconstruct._retokenize import Retokenizer
from tests.reconstruct.conftest import S, oracle


@pytest.fixture(scope="module")
def retokenizer(captures):
    return Retokenizer(AutoTokenizer.from_pretrained(captures.model_dir))


@pytest.mark.slow
def test_captured_call_fields(captures):
    record = captures.records(S.streamed)[0]
    (c,) = extract(record, None)
    prompt, ids, logprobs = oracle(record)
    assert (c.prompt.ids(), c.output_ids, c.logprobs) == (prompt, ids, logprobs)
    assert (c.exchange_id, c.session_id, c.api, c.model, c.source) == (
        record["id"],
        S.streamed,
        "chat",
        "tiny",
        "captured",
    )
    assert c.complete and c.finish_reason == "tool_calls" and c.usable and c.notes == []
    assert c.messages == record["request"]["messages"] and c.tools == record["request"]["tools"]
    assert json.loads(c.answer["tool_calls"][0]["function"]["arguments"]) == {"command": "ls"}


@pytest.mark.slow
def test_plain_records_need_a_tokenizer(captures, retokenizer):
    record = captures.records(S.plain_non_streamed)[0]
    (c,) = extract(record, None)
    assert not c.usable and c.problem == Problem.MISSING_IDS
    (c,) = extract(record, retokenizer)
    assert c.usable and c.source == "retokenized" and c.logprobs is None and c.notes == []
    twin = captures.records(S.non_streamed)[0]
    assert (c.prompt.ids(), c.output_ids) == oracle(twin)[:2]


def without_ids(record):
    """The record as a plain upstream would have left it: the same answer, no token fields."""
    body = json.loads(record["response_body"])
    del body["prompt_token_ids"]
    for choice in body["choices"]:
        del choice["token_ids"], choice["logprobs"]
    return {**record, "response_body": json.dumps(body)}


@pytest.mark.slow
def test_a_turn_cut_by_max_tokens_retokenizes_to_the_sampled_count(captures, retokenizer):
    record = captures.records(S.max_tokens)[0]
    (c,) = extract(without_ids(record), retokenizer)
    assert c.finish_reason == "length" and c.output_ids == oracle(record)[1] and c.notes == []


@pytest.mark.slow
def test_failed_exchanges_are_calls_with_a_problem(captures):
    record = captures.records(S.non_streamed)[0]
    failed = {**record, "status": 500, "response_body": json.dumps({"error": {"message": "boom"}}), "complete": True}
    (c,) = extract(failed, None)
    assert c.problem == Problem.ERROR and "500" in c.detail and not c.usable
    gone = {**record, "status": None, "response_body": None, "error": {"kind": "upstream", "message": "refused"}}
    (c,) = extract(gone, None)
    assert c.problem == Problem.ERROR and "refused" in c.detail
    raw = {**record, "request": None, "upstream_request": None, "request_raw": {"text": "not json{"}}
    assert extract(raw, None)[0].problem == Problem.ERROR


@pytest.mark.slow
def test_a_stream_that_lost_ids_falls_back_to_retokenization(captures, retokenizer):
    """vllm#27482: a stream whose chunks carry fewer ids than the usage counts (tool parser, reasoning)."""
    record = copy.deepcopy(captures.records(S.streamed)[0])
    blocks = record["response_body"].split("\n\n")
    holed = [b.replace(', "token_ids": [', ', "dropped": [', 1) if i in (3, 4) else b for i, b in enumerate(blocks)]
    record["response_body"] = "\n\n".join(holed)
    (c,) = extract(record, None)
    assert c.problem == Problem.MISSING_IDS and c.notes == [IDS_DISAGREE]
    (c,) = extract(record, retokenizer)
    assert c.source == "retokenized" and c.output_ids == oracle(captures.records(S.streamed)[0])[1]


@pytest.mark.slow
def test_torn_stream_is_an_incomplete_call(captures):
    record = captures.records(S.streamed)[0]
    body = record["response_body"]
    torn = {**record, "response_body": body[: len(body) // 2], "complete": False}
    (c,) = extract(torn, None)
    assert c.usable and not c.complete and c.output_ids == oracle(record)[1][: len(c.output_ids)]


def test_not_model_calls():
    assert extract({"api": "other", "path": "/v1/models"}, None) is None
    assert extract({"api": "anthropic", "path": "/v1/messages/count_tokens"}, None) is None


@pytest.mark.slow
def test_native_apis_read_their_translated_exchange_or_a_registered_converter(captures):
    record = captures.records(S.non_streamed)[0]
    chat_body = record["request"]
    native = {"model": "tiny", "max_tokens": 100, "system": "You are a coding agent.", "messages": []}
    translated = {
        **record,
        "api": "anthropic",
        "path": "/v1/messages",
        "request": native,
        "upstream_request": chat_body,
        "translated": True,
    }
    (c,) = extract(translated, None)
    assert (c.api, c.prompt.ids(), c.output_ids) == ("anthropic", *oracle(record)[:2])
    untranslated = {**translated, "upstream_request": None, "injected": {}, "translated": False}
    older = {k: v for k, v in translated.items() if k != "translated"}  # written before the field: told by its body
    assert extract(older, None)[0].output_ids == oracle(record)[1]
    (c,) = extract(untranslated, None)
    assert c.problem == Problem.NATIVE
    assert set(EXTRACTORS) == {"chat", "anthropic", "responses", "google"}
    shipped = dict(NATIVE_CONVERTERS)
    register_native("anthropic", lambda r: {**r, "upstream_request": chat_body})
    try:
        (c,) = extract(untranslated, None)
        assert c.usable and c.output_ids == oracle(record)[1]
    finally:
        NATIVE_CONVERTERS.update(shipped)


@pytest.mark.slow
def test_a_call_the_template_cannot_render_is_dropped_with_the_reason(captures):
    tokenizer = AutoTokenizer.from_pretrained(captures.model_dir)
    tokenizer.chat_template = "{{ raise_exception('unsupported role') }}"
    (c,) = extract(captures.records(S.plain_streamed)[0], Retokenizer(tokenizer, eot_id=2))
    assert c.problem == Problem.TEMPLATE and "unsupported role" in c.detail and not c.usable
