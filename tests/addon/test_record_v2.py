"""Capture format v2 (addon/record_v2.py): each record expands to the very v1 line of its call, a session's records
cost about what is new in them, and a lost record costs at most FULL_EVERY - 1 later records of its session."""

import base64
import itertools
import json
import random
import zlib

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
    assert [i for i, r in enumerate(lines) if r["base"] is None or "zf" in r] == [0, 16, 32]
    assert lines[0]["base"] is None and "zf" not in lines[0]  # the session's first: nothing to refer to
    for before, after in itertools.pairwise(lines):
        assert after["base"] == before["id"]
        assert after["v"] == 2 and after["request_keep"] > 0


def test_a_full_record_reads_as_a_delta_after_its_base_and_whole_without_it():
    """A full record is written as a delta of the session's previous record plus its own copy of what it keeps
    (``zf``): a reader that has that base never inflates ``zf``; one that lost it reads the record whole."""
    exchanges = session(random.Random(6), 18)
    v1 = [encode(ex, decode)[:-1] for ex in exchanges]
    lines = [json.loads(line) for line in v2_lines(exchanges)]
    full = lines[16]
    assert "zf" in full and full["base"] == lines[15]["id"]
    expander = record_v2.Expander()
    for record in lines[:16]:
        expander.expand(record)
    assert expander.expand({**full, "zf": "not read"}) == v1[16]  # read on its base: zf untouched
    assert expander.expand(lines[17]) == v1[17]
    alone = record_v2.Expander()  # its base lost: it reads from zf, and so does the next
    assert [alone.expand(r) for r in lines[16:]] == v1[16:]
    with pytest.raises(ValueError, match="zf"):
        record_v2.Expander().expand({**full, "zf": base64.b64encode(zlib.compress(b"short")).decode()})


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


# ---------------------------------------------------------------- a streamed answer stored column-wise


def vllm_events(rng, n_tokens, *, prompt=(1, 2, 3), reasoning=0, tool_call=False, odd_at=(), unicode=False):
    """A vLLM stream as its server writes it (compact JSON): the role chunk with the prompt ids, one chunk a token
    (reasoning first, then content), a tool call, the finish, the usage chunk and [DONE]."""
    head = {"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 1700000000, "model": "m"}
    dump = lambda obj: "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"  # noqa: E731
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    events = [dump({**head, "choices": [role], "prompt_token_ids": list(prompt)})]
    for k in range(n_tokens):
        token = rng.randrange(50_000)
        text = f'é{token}"✓\\' if unicode and k % 3 == 0 else f"w{token} "
        delta = {"reasoning" if k < reasoning else "content": text}
        if k in odd_at:  # a chunk of another shape: kept raw, in the middle of the templated ones
            delta = {"content": text, "extra": [1, {"x": None}]}
        finish = "stop" if k == n_tokens - 1 and not tool_call else None
        lp = {"content": [{"token": text, "logprob": -rng.random(), "bytes": [119, 48], "top_logprobs": []}]}
        choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish, "token_ids": [token]}
        events.append(dump({**head, "choices": [choice]}))
    if tool_call:
        call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
        choice = {"index": 0, "delta": {"tool_calls": [call]}, "logprobs": {"content": [
            {"token": "<tc>", "logprob": -0.5, "bytes": [60], "top_logprobs": []}]},
            "finish_reason": "tool_calls", "token_ids": [7]}  # fmt: skip
        events.append(dump({**head, "choices": [choice]}))
    usage = {"prompt_tokens": len(prompt), "completion_tokens": n_tokens + tool_call, "total_tokens": 0}
    events.append(dump({**head, "choices": [], "usage": usage}))
    return [*events, "data: [DONE]\n\n"]


def anthropic_events(rng, n_tokens):
    """A native Anthropic Messages stream (named events), as a call passed through untranslated records it."""
    out = ['event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","role":"assistant"}}\n\n']
    for _ in range(n_tokens):
        delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": f"w{rng.random()}"}}
        out.append("event: content_block_delta\ndata: " + json.dumps(delta) + "\n\n")
    return [*out, 'event: message_stop\ndata: {"type":"message_stop"}\n\n']


