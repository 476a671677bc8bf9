"""The reference server (python -m eval serve) as a real subprocess, driven by the openai SDK and raw httpx: vLLM's
fields, streamed and not."""

import json
import socket
import threading
from urllib.parse import urlsplit

import openai
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from eval.upstream.server import Args
from eval.upstream.toolparse import Content, OutputParser, Reasoning
from tests import http

pytestmark = pytest.mark.slow  # reference servers (python -m eval serve) per module

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
SCRIPT = [
    {
        "reasoning": "I need the file list.",
        "content": "Let me look: café ü 日本.",
        "tool_calls": [{"name": "bash", "arguments": {"command": "ls -la"}}],
    },
    {"content": "There are two files.", "reasoning": None, "tool_calls": []},
]
FIRST_ANSWER = (
    "<think>\nI need the file list.\n</think>\n\nLet me look: café ü 日本.\n"
    '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call><|im_end|>'
)
USER = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What files are here?"}]
TOKEN_FIELDS = {"return_token_ids": True}
EXTRA = {"extra_body": TOKEN_FIELDS}  # vLLM-only request fields go through the SDK's extra_body


@pytest.fixture(scope="module")
def sampler(reference_server, tiny_model_dir) -> str:
    return reference_server(tiny_model_dir, seed=1)


@pytest.fixture(scope="module")
def scripted(reference_server, tiny_model_dir) -> str:
    return reference_server(tiny_model_dir, script=SCRIPT)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, local_files_only=True).eval()


def client(url: str, session: str | None = None) -> OpenAI:
    headers = {"x-polar-session": session} if session else None
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, default_headers=headers)


def extra(obj, name):
    return (obj.model_extra or {}).get(name)


def collect(stream) -> dict:
    """The streamed chunks, and what they add up to."""
    chunks = list(stream)
    choice_chunks = [c for c in chunks if c.choices]
    deltas = [c.choices[0].delta for c in choice_chunks[1:]]
    return {
        "chunks": chunks,
        "first": chunks[0],
        "token_ids": [t for c in choice_chunks[1:] for t in extra(c.choices[0], "token_ids")],
        "logprobs": [lp for c in choice_chunks[1:] if c.choices[0].logprobs for lp in c.choices[0].logprobs.content],
        "content": "".join(d.content or "" for d in deltas),
        "reasoning": "".join(extra(d, "reasoning") or "" for d in deltas),
        "tool_calls": [tc for d in deltas for tc in d.tool_calls or []],
        "finish_reasons": [c.choices[0].finish_reason for c in choice_chunks],
        "usage": chunks[-1].usage,
    }


def test_health_and_models(sampler, tiny_model_dir):
    assert http.get(sampler + "/health").status_code == 200
    models = client(sampler).models.list().data
    assert [m.id for m in models] == [str(tiny_model_dir)]
    assert http.get(sampler + "/nope").json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "top_p": 0.9, "seed": 3}])
def test_stream_matches_non_stream(sampler, tokenizer, sampling):
    args = {"model": "tiny", "messages": USER, "max_tokens": 24, "logprobs": True, "top_logprobs": 2, **EXTRA}
    whole = client(sampler).chat.completions.create(**args, **sampling)
    streamed = collect(
        client(sampler).chat.completions.create(**args, **sampling, stream=True, stream_options={"include_usage": True})
    )
    choice = whole.choices[0]
    assert whole.model == "tiny" and whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert extra(streamed["first"], "prompt_token_ids") == extra(whole, "prompt_token_ids")
    assert streamed["first"].choices[0].delta.role == "assistant"
    assert streamed["token_ids"] == extra(choice, "token_ids")
    assert len(extra(choice, "token_ids")) == whole.usage.completion_tokens == len(choice.logprobs.content)
    assert [(lp.token, lp.logprob) for lp in streamed["logprobs"]] == [
        (lp.token, lp.logprob) for lp in choice.logprobs.content
    ]
    assert all(len(lp.top_logprobs) == 2 for lp in choice.logprobs.content)
    assert streamed["content"] == (choice.message.content or "")
    assert streamed["reasoning"] == (extra(choice.message, "reasoning") or "")
    assert streamed["finish_reasons"] == [None] * (len(streamed["finish_reasons"]) - 1) + [choice.finish_reason]
    assert streamed["chunks"][-1].choices == [] and streamed["usage"] == whole.usage
    assert whole.usage.prompt_tokens == len(extra(whole, "prompt_token_ids"))
    # The returned text is what the token ids decode to, split by the same parser.
    parser = OutputParser(parse_tools=False)
    events = parser.feed(tokenizer.decode(extra(choice, "token_ids"), skip_special_tokens=True)) + parser.flush()
    assert "".join(e.text for e in events if isinstance(e, Content)) == (choice.message.content or "")
    assert "".join(e.text for e in events if isinstance(e, Reasoning)) == (extra(choice.message, "reasoning") or "")


