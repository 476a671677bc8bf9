"""Malformed native requests get a 400 in their API's own error shape, never a crash (issue 16, item 4).

Real request bodies of each native API (Claude Code, Codex, Gemini CLI shapes), mutated one field at a time to
every JSON kind it does not have, go through the translators in process; a few go over the wire through a real
``mitmdump`` with the addon. Every mutation of a field is tried (no sampling), so the run is the same each time.
"""

import copy
import json

import httpx
import pytest

from addon import anthropic, google, native, responses, translating
from eval.sessions.procs import Mitmdump, free_port

OPTIONS = native.Options(model="", upstream="vllm")
SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
OURS = native.mint_reasoning("List first.")

CLAUDE_CODE = {
    "model": "claude-sonnet-4-5",
    "max_tokens": 32000,
    "temperature": 1,
    "top_p": 0.9,
    "top_k": 40,
    "stop_sequences": ["</done>"],
    "stream": True,
    "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=9f3e1;\nYou are Claude Code."},
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
    ],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "fix it"}, {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}]},
        {"role": "system", "content": "Agents: Explore."},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "List first.", "signature": OURS},
                {"type": "redacted_thinking", "data": "EoQB"},
                {"type": "text", "text": "Listing."},
                {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": False,
                 "content": [{"type": "text", "text": "a.txt"}, {"type": "image", "source": {"type": "url", "url": "https://e.com/a.png"}}]},
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "notes"}},
                {"type": "text", "text": "go"},
            ],
        },
        {"role": "assistant", "content": "Sure:"},
    ],
    "tools": [{"name": "Bash", "description": "Run a command.", "input_schema": SCHEMA}, {"type": "web_search_20250305", "name": "web_search"}],
    "tool_choice": {"type": "tool", "name": "Bash", "disable_parallel_tool_use": True},
    "thinking": {"type": "enabled", "budget_tokens": 1024},
    "chat_template_kwargs": {"enable_thinking": True},
    "metadata": {"user_id": "u1"},
}  # fmt: skip

CODEX = {
    "model": "gpt-5-codex",
    "instructions": "You are Codex.",
    "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: workspace-write."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Write hi."}, {"type": "input_image", "image_url": "data:image/png;base64,iVBO", "detail": "low"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": OURS},
        {"type": "reasoning", "id": "rs_2", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "exec_command", "arguments": '{"cmd":"ls"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "a.txt"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Writing it."}]},
        {"type": "local_shell_call", "id": "ls_1", "call_id": "call_c", "status": "completed", "action": {"type": "exec", "command": ["touch", "hi"]}},
        {"type": "local_shell_call_output", "id": "call_c", "output": [{"type": "input_text", "text": "done"}]},
        {"role": "user", "content": "Thanks."},
    ],
    "tools": [{"type": "function", "name": "exec_command", "description": "Run.", "parameters": SCHEMA, "strict": False}, {"type": "web_search"}],
    "tool_choice": {"type": "function", "name": "exec_command"},
    "parallel_tool_calls": True,
    "max_output_tokens": 4096,
    "temperature": 0.5,
    "top_p": 1,
    "text": {"format": {"type": "json_schema", "name": "out", "schema": SCHEMA, "strict": True}},
    "reasoning": {"effort": "medium", "summary": "auto"},
    "chat_template_kwargs": {"enable_thinking": True},
    "include": ["reasoning.encrypted_content"],
    "store": False,
    "stream": True,
    "metadata": {"x": "y"},
    "truncation": "disabled",
}  # fmt: skip

GEMINI_CLI = {
    "contents": [
        {"role": "user", "parts": [{"text": "Write hi."}, {"inlineData": {"mimeType": "image/png", "data": "iVBO"}}]},
        {"role": "model", "parts": [{"text": "hm", "thought": True}, {"functionCall": {"name": "run_shell_command", "args": {"command": "ls"}, "id": "c1"}, "thoughtSignature": "c2ln"}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "run_shell_command", "id": "c1", "response": {"output": "a.txt"}}}]},
        {"role": "model", "parts": [{"text": "Done."}]},
        {"role": "user", "parts": [{"text": "Thanks."}]},
    ],
    "systemInstruction": {"role": "user", "parts": [{"text": "You are Gemini CLI."}]},
    "tools": [{"functionDeclarations": [
        {"name": "run_shell_command", "description": "Run.", "parameters": {"type": "OBJECT", "properties": {"command": {"type": "STRING"}}}},
        {"name": "read_file", "parametersJsonSchema": SCHEMA},
    ]}, {"googleSearch": {}}],
    "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["run_shell_command"]}},
    "generationConfig": {
        "temperature": 0, "topP": 1, "topK": 40, "maxOutputTokens": 2048, "stopSequences": ["END"], "seed": 3,
        "presencePenalty": 0, "frequencyPenalty": 0, "candidateCount": 1, "responseMimeType": "application/json",
        "responseSchema": {"type": "OBJECT", "properties": {"a": {"type": "STRING"}}},
        "thinking_config": {"include_thoughts": True, "thinking_budget": -1},
    },
}  # fmt: skip