STREAMS = {
    "vllm": lambda rng: vllm_events(rng, 40),
    "reasoning then content": lambda rng: vllm_events(rng, 40, reasoning=15),
    "tool call at the end": lambda rng: vllm_events(rng, 30, tool_call=True),
    "odd chunks in the middle": lambda rng: vllm_events(rng, 40, odd_at=(5, 6, 20)),
    "escapes and unicode": lambda rng: vllm_events(rng, 40, unicode=True),
    "json.dumps spacing": lambda rng: [e.decode() for e in sse(rng, 40)],
    "anthropic native": lambda rng: anthropic_events(rng, 40),
    "crlf": lambda rng: [e.replace("\n", "\r\n") for e in vllm_events(rng, 20)],
    "torn": lambda rng: [*vllm_events(rng, 30)[:-3], 'data: {"id":"chatcmpl-9","choi'],
    "short": lambda rng: vllm_events(rng, 3),
    "not sse": lambda rng: ['{"id": "x", "choices": []}'],
}


def streamed(events, *, sid="s1", t=0.0, api="chat", translated=False):
    chunks = [e.encode() for e in events]
    body = Body.parse(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi " * 100}]}).encode())
    upstream = Body.parse(json.dumps({"model": "m", "messages": [], "stream": True}).encode()) if translated else None
    return Exchange(session_id=sid, session_source="header", api=api, upstream="vllm", method="POST",
                    path="/v1/chat/completions", t_start=t, request_headers={}, request=body,
                    upstream_request=upstream, translated=translated, status=200, streamed=True,
                    response_headers={"content-type": "text/event-stream"}, t_first_byte=t, t_end=t + 1,
                    chunks=chunks, chunk_times=[t + 0.5] * len(chunks), complete=True)  # fmt: skip


@pytest.mark.parametrize("shape", sorted(STREAMS))
def test_a_stream_of_any_shape_expands_to_its_v1_line(shape):
    rng = random.Random(shape)
    exchanges = [streamed(STREAMS[shape](rng), t=i) for i in range(3)]
    expander = record_v2.Expander()
    assert [expander.expand(json.loads(line)) + b"\n" for line in v2_lines(exchanges)] == [
        encode(ex, decode) for ex in exchanges
    ]


@pytest.mark.parametrize(
    ("shape", "raw_events"),
    [("vllm", 3), ("reasoning then content", 3), ("tool call at the end", 4), ("odd chunks in the middle", 6),
     ("anthropic native", 2), ("escapes and unicode", 3)],
)  # fmt: skip
def test_a_stream_is_stored_column_wise_with_the_events_that_fit_no_template_kept_raw(shape, raw_events):
    text = "".join(STREAMS[shape](random.Random(shape)))
    raw, stream = record_v2.split_stream(text)
    assert stream.text(raw) == text
    assert raw.count("\n\n") == raw_events  # the role chunk, the usage chunk, [DONE] and what has another shape
    assert stream.n == text.count("\n\n") - raw_events


@pytest.mark.parametrize("shape", ["crlf", "short", "not sse", "torn"])
def test_streams_that_fit_no_template_stay_text(shape):
    text = "".join(STREAMS[shape](random.Random(shape)))
    found = record_v2.split_stream(text)
    assert found is None or found[1].text(found[0]) == text


def test_a_stream_costs_less_column_wise():
    exchanges = [streamed(vllm_events(random.Random(i), 300), t=i) for i in range(4)]
    lines = [json.loads(line) for line in v2_lines(exchanges)]
    assert all(len(line["sizes"]) == 3 for line in lines)  # stored column-wise
    encoder = record_v2.Encoder()
    plain = 0
    for ex in exchanges:  # the same records with the stream kept as text
        record = to_record(ex, decode)
        record.head["streamed"] = False
        plain += len(b"".join(encoder.encode(record)))
    assert sum(len(json.dumps(line)) for line in lines) < plain


def test_a_malformed_stream_part_is_an_error_naming_the_field():
    (line,) = v2_lines([streamed(vllm_events(random.Random(7), 20))])
    record = json.loads(line)
    data = zlib.decompress(base64.b64decode(record["z"]))
    record["z"] = base64.b64encode(zlib.compress(data[: data.rindex(b"\n")])).decode()  # a value lost
    with pytest.raises(ValueError, match="malformed v2 fields"):
        record_v2.Expander().expand(record)