def test_seeds_reproduce_and_differ(sampler):
    def ids(seed):
        body = {"messages": USER, "max_tokens": 12, "seed": seed, **TOKEN_FIELDS}
        return http.post(sampler + "/v1/chat/completions", json=body).json()["choices"][0]["token_ids"]

    assert ids(5) == ids(5) != ids(6)


def test_logprobs_are_the_models(sampler, model):
    body = {"messages": USER, "max_tokens": 16, "seed": 0, "logprobs": True, "top_logprobs": 3, **TOKEN_FIELDS}
    answer = http.post(sampler + "/v1/chat/completions", json=body).json()
    prompt, ids = answer["prompt_token_ids"], answer["choices"][0]["token_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]  # (T, V)
    logp = torch.log_softmax(logits, dim=-1)  # (T, V)
    served = answer["choices"][0]["logprobs"]["content"]
    expected = logp.gather(1, torch.tensor(ids)[:, None])[:, 0]  # (T,)
    assert torch.allclose(torch.tensor([e["logprob"] for e in served]), expected, atol=1e-4)
    top = logp.topk(3, dim=-1)
    assert torch.allclose(
        torch.tensor([[t["logprob"] for t in e["top_logprobs"]] for e in served]), top.values, atol=1e-4
    )
    for entry in served:
        assert entry["bytes"] == list(entry["token"].encode())


def test_concurrent_requests_do_not_interfere(sampler):
    body = {"messages": USER, "max_tokens": 12, "temperature": 0, "stream": True, **TOKEN_FIELDS}
    results: list[list[int]] = []

    def run():
        with http.stream("POST", sampler + "/v1/chat/completions", json=body) as r:
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
            results.append([t for line in lines for c in json.loads(line)["choices"] for t in c.get("token_ids", [])])

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and results[0] == results[1] == results[2] and len(results[0]) == 12


def test_scripted_tool_calls_per_session(scripted, tokenizer):
    args = {"model": "tiny", "tools": TOOLS, "logprobs": True, **EXTRA}
    a1 = client(scripted, "A").chat.completions.create(messages=USER, **args)
    b1 = collect(client(scripted, "B").chat.completions.create(messages=USER, stream=True, **args))

    choice = a1.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert extra(choice.message, "reasoning") == "I need the file list."
    assert choice.message.content == "Let me look: café ü 日本."
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "bash"
    assert json.loads(call.function.arguments) == {"command": "ls -la"}
    assert tokenizer.decode(extra(choice, "token_ids")) == FIRST_ANSWER

    # Session B streamed the same scripted message: same tokens, same log-probs, same parsed message.
    assert b1["token_ids"] == extra(choice, "token_ids")
    assert [lp.logprob for lp in b1["logprobs"]] == [lp.logprob for lp in choice.logprobs.content]
    assert (b1["content"], b1["reasoning"]) == (choice.message.content, extra(choice.message, "reasoning"))
    assert all(len(extra(c.choices[0], "token_ids")) == 1 for c in b1["chunks"][1:])
    assert all("tool_call" not in (c.choices[0].delta.content or "") for c in b1["chunks"])
    assert all("\ufffd" not in (c.choices[0].delta.content or "") for c in b1["chunks"])
    [streamed_call] = b1["tool_calls"]
    assert (streamed_call.index, streamed_call.type, streamed_call.function.name) == (0, "function", "bash")
    assert json.loads(streamed_call.function.arguments) == {"command": "ls -la"}
    assert b1["finish_reasons"][-1] == "tool_calls"

    # Second turn: the harness sends the answer back with the tool result; the prompt extends the first turn.
    history = [
        *USER,
        {
            "role": "assistant",
            "content": choice.message.content,
            "reasoning": extra(choice.message, "reasoning"),
            "tool_calls": [call.model_dump()],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "a.txt\nb.txt"},
    ]
    a2 = client(scripted, "A").chat.completions.create(messages=history, **args)
    b2 = collect(client(scripted, "B").chat.completions.create(messages=history, stream=True, **args))
    first_turn = extra(a1, "prompt_token_ids") + extra(choice, "token_ids")
    assert extra(a2, "prompt_token_ids")[: len(first_turn)] == first_turn
    assert a2.choices[0].message.content == b2["content"] == "There are two files."
    assert a2.choices[0].finish_reason == b2["finish_reasons"][-1] == "stop"
    assert a2.choices[0].message.tool_calls == [] and b2["tool_calls"] == []

    # A session past the end of the script gets the last message again.
    a3 = client(scripted, "A").chat.completions.create(messages=history, **args)
    assert a3.choices[0].message.content == "There are two files."


def test_script_without_session_header_uses_default(scripted):
    answer = client(scripted).chat.completions.create(model="tiny", messages=USER, tools=TOOLS)
    assert answer.choices[0].message.tool_calls[0].function.name == "bash"


def test_stop_string_cuts_text_but_keeps_tokens(scripted, tokenizer):
    body = {"messages": USER, "stop": ["look"], **TOKEN_FIELDS}
    answer = http.post(scripted + "/v1/chat/completions", json=body, headers={"x-polar-session": "stop"}).json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == "Let me "
    assert tokenizer.decode(choice["token_ids"]).endswith("look")


def test_without_tools_the_markup_is_content(scripted):
    body = {"messages": USER}
    answer = http.post(scripted + "/v1/chat/completions", json=body, headers={"x-polar-session": "no-tools"}).json()
    message = answer["choices"][0]["message"]
    assert message["tool_calls"] == [] and message["content"].endswith("</tool_call>")
    assert answer["choices"][0]["finish_reason"] == "stop"


def test_unknown_fields_are_ignored(sampler):
    body = {"messages": USER, "max_tokens": 2, "chat_template_kwargs": {}, "foo": [1], "logprobs": False}
    answer = http.post(sampler + "/v1/chat/completions", json=body).json()
    assert "prompt_token_ids" not in answer and "token_ids" not in answer["choices"][0]
    assert answer["choices"][0]["logprobs"] is None and answer["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0]"),
        ({"messages": USER, "n": 2}, "n"),
        ({"messages": USER, "temperature": -1}, "temperature"),
        ({"messages": USER, "top_p": 0}, "top_p"),
        ({"messages": USER, "max_tokens": 0}, "max_tokens"),
        ({"messages": USER, "max_tokens": "5"}, "max_tokens"),
        ({"messages": USER, "max_tokens": 10**6}, "max_tokens"),  # beyond the whole context, as vLLM refuses
        ({"messages": USER, "max_completion_tokens": 10**6}, "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "overflow " * 40_000}]}, "input_tokens"),
        ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": USER, "stop": [""]}, "stop"),
        ({"messages": USER, "tools": [{"type": "function"}]}, "tools"),
        ({"messages": USER, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
        ({"messages": USER, "stream": "yes"}, "stream"),
        ([1, 2], None),
    ],
)
def test_bad_requests_get_openai_errors(sampler, body, param):
    r = http.post(sampler + "/v1/chat/completions", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_invalid_json_and_sdk_error(sampler):
    r = http.post(sampler + "/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        client(sampler).chat.completions.create(model="tiny", messages=USER, n=2)
    assert raised.value.status_code == 400


def test_chunked_request_body_and_dropped_stream(sampler):
    body = json.dumps({"messages": USER, "max_tokens": 3, **TOKEN_FIELDS}).encode()
    r = http.post(sampler + "/v1/chat/completions", content=iter([body[:10], body[10:]]))  # Transfer-Encoding: chunked
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3
    long = {"messages": USER, "max_tokens": 200, "stream": True}
    with http.stream("POST", sampler + "/v1/chat/completions", json=long) as r:
        next(r.iter_lines())  # hang up after the first event; the server stops generating and keeps serving
    assert http.post(sampler + "/v1/chat/completions", json={"messages": USER, "max_tokens": 1}).status_code == 200


MAX_BODY = Args.max_body_mb << 20  # --max-body-mb's default, which the fixtures' servers run with


def raw_post(url: str, head: bytes) -> tuple[int, dict]:
    """Send ``head`` (a request line and headers, maybe a start of body) on a socket of its own; read the answer
    until the server closes. A server that waited for the rest of a body would time this out."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
        sock.sendall(head)
        answer = b""
        while chunk := sock.recv(1 << 16):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert b"connection: close" in headers.lower()
    return int(status_line.split()[1]), json.loads(body)


def blocks(n_mb: int):
    block = b"x" * (1 << 20)
    for _ in range(n_mb):
        yield block


def test_a_body_over_max_body_mb_is_refused_413_before_it_is_read(sampler):
    # Only the head is sent: the answer comes without the server waiting for the body.
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode()
    status, answer = raw_post(sampler, head)
    assert status == 413 and answer["error"]["type"] == "invalid_request_error"
    assert f"over this server's limit of {MAX_BODY >> 20} MiB (--max-body-mb)" in answer["error"]["message"]
    for framing in ("content-length", "chunked"):  # 8 times the bound, sent whole by a client that does not wait
        headers = {"content-length": str(8 * MAX_BODY)} if framing == "content-length" else {}
        r = http.post(sampler + "/v1/chat/completions", content=blocks(8 * MAX_BODY >> 20), headers=headers)
        assert r.status_code == 413 and "--max-body-mb" in r.json()["error"]["message"], (framing, r.text)
    body = json.dumps({"messages": USER, "max_tokens": 1, "pad": "x" * (MAX_BODY - 1000)}).encode()
    assert len(body) <= MAX_BODY and http.post(sampler + "/v1/chat/completions", content=body).status_code == 200


@pytest.mark.parametrize(
    ("headers", "start", "status", "says"),
    [("", b"", 411, "needs a Content-Length header or a chunked body"),
     ("Content-Length: 12abc\r\n", b"", 400, "invalid Content-Length: '12abc'"),
     ("Content-Length: -5\r\n", b"", 400, "invalid Content-Length"),
     ("Content-Length: 5\r\nContent-Length: 6\r\n", b"", 400, "invalid Content-Length: '5, 6'"),
     ("Transfer-Encoding: chunked\r\n", b"zz\r\n", 400, "invalid chunk size line"),
     ("Transfer-Encoding: chunked\r\n", b"0x5\r\nhello\r\n", 400, "invalid chunk size line"),
     ("Transfer-Encoding: chunked\r\n", b"3\r\nhello\r\n", 400, "not followed by CRLF"),
     ("Transfer-Encoding: gzip\r\n", b"", 400, "unsupported Transfer-Encoding 'gzip'")],
)  # fmt: skip
def test_a_body_of_no_or_bad_length_is_refused_clearly(sampler, headers, start, status, says):
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode() + start
    got, answer = raw_post(sampler, head)
    assert got == status and says in answer["error"]["message"] and answer["error"]["type"] == "invalid_request_error"
    assert http.post(sampler + "/v1/chat/completions", json={"messages": USER, "max_tokens": 1}).status_code == 200


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    """A LoRA adapter with random (not zero) B matrices, so it changes the model's log-probs."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, local_files_only=True)
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    folder = tmp_path_factory.mktemp("adapter") / "step-1"
    get_peft_model(base, config).save_pretrained(folder)
    return folder


@pytest.mark.filterwarnings(
    "ignore:.*is_gradient_checkpointing:FutureWarning"
)  # peft reads what transformers 5 renamed
def test_lora_adapters_serve_as_vllm_does(reference_server, tiny_model_dir, adapter_dir):
    from peft import PeftModel

    url = reference_server(tiny_model_dir, script=SCRIPT)
    body = {"messages": USER, "tools": TOOLS, "logprobs": True, **TOKEN_FIELDS}

    def logprobs(model, session):
        answer = http.post(
            url + "/v1/chat/completions", json={**body, "model": model}, headers={"x-polar-session": session}
        )
        answer.raise_for_status()
        choice = answer.json()["choices"][0]
        return (
            answer.json()["prompt_token_ids"],
            choice["token_ids"],
            [e["logprob"] for e in choice["logprobs"]["content"]],
        )

    prompt, ids, base = logprobs("tiny", "base")
    loaded = http.post(url + "/v1/load_lora_adapter", json={"lora_name": "step-1", "lora_path": str(adapter_dir)})
    assert loaded.status_code == 200 and "added successfully" in loaded.text
    assert [m["id"] for m in http.get(url + "/v1/models").json()["data"]][1:] == ["step-1"]
    _, same_ids, tuned = logprobs("step-1", "tuned")  # the script replays the same answer: same ids
    _, _, base_again = logprobs("tiny", "base-again")
    assert same_ids == ids and base_again == pytest.approx(base, abs=1e-5)
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, local_files_only=True), adapter_dir
    ).eval()
    with torch.no_grad():
        logits = peft(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]  # (T, V)
    expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids)[:, None])[:, 0]  # (T,)
    assert torch.allclose(torch.tensor(tuned), expected, atol=1e-4)
    assert not torch.allclose(torch.tensor(tuned), torch.tensor(base), atol=1e-3)
    again = http.post(url + "/v1/load_lora_adapter", json={"lora_name": "step-1", "lora_path": str(adapter_dir)})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    gone = http.post(url + "/v1/unload_lora_adapter", json={"lora_name": "step-1"})
    assert gone.status_code == 200 and len(http.get(url + "/v1/models").json()["data"]) == 1
    bad = http.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tiny_model_dir)})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