APIS = {
    "anthropic": (anthropic, CLAUDE_CODE, "/v1/messages?beta=true"),
    "responses": (responses, CODEX, "/v1/responses"),
    "google": (google, GEMINI_CLI, "/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse"),
}
# Every JSON kind, twice where emptiness matters; a field is tried with each one it is not.
VALUES = [None, True, 0, -1.5, "", "x", [], [0], ["x"], [None], {}, {"x": 0}]

# An upstream answer of every kind of output (reasoning, text, a tool call), whole and streamed.
ANSWER = {
    "id": "chatcmpl-1", "object": "chat.completion", "model": "m", "prompt_token_ids": [1, 2, 3],
    "choices": [{"index": 0, "finish_reason": "tool_calls", "token_ids": [4, 5], "message": {
        "role": "assistant", "reasoning": "hm", "content": "Sure.",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}]}}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
}  # fmt: skip
CHUNKS = [
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "delta": {"role": "assistant", "reasoning": "hm"}}]},
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "Sure."}}]},
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}]}}]},
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [], "usage": ANSWER["usage"]},
]  # fmt: skip


def paths(value, path=()):
    """Every place in a JSON value: object fields and array items, at any depth."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return
    for key, child in items:
        yield (*path, key)
        yield from paths(child, (*path, key))


def mutations(body):
    """(path, value, mutated body) for every field and every JSON value of another kind."""
    for path in paths(body):
        *parent_path, key = path
        for value in VALUES:
            mutated = copy.deepcopy(body)
            parent = mutated
            for step in parent_path:
                parent = parent[step]
            if native.json_kind(parent[key]) == native.json_kind(value) and parent[key] == value:
                continue
            parent[key] = value
            yield path, value, mutated


def translate(module, body, path):
    """What the addon does with a body: a 400 (BadRequest) or a translation that answers, whole and streamed."""
    started = module.start(copy.deepcopy(body), path, {}, OPTIONS)
    if isinstance(started, native.LocalAnswer):
        return json.dumps(started.body)
    json.dumps(started.chat_body, allow_nan=False)  # what goes upstream is JSON
    json.dumps(started.answer(copy.deepcopy(ANSWER)))
    stream = [started.events(copy.deepcopy(chunk)) for chunk in CHUNKS] + [started.finish(True)]
    again = module.start(copy.deepcopy(body), path, {}, OPTIONS)
    return b"".join(stream) + again.events(copy.deepcopy(CHUNKS[0])) + again.finish(False)


@pytest.mark.parametrize("api", APIS)
def test_the_real_bodies_translate(api):
    module, body, path = APIS[api]
    assert translate(module, body, path)


@pytest.mark.parametrize("api", APIS)
def test_every_type_mutation_is_translated_or_refused_with_a_400_naming_the_field(api):
    module, body, path = APIS[api]
    tried, refused, crashes = 0, 0, []
    for where, value, mutated in mutations(body):
        tried += 1
        try:
            translate(module, mutated, path)
        except native.BadRequest as e:
            refused += 1
            message = str(e)
            assert message and str(where[0]) in message.replace("thinking_config", "thinkingConfig"), (
                where,
                value,
                message,
            )
            error = module.error_body(400, message)
            assert json.dumps(error) and message in json.dumps(error)
        except Exception as e:  # noqa: BLE001 - the point: nothing else may escape
            crashes.append(f"{'.'.join(map(str, where))} = {value!r}: {type(e).__name__}: {e}")
    assert not crashes, f"{len(crashes)} of {tried} mutations crashed the {api} translator:\n" + "\n".join(crashes[:40])
    assert tried > 300 and refused > tried // 4, (tried, refused)


def test_a_field_of_the_wrong_kind_is_named_in_each_api_s_words():
    with pytest.raises(native.BadRequest, match=r"^system: expected a string or an array of objects, got a number$"):
        anthropic.start({**CLAUDE_CODE, "system": 5}, "/v1/messages", {}, OPTIONS)
    body = copy.deepcopy(CLAUDE_CODE)
    body["messages"][0]["content"][1]["source"] = "x"
    with pytest.raises(native.BadRequest, match=r"^messages\.0\.content\.1\.source: expected an object, got a string$"):
        anthropic.start(body, "/v1/messages", {}, OPTIONS)
    body = copy.deepcopy(CODEX)
    body["input"][3]["content"][0]["text"] = 5
    with pytest.raises(
        native.BadRequest,
        match=r"^Invalid type for 'input\[3\]\.content\[0\]\.text': expected a string, but got a number instead\.$",
    ) as raised:
        responses.start(body, "/v1/responses", {}, OPTIONS)
    assert raised.value.param == "input[3].content[0].text"
    assert (
        responses.error_body(400, str(raised.value), param=raised.value.param)["error"]["param"]
        == "input[3].content[0].text"
    )
    with pytest.raises(
        native.BadRequest,
        match=r"^Invalid value at 'tools\[0\]\.functionDeclarations': expected an array of objects, got an object$",
    ):
        google.start({**GEMINI_CLI, "tools": [{"function_declarations": {}}]}, APIS["google"][2], {}, OPTIONS)


# --- over the wire: a real mitmdump answers malformed bodies itself, before any upstream ---------------------------

WIRE = [
    ("/v1/messages", {**CLAUDE_CODE, "system": 5}, "system"),
    ("/v1/messages", {**CLAUDE_CODE, "tools": [{"name": "Bash", "input_schema": 5}]}, "tools.0.input_schema"),
    ("/v1/messages", {**CLAUDE_CODE, "tool_choice": {"type": []}}, "tool_choice.type"),
    (
        "/v1/messages",
        {**CLAUDE_CODE, "messages": [{"role": "user", "content": [{"type": "image", "source": 5}]}]},
        "messages.0.content.0.source",
    ),
    ("/v1/responses", {**CODEX, "tools": {"type": "function"}}, "tools"),
    (
        "/v1/responses",
        {**CODEX, "input": [{"type": "reasoning", "encrypted_content": 5}]},
        "input[0].encrypted_content",
    ),
    (
        "/v1beta/models/g:generateContent",
        {**GEMINI_CLI, "tools": [{"functionDeclarations": 5}]},
        "tools[0].functionDeclarations",
    ),
]


@pytest.mark.slow
def test_malformed_bodies_over_the_wire_get_400_in_the_api_s_shape(tmp_path):
    """No upstream listens: the addon must answer each one itself, as its API's 400, with no Python in it."""
    with Mitmdump(f"http://127.0.0.1:{free_port()}", tmp_path / "captures", log=tmp_path / "mitmdump.log") as mitm:
        for path, body, field in WIRE:
            r = httpx.post(f"{mitm.url}{path}", json=body, headers={"x-api-key": "sess-fuzz"}, timeout=60)
            assert r.status_code == 400, (path, field, r.text)
            error = r.json()["error"]
            assert field in error["message"] and "Error" not in error["message"], (field, error)
            if path.endswith("/messages"):
                assert r.json()["type"] == "error" and error["type"] == "invalid_request_error"
            elif path.endswith("/responses"):
                assert error["type"] == "invalid_request_error" and error["param"] == field
            else:
                assert (error["code"], error["status"]) == (400, "INVALID_ARGUMENT")
    log = (tmp_path / "mitmdump.log").read_text()
    assert "Traceback" not in log, log[-3000:]


def test_a_translator_bug_is_a_400_without_exception_text(monkeypatch):
    """Defence in depth: should a body slip past the field checks and crash a translator, the client still gets its
    API's 400 (the log names the exception, the answer does not)."""
    from mitmproxy.test import tflow

    def broken(*args):
        raise TypeError("'int' object is not iterable")

    monkeypatch.setattr(anthropic, "start", broken)
    flow = tflow.tflow()
    flow.request.path = "/v1/messages"
    ex = type(
        "Ex", (), {"api": "anthropic", "path": "/v1/messages", "request": type("B", (), {"value": {}})(), "error": None}
    )()
    translating.translate_request(flow, ex, {}, OPTIONS)
    assert flow.response.status_code == 400
    body = json.loads(flow.response.content)
    assert body["error"]["type"] == "invalid_request_error" and "TypeError" not in body["error"]["message"]
    assert ex.error["kind"] == "translate" and "TypeError" in ex.error["message"]
