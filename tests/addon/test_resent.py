"""ResentBodies (addon/resent.py): a session's next body, checked only where it differs, is taken exactly when
json.loads takes it, with the same top-level values."""

import json
import random

import pytest

from addon import resent
from addon.record import ELIDED, Body
from tests.bench.payload import chat_body


def parsed_whole(data):
    """What json.loads makes of a body: its value, or "raw" / "deep" when the record keeps it raw."""
    try:
        return json.loads(data.decode("utf-8"))
    except ValueError:
        return "raw"
    except RecursionError:
        return "deep"


def assert_same_as_json_loads(body: Body, data: bytes) -> None:
    want = parsed_whole(data)
    if want in ("raw", "deep"):
        assert body.json_bytes is None and body.value is None and body.too_deep == (want == "deep")
        return
    assert body.json_bytes == data.replace(b"\n", b" ").replace(b"\r", b" ")
    if not body.lean:
        assert json.dumps(body.value) == json.dumps(want)
        return
    assert isinstance(want, dict) and list(body.value) == list(want)
    for key, value in body.value.items():  # json.dumps: NaN is not equal to itself
        assert value is ELIDED or json.dumps(value) == json.dumps(want[key]), key
    assert json.dumps(body.full()) == json.dumps(want)


def turns(rng, n):
    """A session's bodies: the same conversation, one message longer each call, in one of several encodings."""
    base = chat_body(target_bytes=20_000)
    messages = list(base["messages"])
    dumps = rng.choice([{}, {"ensure_ascii": False}, {"indent": 1}, {"separators": (",", ":")}])
    head = rng.choice([{}, {"model": "m", "tools": [{"name": "[not the conversation]"}]}])
    for _ in range(n):
        text = rng.choice(["next step ", "é ü 中文 😀 ", '\\"quoted\\" ', "\n\t"]) * rng.randint(1, 20)
        messages = [*messages, {"role": "user", "content": text}]
        yield json.dumps({**head, **base, "messages": messages}, **dumps).encode()


def mutate(rng, data):
    """One byte changed, dropped or added: anywhere, or near the end where a new turn is."""
    pos = rng.randrange(len(data)) if rng.random() < 0.5 else rng.randrange(max(0, len(data) - 200), len(data))
    byte = bytes([rng.choice(b'{}[],:"\\ \n\x01a\xc3\xa90-')])
    return rng.choice(
        [data[:pos] + byte + data[pos + 1 :], data[:pos] + data[pos + 1 :], data[:pos] + byte + data[pos:]]
    )


@pytest.mark.parametrize("seed", range(6))
def test_a_sessions_bodies_are_taken_as_json_loads_takes_them(seed):
    rng = random.Random(seed)
    bodies = resent.ResentBodies()
    for _ in range(25):
        session = f"s{rng.randrange(3)}"
        for data in turns(rng, 4):
            data = mutate(rng, data) if rng.random() < 0.5 else data
            assert_same_as_json_loads(bodies.parse(session, data), data)


def test_a_change_inside_the_repeated_conversation_is_still_checked():
    bodies = resent.ResentBodies()
    first, second = list(turns(random.Random(0), 2))
    assert bodies.parse("s", first).lean
    at = second.index(b'"role"')  # in the first message: a body that differs there resumes before it
    broken = second[:at] + b"{" + second[at + 1 :]
    assert_same_as_json_loads(bodies.parse("s", broken), broken)
    assert bodies.parse("s", broken).value is None
    assert_same_as_json_loads(bodies.parse("s", second), second)


def test_only_the_new_part_is_parsed(monkeypatch):
    bodies = resent.ResentBodies()
    first, second = list(turns(random.Random(1), 2))
    bodies.parse("s", first)
    decoded = []
    real = resent._DECODER.raw_decode
    monkeypatch.setattr(resent._DECODER, "raw_decode", lambda text, i: decoded.append(len(text) - i) or real(text, i))
    assert_same_as_json_loads(bodies.parse("s", second), second)
    assert max(decoded) < len(second) - len(first) + 2000  # the new message and what follows it, not the history
    decoded.clear()
    bodies.parse("other session", second)
    assert max(decoded) > len(first) // 2  # another session's history is its own


@pytest.mark.parametrize(
    "data",
    [
        b"{}",
        b' {"messages": []} ',
        b"[1]",
        b'{"messages": [1,]}',
        b'{"messages": [1] ,"a":1}',
        b'{"messages": [{"x": 1}], "messages": [2]}',
        b'\xef\xbb\xbf{"a": 1}',
        b'{"a": NaN, "messages": [Infinity]}',
        b'{"messages": [1]} x',
        b'{"messages": [1], }',
        b'{"messages" [1]}',
        b'{"input": "a string is no conversation"}',
        b'{"messages": [' + b"[" * 100_000 + b"]" * 100_000 + b"]}",
        b'{"messages": [1], "x": "\xff"}',
    ],
)
def test_odd_bodies_twice(data):
    bodies = resent.ResentBodies()
    for _ in range(2):
        assert_same_as_json_loads(bodies.parse("s", data), data)


def test_kept_bodies_stay_within_their_bound():
    bodies = resent.ResentBodies(keep_bytes=50_000)
    for i, data in enumerate(turns(random.Random(2), 12)):
        bodies.parse(f"s{i}", data)
        assert bodies._bytes == sum(len(seen.data) for seen in bodies._seen.values()) <= 50_000
    assert 1 <= len(bodies._seen) < 12
