"""What real vLLM sends that the reference server did not (issue 15), in hand-written records: text its tool-call
parser swallowed from a stream, and calls decoded under a constraint. tests/vllm/ checks the same on vLLM itself."""

import json

import pytest

from reconstruct._extract import CONSTRAINED, extract
from reconstruct._merge import merge

PROMPT = [1, 4093, 198, 50, 2, 198, 1, 520, 198]


def chunk(delta, ids, *, finish=None, logprob=-0.5):
    choice = {"index": 0, "delta": delta, "logprobs": {"content": [{"token": "x", "logprob": logprob}] * len(ids)}}
    return {"choices": [{**choice, "finish_reason": finish, "token_ids": ids}]}


def stream(chunks, *, prompt, separators=(",", ":")):
    first = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "prompt_token_ids": prompt}
    n = sum(len(c["choices"][0]["token_ids"]) for c in chunks)
    usage = {"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": n}}
    events = [first, *chunks, usage]
    return "".join(f"data: {json.dumps(e, separators=separators)}\n\n" for e in events) + "data: [DONE]\n\n"


def record(rid, body, *, t, request=None, **fields):
    request = request or {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    return {
        "v": 1,
        "id": rid,
        "session_id": "s",
        "api": "chat",
        "path": "/v1/chat/completions",
        "status": 200,
        "streamed": True,
        "complete": True,
        "error": None,
        "t_start": t,
        "injected": {},
        "translated": False,
        "request": request,
        "upstream_request": None,
        "response_body": body,
        **fields,
    }


@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])  # vLLM's compact JSON, and spaced
def test_text_held_back_by_the_tool_parser_makes_the_next_drift_a_swallowed_text_break(separators):
    # "Sure <tool_call oops": vLLM sends "Sure", then empty deltas while ids flow, then the final chunk.
    sampled = [[7], [44], [19324], [79], [4350]]
    chunks = [chunk({"content": "Sure"}, sampled[0]), *(chunk({}, ids) for ids in sampled[1:])]
    chunks.append(chunk({}, [2], finish="stop"))
    first = record("a", stream(chunks, prompt=PROMPT, separators=separators), t=1.0)
    # The harness sends back what it saw ("Sure"): the next prompt renders a shorter turn than was sampled.
    second = record("b", stream([chunk({}, [2], finish="stop")], prompt=[*PROMPT, 7, 2, 198, 1, 4093, 9]), t=2.0)
    calls = [c for r in (first, second) for c in extract(r, None)]
    assert [c.swallowed for c in calls] == [True, False]
    traces = merge(calls)
    assert [t.cause for t in traces] == [None, "swallowed_text"]


def test_a_tool_call_s_held_back_prefix_is_not_swallowed_text():
    calls = [
        chunk({}, [44, 19324]),
        chunk({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "bash", "arguments": ""}}]}, [5]),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}, [6]),
        chunk({}, [2], finish="tool_calls"),
    ]
    (call,) = extract(record("a", stream(calls, prompt=PROMPT), t=1.0), None)
    assert not call.swallowed and call.answer["tool_calls"][0]["function"]["name"] == "bash"


def test_a_plain_stream_ending_with_an_empty_delta_is_not_swallowed_text():
    body = stream([chunk({"content": "Hi"}, [7]), chunk({}, [2], finish="stop")], prompt=PROMPT)
    (call,) = extract(record("a", body, t=1.0), None)
    assert not call.swallowed and call.logprobs == [-0.5, -0.5]


@pytest.mark.parametrize(
    "fields",
    [
        {"constrained": ["tool_choice"]},
        # Written before the field existed: judged by the body sent upstream.
        {"request": {"model": "m", "messages": [], "tools": [{"type": "function"}], "tool_choice": "required"}},
    ],
)
def test_constrained_calls_lose_their_log_probs(fields):
    body = stream([chunk({"content": "{"}, [90], logprob=0.0), chunk({}, [2], finish="stop")], prompt=PROMPT)
    (call,) = extract(record("a", body, t=1.0, **fields), None)
    assert call.constrained and call.logprobs is None and call.notes == [CONSTRAINED]
    assert call.output_ids == [90, 2]  # the ids stay: they are what the model was made to say
    (trace,) = merge([call])
    assert trace.logprobs is None  # the trainer recomputes them


def test_an_unconstrained_record_keeps_its_log_probs():
    body = stream([chunk({"content": "Hi"}, [7]), chunk({}, [2], finish="stop")], prompt=PROMPT)
    (call,) = extract(record("a", body, t=1.0, constrained=[]), None)
    assert not call.constrained and call.logprobs == [-0.5, -0.5] and call.notes == []
