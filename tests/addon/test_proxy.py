"""A real `mitmdump` with the addon, the reference server behind it, and the official `openai` SDK in front."""

import json
import threading
import time

import openai
import pytest
from transformers import AutoTokenizer

from eval.sessions.procs import Mitmdump, ReferenceServer, free_port
from tests import http
from tests.bench.upstream import make_server
from tests.captures import read_records, sse_events, tokens_of

pytestmark = pytest.mark.slow

SCRIPT = [
    {
        "reasoning": "The user wants a file; a shell command writes it.",
        "content": None,
        "tool_calls": [{"name": "bash", "arguments": {"command": "echo hi > out.txt"}}],
    },
    {"content": "Done: out.txt holds hi.", "tool_calls": []},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
]
FIRST_TURN = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Write hi into out.txt."},
]


def collect(stream):
    """Assemble a streamed chat completion the way a harness does."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning") or ""
            for call in delta.tool_calls or []:
                slot = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += call.id or ""
                slot["name"] += call.function.name or ""
                slot["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return {"content": content or None, "reasoning": reasoning or None, "calls": list(calls.values()), "finish": finish}


def answer(message, finish):
    extra = message.model_extra or {}
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]
    return {"content": message.content, "reasoning": extra.get("reasoning"), "calls": calls, "finish": finish}


def comparable(result):
    """Call ids are random per response; everything else must match."""
    return {**result, "calls": [{k: v for k, v in c.items() if k != "id"} for c in result["calls"]]}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def scripted(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scripted")
    (tmp / "script.json").write_text(json.dumps(SCRIPT))
    with ReferenceServer(tiny_model_dir, script=tmp / "script.json", log=tmp / "server.log") as server:
        yield server


@pytest.fixture(scope="module")
def proxy(scripted, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("proxy")
    with Mitmdump(scripted.url, tmp / "captures", log=tmp / "mitmdump.log") as mitm:
        mitm.captures = tmp / "captures"
        yield mitm


def client(base_url, key, **kwargs):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=60, **kwargs)


def two_turns(c, *, stream):
    """The scripted session: a tool call, its result sent back, a final answer."""
    results = []
    messages = list(FIRST_TURN)
    for _ in range(2):
        kwargs = {"model": "tiny", "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": 200}
        if stream:
            result = collect(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        else:
            response = c.chat.completions.create(**kwargs)
            result = answer(response.choices[0].message, response.choices[0].finish_reason)
        results.append(result)
        if result["calls"]:
            call = result["calls"][0]
            messages = [
                *messages,
                {
                    "role": "assistant",
                    "content": result["content"],
                    "reasoning": result["reasoning"],  # sent back, so the template renders the turn as sampled
                    "tool_calls": [
                        {
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": call["name"], "arguments": call["arguments"]},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call["id"], "content": "(no output)"},
            ]
    return results


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "non-streamed"])
def test_two_turn_tool_call_through_proxy_equals_direct(stream, scripted, proxy, tokenizer):
    session = f"sess-two-turn-{'s' if stream else 'n'}"
    # Direct calls name their session the way the proxy would, so the script advances the same.
    direct = two_turns(
        client(scripted.url, "unused", default_headers={"x-polar-session": f"direct-{session}"}), stream=stream
    )
    proxied = two_turns(client(proxy.url, session), stream=stream)
    assert [comparable(r) for r in proxied] == [comparable(r) for r in direct]
    assert proxied[0]["finish"] == "tool_calls" and json.loads(proxied[0]["calls"][0]["arguments"]) == {
        "command": "echo hi > out.txt"
    }
    assert proxied[1]["content"] == "Done: out.txt holds hi." and proxied[1]["finish"] == "stop"

    records = read_records(proxy.captures, session=session, expect=2)
    assert len(records) == 2
    for record in records:
        assert record["complete"] and record["status"] == 200 and record["streamed"] is stream
        assert record["session_source"] == "api_key" and record["api"] == "chat"
        prompt, ids, logprobs = tokens_of(record)
        assert len(logprobs) == len(ids) > 0 and all(lp <= 0 for lp in logprobs)
        assert (
            prompt
            == tokenizer.apply_chat_template(record["request"]["messages"], tools=TOOLS, add_generation_prompt=True)[
                "input_ids"
            ]
        )
    # The sampled ids decode to what the client got back.
    _, ids0, _ = tokens_of(records[0])
    _, ids1, _ = tokens_of(records[1])
    assert "echo hi > out.txt" in tokenizer.decode(ids0) and SCRIPT[0]["reasoning"] in tokenizer.decode(ids0)
    assert tokenizer.decode(ids1, skip_special_tokens=True).strip() == "Done: out.txt holds hi."
    # The second prompt re-renders the first turn as sampled: the records chain token by token.
    prompt1, _, _ = tokens_of(records[1])
    prompt0, _, _ = tokens_of(records[0])
    assert prompt1[: len(prompt0) + len(ids0)] == prompt0 + ids0


def test_interleaved_sessions_stay_apart(proxy):
    a, b = client(proxy.url, "sess-inter-a"), client(proxy.url, "sess-inter-b")
    kwargs = {"model": "tiny", "messages": FIRST_TURN, "tools": TOOLS, "temperature": 0}
    first_a = a.chat.completions.create(**kwargs)
    first_b = b.chat.completions.create(**kwargs)
    second_a = a.chat.completions.create(**kwargs)
    second_b = b.chat.completions.create(**kwargs)
    # Each session walks the script on its own: first a tool call, then the final answer.
    assert first_a.choices[0].finish_reason == first_b.choices[0].finish_reason == "tool_calls"
    assert second_a.choices[0].message.content == second_b.choices[0].message.content == SCRIPT[1]["content"]
    records = read_records(proxy.captures, session="sess-inter-a", expect=2) + read_records(
        proxy.captures, session="sess-inter-b", expect=2
    )
    records.sort(key=lambda r: r["t_start"])
    assert [r["session_id"] for r in records] == ["sess-inter-a", "sess-inter-b", "sess-inter-a", "sess-inter-b"]


def test_provider_key_never_reaches_disk(proxy):
    secret = "sk-proj-Zq81NeverWriteMe"
    c = client(proxy.url, secret)
    list(c.chat.completions.create(model="tiny", messages=FIRST_TURN, stream=True))
    c.chat.completions.create(model="tiny", messages=FIRST_TURN)
    time.sleep(0.5)  # let the last record land
    hashed = [r for r in read_records(proxy.captures) if r["session_source"] == "key_hash"]
    assert len(hashed) >= 2 and len({r["session_id"] for r in hashed}) == 1
    for path in proxy.captures.rglob("*"):
        assert secret.encode() not in path.read_bytes(), path


def test_non_json_body_is_forwarded_and_recorded(proxy, scripted):
    direct = http.post(
        f"{scripted.url}/v1/chat/completions", content=b"not json{", headers={"content-type": "application/json"}
    )
    proxied = http.post(
        f"{proxy.url}/v1/chat/completions",
        content=b"not json{",
        headers={"content-type": "application/json", "authorization": "Bearer sess-nonjson"},
    )
    assert proxied.status_code == direct.status_code == 400
    assert proxied.json()["error"]["type"] == direct.json()["error"]["type"]
    (record,) = read_records(proxy.captures, session="sess-nonjson", expect=1)
    assert record["request"] is None and record["request_raw"] == {"text": "not json{"}
    assert record["injected"] == {} and record["status"] == 400 and json.loads(record["response_body"])["error"]


def test_upstream_down_gives_openai_error(tmp_path):
    with (
        Mitmdump(f"http://127.0.0.1:{free_port()}", tmp_path / "captures", log=tmp_path / "mitmdump.log") as mitm,
        pytest.raises(openai.APIStatusError) as raised,
    ):
        client(mitm.url, "sess-down").chat.completions.create(model="tiny", messages=FIRST_TURN)
    assert raised.value.status_code == 502
    assert "Connect call failed" in raised.value.body["message"]
    (record,) = read_records(tmp_path / "captures", expect=1)
    assert record["status"] is None and record["complete"] is False and record["error"]["kind"] == "upstream"


@pytest.fixture
def slow_upstream():
    server = make_server()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_client_disconnect_mid_stream_keeps_partial_record(slow_upstream, tmp_path):
    body = {"model": "m", "messages": FIRST_TURN, "stream": True, "bench_chunks": 50, "bench_delay_s": 0.05}
    with Mitmdump(slow_upstream, tmp_path / "captures", log=tmp_path / "mitmdump.log") as mitm:
        with http.stream(
            "POST", f"{mitm.url}/v1/chat/completions", json=body, headers={"authorization": "Bearer sess-gone"}
        ) as r:
            first = next(r.iter_raw())
        assert first.startswith(b"data: ")
        (record,) = read_records(tmp_path / "captures", expect=1)
    assert record["complete"] is False and record["error"]["kind"] == "client"
    assert record["response_body"].startswith(first.decode()) and len(sse_events(record["response_body"])) < 50


def test_kill_9_loses_no_finished_record(slow_upstream, tmp_path):
    mitm = Mitmdump(slow_upstream, tmp_path / "captures", log=tmp_path / "mitmdump.log")
    try:
        c = client(mitm.url, "sess-kill")
        for i in range(20):
            response = c.chat.completions.create(
                model="m", messages=FIRST_TURN, stream=i % 2 == 0, extra_body={"bench_chunks": 5}
            )
            if i % 2 == 0:
                list(response)
        time.sleep(0.2)  # the addon promises records on disk within ~100 ms of an exchange's end
        mitm.kill9()
    finally:
        mitm.stop()
    records = read_records(tmp_path / "captures")
    assert len(records) == 20 and all(r["complete"] for r in records)
