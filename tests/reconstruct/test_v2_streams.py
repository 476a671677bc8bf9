"""Capture format v2 reads as v1 (issue 27): a streamed answer stored column-wise (addon/record_v2.py ``Stream``)
gives the reader the very calls its v1 line gives, on the fast path (ids and log-probs from the columns) and off it
(the stream's text built again), for vLLM streams of every shape, streams of other servers and native streams."""

import json
import random

import pytest

from addon import record_v2
from addon.record import encode, to_record
from reconstruct._extract import extract
from reconstruct._io import CaptureIndex
from tests.addon.test_record_v2 import STREAMS, decode, streamed, vllm_events

EMPTY_DELTA = ',"delta":{}'


def odd(events, at, old, new):
    return [e.replace(old, new, 1) if i in at else e for i, e in enumerate(events)]


VARIANTS = {
    **STREAMS,
    "two empty deltas": lambda rng: odd(vllm_events(rng, 30), (4, 9), ',"delta":{"content"', ',"delta":{},"x":{"c"'),
    "no usage": lambda rng: [e for e in vllm_events(rng, 30) if '"usage"' not in e],
    "usage off by one": lambda rng: odd(vllm_events(rng, 30), (31,), '"completion_tokens":30', '"completion_tokens":3'),
    "second choice": lambda rng: odd(vllm_events(rng, 30), (12,), '"index":0', '"index":1'),
    "error event": lambda rng: odd(vllm_events(rng, 30), (15,), "data: {", 'data: {"error":{"message":"x"},'),
    "empty ids": lambda rng: odd(vllm_events(rng, 30), (7,), '"token_ids":[', '"token_ids":[],"t":['),
    "two ids in an event": lambda rng: odd(vllm_events(rng, 30), (8,), '"token_ids":[', '"token_ids":[7, '),
    "escaped finish": lambda rng: odd(vllm_events(rng, 30), (30,), '"finish_reason":"stop"', '"finish_reason":"s\\"t"'),
    "finish mid-stream": lambda rng: odd(vllm_events(rng, 30), (10,), '"finish_reason":null', '"finish_reason":"x"'),
    "nan log-prob": lambda rng: odd(vllm_events(rng, 30), (9,), '"logprob":-', '"logprob":NaN,"y":-'),
    "tool call, reasoning": lambda rng: vllm_events(rng, 40, reasoning=20, tool_call=True),
    "odd and tool call": lambda rng: vllm_events(rng, 40, odd_at=(3, 17), tool_call=True),
}


def calls(records):
    out = []
    for record in records:
        for call in extract(record, None) or []:
            out.append((call.exchange_id, call.prompt and call.prompt.body, call.output_ids, call.logprobs,
                        call.finish_reason, call.complete, call.problem, call.detail, call.notes, call.swallowed,
                        call.usage_prompt, call.answer, call.messages, call.model))  # fmt: skip
    return out


def read(path):
    with CaptureIndex([path]) as index:
        return [record for session in sorted(index.sessions) for record in index.records(session)]


@pytest.mark.parametrize("api", ["chat", "anthropic translated", "anthropic native"])
@pytest.mark.parametrize("shape", sorted(VARIANTS))
def test_a_stream_stored_column_wise_reads_as_its_v1_line(shape, api, tmp_path):
    rng = random.Random(shape)
    name, translated = api.split()[0], api.endswith("translated")
    prompt = list(range(1, 200))
    exchanges = []
    for i in range(4):  # a session whose prompts grow: the v2 records keep their base's prompt ids
        prompt += [rng.randrange(100, 999) for _ in range(30)]
        events = VARIANTS[shape](rng)
        if events[0].startswith("data: {"):
            events[0] = events[0].replace('"prompt_token_ids":[1,2,3]', f'"prompt_token_ids":{json.dumps(prompt)}')
        exchanges.append(streamed(events, t=float(i), api=name, translated=translated))
    (tmp_path / "v1.jsonl").write_bytes(b"".join(encode(ex, decode) for ex in exchanges))
    encoder = record_v2.Encoder()
    (tmp_path / "v2.jsonl").write_bytes(b"".join(b"".join(encoder.encode(to_record(ex, decode))) for ex in exchanges))
    v1, v2 = calls(read(tmp_path / "v1.jsonl")), calls(read(tmp_path / "v2.jsonl"))
    assert v1
    assert repr(v2) == repr(v1)  # (repr: a NaN log-prob equals itself)


@pytest.mark.parametrize(
    "shape",
    ["vllm", "reasoning then content", "tool call at the end", "odd chunks in the middle", "escapes and unicode",
     "tool call, reasoning", "odd and tool call", "finish mid-stream"],
)  # fmt: skip
def test_a_vllm_stream_column_wise_is_read_from_its_columns(shape, tmp_path, monkeypatch):
    rng = random.Random(shape)
    encoder = record_v2.Encoder()
    lines = [b"".join(encoder.encode(to_record(streamed(VARIANTS[shape](rng), t=i), decode))) for i in range(3)]
    (tmp_path / "v2.jsonl").write_bytes(b"".join(lines))
    records = read(tmp_path / "v2.jsonl")

    def text_read(*args):
        raise AssertionError("the stream's text was built and scanned")

    monkeypatch.setattr("reconstruct._chat.ChatAssembler._fast", text_read)
    found = calls(records)[:2]  # (the message of a call is read from its text: calls() asks for it last)
    assert len(found) == 2 and all(call[2] and call[3] for call in found)
