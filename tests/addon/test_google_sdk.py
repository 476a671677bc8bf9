"""The official `google-genai` SDK through a real `mitmdump` with the addon, the reference server behind it.

The SDK speaks Gemini's generateContent (streamed with ``alt=sse``); the addon answers it from the
server's Chat Completions, so the SDK's own parsers judge our events.
"""

import pytest
from google import genai
from google.genai import errors, types
from transformers import AutoTokenizer

from tests.captures import read_records, scripted_proxy, tokens_of

pytestmark = pytest.mark.slow

MODEL = "gemini-2.5-flash"  # what the harness asks for; the proxy serves it with "tiny"
REASONING = "The user wants a file; a shell command writes it."
SCRIPT = [
    {
        "reasoning": REASONING,
        "content": None,
        "tool_calls": [{"name": "run_shell_command", "arguments": {"command": "echo hi > out.txt"}}],
    },
    {"content": "Done: out.txt holds hi.", "tool_calls": []},
]
SHELL = types.FunctionDeclaration(
    name="run_shell_command",
    description="Run a shell command.",
    parameters=types.Schema(type="OBJECT", properties={"command": types.Schema(type="STRING")}, required=["command"]),
)
CONFIG = types.GenerateContentConfig(
    system_instruction="You are a coding agent.",
    tools=[types.Tool(function_declarations=[SHELL])],
    temperature=0,
    max_output_tokens=200,
    thinking_config=types.ThinkingConfig(include_thoughts=True),
    # A request the SDK would otherwise answer itself with tool calls it runs: we send results by hand.
    automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
)
FIRST_TURN = [types.Content(role="user", parts=[types.Part(text="Write hi into out.txt.")])]


@pytest.fixture(scope="module")
def proxy(tiny_model_dir, tmp_path_factory):
    with scripted_proxy(tiny_model_dir, SCRIPT, tmp_path_factory.mktemp("google_sdk"), polar_model="tiny") as mitm:
        yield mitm


def client(proxy, session):
    # The API key is the session id; the SDK sends it as x-goog-api-key.
    options = types.HttpOptions(base_url=proxy.url, timeout=60_000, retry_options=types.HttpRetryOptions(attempts=1))
    return genai.Client(api_key=session, http_options=options)


def generate(c, contents, *, stream, config=CONFIG):
    """One model turn's responses: every streamed one, or the single answer."""
    if stream:
        return list(c.models.generate_content_stream(model=MODEL, contents=contents, config=config))
    return [c.models.generate_content(model=MODEL, contents=contents, config=config)]


def ask(c, contents, *, stream):
    """One model turn as (thought text, the parts a harness keeps: non-thought ones, finish reason)."""
    responses = generate(c, contents, stream=stream)
    assert all(r.model_version == MODEL for r in responses)
    parts = [p for r in responses for p in (r.candidates[0].content.parts or [] if r.candidates[0].content else [])]
    thoughts = "".join(p.text for p in parts if p.thought)
    return thoughts, merge_text([p for p in parts if not p.thought]), responses[-1].candidates[0].finish_reason


def merge_text(parts):
    """Streamed text arrives in pieces: join neighbouring text parts, keeping the first one's signature."""
    merged = []
    for part in parts:
        if merged and part.text is not None and merged[-1].text is not None:
            merged[-1] = merged[-1].model_copy(update={"text": merged[-1].text + part.text})
        else:
            merged.append(part)
    return merged


def two_turns(c, *, stream):
    first = ask(c, FIRST_TURN, stream=stream)
    call = next(p.function_call for p in first[1] if p.function_call)
    reply = types.Part.from_function_response(name=call.name, response={"output": ""})
    history = [*FIRST_TURN, types.Content(role="model", parts=first[1]), types.Content(role="user", parts=[reply])]
    return first, ask(c, history, stream=stream)


@pytest.fixture(scope="module")
def both(proxy):
    """The scripted session, streamed and not, each in a session of its own."""
    return {stream: two_turns(client(proxy, f"sess-google-{stream}"), stream=stream) for stream in (True, False)}


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "non-streamed"])
def test_function_call_round_trip(stream, both):
    (thoughts, parts, finish), (_, final, final_finish) = both[stream]
    assert thoughts == REASONING and finish == types.FinishReason.STOP
    (call,) = [p.function_call for p in parts if p.function_call]
    assert call.name == "run_shell_command" and call.args == {"command": "echo hi > out.txt"}
    assert parts[0].thought_signature  # the reasoning rides on the first part the harness keeps
    assert [p.text for p in final] == ["Done: out.txt holds hi."] and final_finish == types.FinishReason.STOP


def test_streamed_parts_equal_the_non_streamed_answer(both):
    dump = [
        [(t, [p.model_dump(exclude_none=True) for p in parts], f) for t, parts, f in turns]
        for turns in (both[True], both[False])
    ]
    assert dump[0] == dump[1]


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "non-streamed"])
def test_records_chain_token_by_token_with_the_reasoning_sent_back(stream, both, proxy, tiny_model_dir):
    records = read_records(proxy.captures, session=f"sess-google-{stream}", expect=2)
    assert len(records) == 2
    for record in records:
        assert (
            record["api"] == "google"
            and record["complete"]
            and record["status"] == 200
            and record["streamed"] is stream
        )
        assert record["session_source"] == "api_key" and record["request"]["contents"]
        prompt, ids, logprobs = tokens_of(record)
        assert prompt and len(logprobs) == len(ids) > 0
    second = records[1]["upstream_request"]
    assert second["model"] == "tiny" and second["messages"][2]["reasoning"] == REASONING  # decoded from the signature
    (prompt0, ids0, _), (prompt1, _, _) = tokens_of(records[0]), tokens_of(records[1])
    assert prompt1[: len(prompt0) + len(ids0)] == prompt0 + ids0
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert REASONING in tokenizer.decode(ids0) and "echo hi > out.txt" in tokenizer.decode(ids0)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "non-streamed"])
def test_upstream_error_is_an_api_error_in_googles_shape(stream, proxy):
    c = client(proxy, f"sess-google-error-{stream}")
    # A history longer than the model's context: the upstream refuses it (an output cap beyond the context the
    # addon cuts to fit instead, tests/addon/test_clamp.py).
    history = [types.Content(role="user", parts=[types.Part(text="hello " * 40_000)])]
    with pytest.raises(errors.APIError) as raised:
        generate(c, history, stream=stream, config=CONFIG)
    assert raised.value.code == 400 and raised.value.status == "INVALID_ARGUMENT"
    assert raised.value.message.startswith("The input token count exceeds the maximum number of tokens allowed.")
    (record,) = read_records(proxy.captures, session=f"sess-google-error-{stream}", expect=1)
    assert record["status"] == 400 and record["api"] == "google"
