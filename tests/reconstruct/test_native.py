"""Native-API calls recorded untranslated (``polar_translate=never``, capture-only), converted by each translator's
to_chat_completion (addon/anthropic.py, responses.py, google.py) through reconstruct/_extract.py.

Captures come from real proxies and SDKs. vLLM's own Responses API returns the token ids itself (the reference
server's /v1/responses answers like vLLM's with ``enable_response_messages``, which the addon asks for). For
Anthropic and Google nothing returns ids, as in front of a closed API: two proxies are chained, the outer one
recording the native traffic untranslated, the inner one translating it for the reference server and recording
the token truth; retokenizing the outer records must give the inner ones' tokens.
"""

import contextlib
import json

import anthropic
import openai
import pytest
from google import genai
from google.genai import types
from transformers import AutoTokenizer

from eval.sessions.procs import Mitmdump, ReferenceServer
from reconstruct import reconstruct
from tests.captures import read_records

pytestmark = pytest.mark.slow

SCRIPT = [
    {"reasoning": "A shell command writes it.", "content": None,
     "tool_calls": [{"name": "run", "arguments": {"command": "echo hi > out.txt"}}]},
    {"content": "Done: out.txt holds hi.", "tool_calls": []},
]  # fmt: skip


@contextlib.contextmanager
def chain(model_dir, tmp, *, translate_outer):
    """Reference server ← inner mitmdump (translating, records token ids) ← outer mitmdump (``polar_translate``
    as given). Yields (outer proxy, outer captures, inner captures)."""
    (tmp / "script.json").write_text(json.dumps(SCRIPT))
    with (
        ReferenceServer(model_dir, script=tmp / "script.json", log=tmp / "server.log") as server,
        Mitmdump(server.url, tmp / "inner", log=tmp / "inner.log", polar_model="tiny") as inner,
    ):
        outer_upstream = inner.url if translate_outer == "never" else server.url
        with Mitmdump(outer_upstream, tmp / "outer", log=tmp / "outer.log", polar_translate="never") as outer:
            yield outer, tmp / "outer", tmp / "inner"


def by_session(df):
    return {s: df.filter(df["session_id"] == s).sort("chain_index") for s in df["session_id"].unique()}


def assert_same_tokens(retokenized, captured):
    assert retokenized.keys() == captured.keys()
    for session, rows in retokenized.items():
        truth = captured[session]
        for column in ("prompt_ids", "response_ids", "loss_mask", "n_calls"):
            assert rows[column].to_list() == truth[column].to_list(), (session, column)
        assert set(rows["token_source"]) == {"retokenized"} and set(truth["token_source"]) == {"captured"}
        assert rows["logprobs"].is_null().all()


# ---- vLLM's Responses API, passed through: ids from the answer itself


RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "run",
        "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
]


def responses_session(client, *, stream):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Write hi into out.txt."}]}]
    kwargs = {
        "model": "tiny",
        "instructions": "You are a coding agent.",
        "tools": RESPONSES_TOOLS,
        "store": False,
        "include": ["reasoning.encrypted_content"],
    }
    for _ in SCRIPT:
        if stream:
            with client.responses.stream(input=items, **kwargs) as events:
                response = events.get_final_response()
        else:
            response = client.responses.create(input=items, **kwargs)
        out = [item.model_dump(exclude_none=True) for item in response.output]
        items += out
        items += [
            {"type": "function_call_output", "call_id": o["call_id"], "output": "(no output)"}
            for o in out
            if o["type"] == "function_call"
        ]


def test_vllm_responses_passthrough_keeps_the_servers_token_ids(tiny_model_dir, tmp_path):
    (tmp_path / "script.json").write_text(json.dumps(SCRIPT))
    with (
        ReferenceServer(tiny_model_dir, script=tmp_path / "script.json", log=tmp_path / "server.log") as server,
        Mitmdump(server.url, tmp_path / "captures", log=tmp_path / "mitm.log", polar_translate="never") as mitm,
    ):
        for session, stream in (("resp-streamed", True), ("resp-plain", False)):
            with openai.OpenAI(base_url=f"{mitm.url}/v1", api_key=session, max_retries=0, timeout=60) as client:
                responses_session(client, stream=stream)
        records = read_records(tmp_path / "captures", expect=4)
    assert {r["api"] for r in records} == {"responses"}
    for r in records:  # the client's include list was extended, so the whole body sent upstream is kept
        assert r["injected"]["enable_response_messages"] is True and "input" in r["upstream_request"]
        assert r["upstream_request"]["include"] == ["reasoning.encrypted_content", "message.output_text.logprobs"]
    df, stats = reconstruct([tmp_path / "captures"])
    assert stats.calls == stats.merged_calls == 4 and stats.dropped == {}
    for session, rows in by_session(df).items():
        mine = [r for r in records if r["session_id"] == session]
        finals = [final_response(r) for r in mine]
        sampled = [i for f in finals for i in f["output_messages"][0]["tokens"]]
        (trace,) = rows.iter_rows(named=True)  # the second call extends the first, token for token
        assert trace["prompt_ids"] == finals[0]["input_messages"][0]["tokens"]
        assert [t for t, m in zip(trace["response_ids"], trace["loss_mask"], strict=True) if m] == sampled
        assert trace["token_source"] == "captured" and trace["n_calls"] == 2 and trace["api"] == "responses"
        assert json.loads(trace["messages"])["messages"][-1]["content"] == "Done: out.txt holds hi."


