"""addon/sse.py: the event-stream splitter the translators and reconstruction share, fed at every awkward boundary."""

import random

import pytest

from addon.sse import SSEDecoder, SSEEvent

# Every line ending, a comment, a named event, a multi-line data field, an id, a field without a colon,
# multi-byte UTF-8 (2, 3 and 4 bytes) and JSON with a "\n\n" inside a string (escaped, so not a separator).
STREAM = (
    ": keep-alive comment\r\n"
    'data: {"a": "caf\u00e9 \u2713 \U0001f642", "b": "x\\n\\ny"}\r\n\r\n'
    "event: sglext_ids\n"
    "id: 7\n"
    'data: {"input_ids": [1, 2]}\n\n'
    "data: line one\rdata: line two\r\r"
    "data\n\n"
    "retry: 10\n\n"
    "data: [DONE]\n\n"
)
EVENTS = [
    SSEEvent('{"a": "caf\u00e9 \u2713 \U0001f642", "b": "x\\n\\ny"}'),
    SSEEvent('{"input_ids": [1, 2]}', "sglext_ids", "7"),
    SSEEvent("line one\nline two", "message", "7"),
    SSEEvent("", "message", "7"),
    SSEEvent("[DONE]", "message", "7"),
]


def feed(chunks):
    decoder = SSEDecoder()
    events = [e for chunk in chunks for e in decoder.decode(chunk)]
    return events + decoder.flush(), decoder.torn


def test_whole_stream():
    assert feed([STREAM]) == (EVENTS, False)


@pytest.mark.parametrize("kind", ["bytes", "str"])
def test_every_two_way_split(kind):
    data = STREAM.encode() if kind == "bytes" else STREAM
    for i in range(len(data) + 1):  # mid-UTF-8, mid-CRLF, mid-field name, mid-JSON
        assert feed([data[:i], data[i:]]) == (EVENTS, False), i


def test_byte_by_byte_and_random_splits():
    data = STREAM.encode()
    assert feed([data[i : i + 1] for i in range(len(data))]) == (EVENTS, False)
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(data)), 5))
        chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        assert feed(chunks) == (EVENTS, False), cuts


def test_a_cut_stream_drops_the_open_event_and_says_so():
    data = STREAM.encode()
    cut = data.index(b"event: sglext_ids") + 30  # inside the second event's data
    events, torn = feed([data[:cut]])
    assert events == EVENTS[:1] and torn
    events, torn = feed([data[: data.index(b"\xc3") + 1]])  # torn inside "é": nothing complete, and torn
    assert events == [] and torn


def test_cr_at_the_end_of_a_chunk_pairs_with_a_lf_at_the_start_of_the_next():
    assert feed(["data: a\r", "\n", "\r", "\n"]) == ([SSEEvent("a")], False)
    assert feed(["data: a\r", "\r"]) == ([SSEEvent("a")], False)  # CR CR: two line ends, one blank line
