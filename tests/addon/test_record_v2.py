"""Capture format v2 (addon/record_v2.py): each record expands to the very v1 line of its call, a session's records
cost about what is new in them, and a lost record costs at most FULL_EVERY - 1 later records of its session."""

import itertools
import json
import random

import pytest

from addon import record_v2
from addon.record import Body, Exchange, encode, to_record


def sse(rng, n_tokens):
    """A vLLM-shaped stream: one chunk a token, with its id and log-prob, as the proxy tees it."""
    chunks = []
    for _ in range(n_tokens):
        token = rng.randrange(50_000)
        event = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m",
                 "choices": [{"index": 0, "delta": {"content": f"w{token} "}, "token_ids": [token],
                              "logprobs": {"content": [{"token": f"w{token}", "logprob": -rng.random(),
                                                        "bytes": [119, 48]}]}}]}  # fmt: skip
        chunks.append(b"data: " + json.dumps(event).encode() + b"\n\n")
    return [*chunks, b"data: [DONE]\n\n"]


def session(rng, calls, *, sid="s1", start=0.0):
    """Exchanges of an agent session: each request resends the history and adds a turn."""
    messages = [{"role": "system", "content": "You are an agent. " * 50}]
    out = []
    for i in range(calls):
        messages.append({"role": "user", "content": f"turn {i}: " + "x" * rng.randrange(100, 400)})
        body = json.dumps({"model": "m", "messages": messages, "stream": True}).encode()
        chunks = sse(rng, 30)
        ex = Exchange(session_id=sid, session_source="header", api="chat", upstream="vllm", method="POST",
                      path="/v1/chat/completions", t_start=start + i, request_headers={"user-agent": "t"},
                      request=Body.parse(body), injected={"logprobs": True}, status=200, streamed=True,
                      response_headers={"content-type": "text/event-stream"}, t_first_byte=start + i + 0.1,
                      t_end=start + i + 0.5, chunks=chunks, chunk_times=[start + i + 0.2] * len(chunks),
                      complete=True)  # fmt: skip
        out.append(ex)
        messages.append({"role": "assistant", "content": "".join(f"w{k} " for k in range(30))})
    return out


def decode(data, encoding):
    raise AssertionError("nothing here is content-encoded")


def v2_lines(exchanges):
    encoder = record_v2.Encoder()
    return [b"".join(encoder.encode(to_record(ex, decode))) for ex in exchanges]


def test_every_v2_record_expands_to_the_v1_line_of_its_call_byte_for_byte():
    rng = random.Random(0)
    exchanges = [ex for pair in zip(session(rng, 40), session(rng, 40, sid="s2"), strict=True) for ex in pair]
    v1 = [encode(ex, decode) for ex in exchanges]
    expander = record_v2.Expander()
    assert [expander.expand(json.loads(line)) + b"\n" for line in v2_lines(exchanges)] == v1


def test_a_session_costs_about_what_is_new_in_it():
    exchanges = session(random.Random(1), 50)
    v1 = sum(len(encode(ex, decode)) for ex in exchanges)
    v2 = sum(map(len, v2_lines(exchanges)))
    # Random log-probs and a short history make this a hard case; the bench's long sessions give ~1/10 and below.
    assert v2 / v1 < 0.15, (v1, v2)


def test_a_full_record_every_k_calls_and_deltas_in_between_refer_to_the_previous():
    lines = [json.loads(line) for line in v2_lines(session(random.Random(2), 40))]
    assert [i for i, r in enumerate(lines) if r["base"] is None] == [0, 16, 32]
    for before, after in itertools.pairwise(lines):
        assert after["base"] in (None, before["id"])
        assert after["v"] == 2 and (after["base"] is None or after["request_keep"] > 0)


@pytest.mark.parametrize("lost", [0, 5, 15])
def test_a_lost_record_loses_at_most_the_records_up_to_the_next_full_one_of_its_session(lost):
    rng = random.Random(3)
    exchanges = [ex for pair in zip(session(rng, 20), session(rng, 20, sid="s2"), strict=True) for ex in pair]
    v1 = [encode(ex, decode)[:-1] for ex in exchanges]
    lines = [json.loads(line) for line in v2_lines(exchanges)]
    gone = 2 * lost  # session s1's record number `lost`
    expander = record_v2.Expander()
    got, unresolved = {}, []
    for i, record in enumerate(lines):
        if i == gone:
            continue
        try:
            got[i] = expander.expand(record)
        except record_v2.Unresolved:
            unresolved.append(i)
    assert unresolved == list(range(gone + 2, 32, 2))  # s1's calls after it, up to its full 16th
    assert all(got[i] == v1[i] for i in got)  # never misbuilt
    assert len(unresolved) <= record_v2.FULL_EVERY - 1


def test_a_malformed_v2_record_is_an_error_naming_the_field():
    (record,) = [json.loads(line) for line in v2_lines(session(random.Random(4), 1))]
    record["z"] = "not base64!"
    with pytest.raises(ValueError, match="malformed v2 fields"):
        record_v2.Expander().expand(record)


def test_the_encoder_keeps_a_bounded_number_of_bytes_and_a_dropped_session_starts_full():
    rng = random.Random(5)
    exchanges = [ex for pair in zip(session(rng, 3), session(rng, 3, sid="s2"), strict=True) for ex in pair]
    records = [to_record(ex, decode) for ex in exchanges]
    encoder = record_v2.Encoder(keep_bytes=len(records[0].request) + len(records[1].request) // 2)  # one session
    lines = [json.loads(b"".join(encoder.encode(r))) for r in records]
    assert [r["base"] is None for r in lines] == [True] * 6  # s1 and s2 push each other out
    expander = record_v2.Expander()
    assert [expander.expand(r) + b"\n" for r in lines] == [encode(ex, decode) for ex in exchanges]