def final_response(record):
    if not record["streamed"]:
        return json.loads(record["response_body"])
    datas = [block.partition("data: ")[2] for block in record["response_body"].split("\n\n") if "data: " in block]
    return [json.loads(d) for d in datas if '"response.completed"' in d][-1]["response"]


# ---- Anthropic and Google untranslated, as in front of a closed API: retokenized


ANTHROPIC_TOOLS = [
    {
        "name": "run",
        "description": "Run a shell command.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
]


def anthropic_session(client, *, stream):
    messages = [{"role": "user", "content": "Write hi into out.txt."}]
    for _ in SCRIPT:
        kwargs = {
            "model": "claude-sonnet-4-5",
            "max_tokens": 200,
            "system": "You are a coding agent.",
            "messages": messages,
            "tools": ANTHROPIC_TOOLS,
            "thinking": {"type": "adaptive"},
        }
        if stream:
            with client.messages.stream(**kwargs) as events:
                message = events.get_final_message()
        else:
            message = client.messages.create(**kwargs)
        messages = [
            *messages,
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
        ]
        results = [
            {"type": "tool_result", "tool_use_id": b.id, "content": "(no output)"}
            for b in message.content
            if b.type == "tool_use"
        ]
        messages.append({"role": "user", "content": results or "ok"})


def google_session(client, *, stream):
    tool = types.Tool(
        function_declarations=[
            types.FunctionDeclaration(
                name="run",
                description="Run a shell command.",
                parameters_json_schema={"type": "object", "properties": {"command": {"type": "string"}}},
            )
        ]
    )
    config = types.GenerateContentConfig(
        system_instruction="You are a coding agent.",
        tools=[tool],
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
    )
    contents = [types.Content(role="user", parts=[types.Part(text="Write hi into out.txt.")])]
    for _ in SCRIPT:
        if stream:
            chunks = client.models.generate_content_stream(model="gemini-2.5-pro", contents=contents, config=config)
            parts = [
                p
                for c in chunks
                if c.candidates and c.candidates[0].content
                for p in c.candidates[0].content.parts or []
            ]
        else:
            response = client.models.generate_content(model="gemini-2.5-pro", contents=contents, config=config)
            parts = response.candidates[0].content.parts
        contents = [*contents, types.Content(role="model", parts=parts)]
        calls = [p.function_call for p in parts if p.function_call]
        answer = [
            types.Part(function_response=types.FunctionResponse(name=c.name, response={"output": ""})) for c in calls
        ]
        contents.append(types.Content(role="user", parts=answer or [types.Part(text="ok")]))


def test_untranslated_native_calls_retokenize_to_the_tokens_the_model_saw(tiny_model_dir, tmp_path):
    with chain(tiny_model_dir, tmp_path, translate_outer="never") as (outer, outer_dir, inner_dir):
        for session, stream in (("claude-streamed", True), ("claude-plain", False)):
            with anthropic.Anthropic(base_url=outer.url, api_key=session, max_retries=0) as client:
                anthropic_session(client, stream=stream)
        for session, stream in (("gemini-streamed", True), ("gemini-plain", False)):
            options = types.HttpOptions(base_url=outer.url, timeout=60_000)
            google_session(genai.Client(api_key=session, http_options=options), stream=stream)
        outer_records = read_records(outer_dir, expect=8)
        read_records(inner_dir, expect=8)
    assert {r["api"] for r in outer_records} == {"anthropic", "google"}
    assert all(r["upstream_request"] is None and r["injected"] == {} for r in outer_records)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    retokenized, stats = reconstruct([outer_dir], tokenizer=tokenizer)
    captured, _ = reconstruct([inner_dir])
    assert stats.retokenized_calls == stats.calls == 8 and stats.dropped == {}
    assert_same_tokens(by_session(retokenized), by_session(captured))
    without_tokenizer, stats = reconstruct([outer_dir])
    assert without_tokenizer.height == 0 and stats.dropped == {"missing_ids": 8}
